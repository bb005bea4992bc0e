"""Training callbacks, in the Keras style: the Trainer calls ``on_train_begin``,
``on_epoch_begin``, ``on_train_batch_end`` (after every optimizer step, with ``applied``),
``on_epoch_end`` and ``on_train_end`` with a ``logs`` dict.

Batch logs: ``loss``, ``applied``, ``found_inf``, ``loss_scale``, ``step_ms``, ``size``
(samples), ``overflow`` (with ``trace_overflow``: where a skipped step's inf/NaN came from),
plus ``epoch`` and ``global_step`` (applied steps so far).
Epoch logs: ``loss``, the metrics, ``val_*``, ``ms_per_step``, ``samples_per_s``,
``loss_scale``, ``skipped_steps``.
"""

from __future__ import annotations

import csv
import math
import os
import sys
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any, TextIO

import numpy
import torch

from mixprec._errors import ArgumentError
from mixprec.checkpoint import save_checkpoint, temporary_files
from mixprec.scaling import NoOpLossScaler

if TYPE_CHECKING:
    from mixprec.train.trainer import Trainer

Logs = dict[str, Any]


class Callback:
    """Base class: override the hooks you need. ``self.trainer`` is set before training."""

    trainer: Trainer | None = None

    def set_trainer(self, trainer: Trainer) -> None:
        self.trainer = trainer

    @property
    def attached(self) -> Trainer:
        """The trainer this callback runs in (``RuntimeError`` outside of training)."""
        if self.trainer is None:
            raise RuntimeError(f"{type(self).__name__} is not attached to a Trainer")
        return self.trainer

    def on_train_begin(self, logs: Logs) -> None: ...
    def on_train_end(self, logs: Logs) -> None: ...
    def on_epoch_begin(self, epoch: int, logs: Logs) -> None: ...
    def on_epoch_end(self, epoch: int, logs: Logs) -> None: ...
    def on_train_batch_end(self, step: int, logs: Logs) -> None: ...


class CallbackList(Callback):
    """Calls every callback in order."""

    def __init__(self, callbacks: Iterable[Callback]) -> None:
        self.callbacks = list(callbacks)
        for cb in self.callbacks:
            if not isinstance(cb, Callback):
                raise ArgumentError(
                    f"callbacks must be mixprec Callback instances, got {type(cb).__name__}"
                )

    def set_trainer(self, trainer: Trainer) -> None:
        for cb in self.callbacks:
            cb.set_trainer(trainer)

    def on_train_begin(self, logs: Logs) -> None:
        for cb in self.callbacks:
            cb.on_train_begin(logs)

    def on_train_end(self, logs: Logs) -> None:
        for cb in self.callbacks:
            cb.on_train_end(logs)

    def on_epoch_begin(self, epoch: int, logs: Logs) -> None:
        for cb in self.callbacks:
            cb.on_epoch_begin(epoch, logs)

    def on_epoch_end(self, epoch: int, logs: Logs) -> None:
        for cb in self.callbacks:
            cb.on_epoch_end(epoch, logs)

    def on_train_batch_end(self, step: int, logs: Logs) -> None:
        for cb in self.callbacks:
            cb.on_train_batch_end(step, logs)


class History(Callback):
    """``history.history[key]`` is the list of per-epoch values (Keras' ``History``)."""

    def __init__(self) -> None:
        self.epoch: list[int] = []
        self.history: dict[str, list[Any]] = {}

    def on_epoch_end(self, epoch: int, logs: Logs) -> None:
        self.epoch.append(epoch)
        for key, value in logs.items():
            self.history.setdefault(key, []).append(value)


def _format(logs: Logs, keys: Iterable[str]) -> str:
    parts = []
    for key in keys:
        value = logs.get(key)
        if isinstance(value, float):
            parts.append(f"{key}: {value:.4g}")
        elif value is not None:
            parts.append(f"{key}: {value}")
    return " - ".join(parts)


def _scaling_on(callback: Callback) -> bool:
    """Whether the trainer ``callback`` runs in scales its loss: the scale is worth showing
    only then (it is 1 throughout with no scaler). Unattached, the scale is shown."""
    trainer = callback.trainer
    return trainer is None or not isinstance(trainer.optimizer.loss_scaler, NoOpLossScaler)


class ProgressBar(Callback):
    """A tqdm progress bar per epoch on a terminal; one plain line per epoch otherwise."""

    rank_zero_only = True  # under torchrun, only rank 0 prints and writes

    def __init__(self, stream: TextIO | None = None) -> None:
        self.stream = stream
        self._bar: Any = None
        self._epochs = 0

    def on_train_begin(self, logs: Logs) -> None:
        self._epochs = int(logs.get("epochs", 0))

    def on_epoch_begin(self, epoch: int, logs: Logs) -> None:
        stream = self.stream or sys.stderr
        if stream.isatty():
            from tqdm.auto import tqdm

            self._bar = tqdm(
                total=logs.get("steps"),
                desc=f"epoch {epoch + 1}/{self._epochs}",
                file=stream,
                leave=True,
                unit="step",
            )

    def on_train_batch_end(self, step: int, logs: Logs) -> None:
        if self._bar is not None:
            self._bar.update(1)
            if _scaling_on(self):
                self._bar.set_postfix(loss=f"{logs['loss']:.4f}", scale=f"{logs['loss_scale']:g}")
            else:
                self._bar.set_postfix(loss=f"{logs['loss']:.4f}")

    def on_epoch_end(self, epoch: int, logs: Logs) -> None:
        hidden = ("epoch",) if _scaling_on(self) else ("epoch", "loss_scale")
        keys = [k for k in logs if k not in hidden]
        line = f"epoch {epoch + 1}/{self._epochs} - {_format(logs, keys)}"
        if self._bar is not None:
            self._bar.set_postfix_str(_format(logs, ["loss", "val_loss", "val_accuracy"]))
            self._bar.close()
            self._bar = None
        else:
            print(line, file=self.stream or sys.stdout, flush=True)


class LossMonitor(Callback):
    """MindSpore's ``LossMonitor``: ``epoch: 1 step: 100, loss is 2.2883859`` every
    ``per_print_times`` steps (the step counted within the epoch, from 1)."""

    rank_zero_only = True  # under torchrun, only rank 0 prints and writes

    def __init__(self, per_print_times: int = 1, stream: TextIO | None = None) -> None:
        if isinstance(per_print_times, bool) or not isinstance(per_print_times, int):
            raise ArgumentError(f"per_print_times must be an int, got {per_print_times!r}")
        if per_print_times < 1:
            raise ArgumentError(f"per_print_times={per_print_times} is invalid; it must be >= 1")
        self.per_print_times = per_print_times
        self.stream = stream

    def on_train_batch_end(self, step: int, logs: Logs) -> None:
        if (step + 1) % self.per_print_times == 0:
            # MindSpore prints the float32 loss with the digits that identify it.
            loss = numpy.float32(logs["loss"])
            print(
                f"epoch: {logs['epoch'] + 1} step: {step + 1}, loss is {loss!s}",
                file=self.stream or sys.stdout,
                flush=True,
            )


class CSVLogger(Callback):
    """One CSV row per epoch: ``epoch`` and every epoch log."""

    rank_zero_only = True  # under torchrun, only rank 0 prints and writes

    def __init__(self, filename: str | os.PathLike[str], separator: str = ",") -> None:
        self.filename = Path(filename)
        self.separator = separator
        self._keys: list[str] | None = None

    def on_train_begin(self, logs: Logs) -> None:
        self._keys = None
        self.filename.parent.mkdir(parents=True, exist_ok=True)
        self.filename.write_text("")

    def on_epoch_end(self, epoch: int, logs: Logs) -> None:
        with self.filename.open("a", newline="") as f:
            writer = csv.writer(f, delimiter=self.separator)
            if self._keys is None:
                self._keys = [k for k in logs if k != "epoch"]
                writer.writerow(["epoch", *self._keys])
            writer.writerow([epoch, *(logs.get(k, "") for k in self._keys)])


class TensorBoard(Callback):
    """Scalars for TensorBoard: per step loss, loss scale, skipped steps and step time; per
    epoch every epoch log. Needs the ``tensorboard`` package (``mixprec[tensorboard]``)."""

    rank_zero_only = True  # under torchrun, only rank 0 prints and writes

    def __init__(self, log_dir: str | os.PathLike[str] = "runs") -> None:
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError as err:  # pragma: no cover - depends on the environment
            raise ImportError(
                "TensorBoard callback needs the tensorboard package: "
                'pip install "mixprec[tensorboard]"'
            ) from err
        self._writer_cls = SummaryWriter
        self.log_dir = str(log_dir)
        self._writer: Any = None
        self._step = 0
        self._skipped = 0

    def on_train_begin(self, logs: Logs) -> None:
        self._writer = self._writer_cls(self.log_dir)

    def on_train_batch_end(self, step: int, logs: Logs) -> None:
        self._step += 1
        self._skipped += int(not logs["applied"])
        for key, value in (
            ("train/loss", logs["loss"]),
            ("train/loss_scale", logs["loss_scale"]),
            ("train/skipped_steps", self._skipped),
            ("train/step_ms", logs["step_ms"]),
        ):
            self._writer.add_scalar(key, value, self._step)

    def on_epoch_end(self, epoch: int, logs: Logs) -> None:
        for key, value in logs.items():
            if isinstance(value, (int, float)) and key != "epoch":
                self._writer.add_scalar(f"epoch/{key}", value, epoch)
        self._writer.flush()

    def on_train_end(self, logs: Logs) -> None:
        if self._writer is not None:
            self._writer.close()


def _better(mode: str, current: float, best: float, min_delta: float = 0.0) -> bool:
    return current < best - min_delta if mode == "min" else current > best + min_delta


def _mode_for(monitor: str, mode: str) -> str:
    if mode not in ("auto", "min", "max"):
        raise ArgumentError(f"mode={mode!r} is invalid; valid: 'auto', 'min', 'max'")
    if mode != "auto":
        return mode
    return "max" if "acc" in monitor else "min"


class EarlyStopping(Callback):
    """Stop when ``monitor`` has not improved by ``min_delta`` for ``patience`` epochs."""

    def __init__(
        self,
        monitor: str = "val_loss",
        min_delta: float = 0.0,
        patience: int = 0,
        mode: str = "auto",
        restore_best_weights: bool = False,
    ) -> None:
        self.monitor = monitor
        self.min_delta = abs(min_delta)
        self.patience = patience
        self.mode = _mode_for(monitor, mode)
        self.restore_best_weights = restore_best_weights
        self.stopped_epoch: int | None = None

    def on_train_begin(self, logs: Logs) -> None:
        self._wait = 0
        self._best = math.inf if self.mode == "min" else -math.inf
        self._best_state: dict[str, Any] | None = None
        self.stopped_epoch = None

    def on_epoch_end(self, epoch: int, logs: Logs) -> None:
        if self.monitor not in logs:
            raise KeyError(
                f"EarlyStopping monitor={self.monitor!r} is not in the epoch logs; "
                f"available: {', '.join(logs)}"
            )
        current = float(logs[self.monitor])
        if _better(self.mode, current, self._best, self.min_delta):
            self._best, self._wait = current, 0
            if self.restore_best_weights:
                self._best_state = self.attached.state_dict()
            return
        self._wait += 1
        if self._wait >= self.patience:  # as Keras: patience=1 stops at the first miss
            self.stopped_epoch = epoch
            self.attached.stop_training = True
            if self.restore_best_weights and self._best_state is not None:
                self.attached.load_state_dict(self._best_state)


class ModelCheckpoint(Callback):
    """Save a checkpoint (``save_checkpoint``: model, optimizer with float32 masters and
    loss scaler, where training stands, RNG states) every ``every_n_epochs`` epochs or
    ``every_n_steps`` applied steps; keep the last ``keep_last``; with ``monitor``, also
    keep ``best.safetensors`` by that epoch log. ``fit(resume_from=path)`` continues."""

    rank_zero_only = True  # under torchrun, only rank 0 prints and writes

    def __init__(
        self,
        dirpath: str | os.PathLike[str],
        every_n_epochs: int | None = 1,
        every_n_steps: int | None = None,
        keep_last: int = 3,
        monitor: str | None = None,
        mode: str = "auto",
    ) -> None:
        if keep_last < 1:
            raise ArgumentError(f"keep_last={keep_last} is invalid; it must be >= 1")
        self.dirpath = Path(dirpath)
        self.every_n_epochs = every_n_epochs
        self.every_n_steps = every_n_steps
        self.keep_last = keep_last
        self.monitor = monitor
        self.mode = _mode_for(monitor or "", mode)
        self.saved: list[Path] = []
        self.best: float | None = None

    def on_train_begin(self, logs: Logs) -> None:
        self.dirpath.mkdir(parents=True, exist_ok=True)
        # A save killed mid-write leaves its temporary file: nothing else will remove it.
        for stale in temporary_files(self.dirpath):
            stale.unlink(missing_ok=True)
        # keep_last counts the checkpoints of earlier runs in this folder too (a restart).
        if not self.saved:
            earlier = [*self.dirpath.glob("step-*.safetensors")]
            earlier += self.dirpath.glob("epoch-*.safetensors")
            self.saved = sorted(earlier, key=lambda p: (p.stat().st_mtime_ns, p.name))

    def _write(self, path: Path) -> None:
        trainer = self.attached
        save_checkpoint(path, trainer.model, trainer.optimizer, trainer.resume_state())

    def _save(self, name: str) -> None:
        path = self.dirpath / name
        self._write(path)
        if path in self.saved:
            self.saved.remove(path)
        self.saved.append(path)
        while len(self.saved) > self.keep_last:
            self.saved.pop(0).unlink(missing_ok=True)

    def on_train_batch_end(self, step: int, logs: Logs) -> None:
        n = self.every_n_steps
        if n and logs["applied"] and logs["global_step"] % n == 0:
            self._save(f"step-{logs['global_step']:08d}.safetensors")

    def on_epoch_end(self, epoch: int, logs: Logs) -> None:
        n = self.every_n_epochs
        if n and (epoch + 1) % n == 0:
            self._save(f"epoch-{epoch + 1:04d}.safetensors")
        if self.monitor is not None and self.monitor in logs:
            current = float(logs[self.monitor])
            if self.best is None or _better(self.mode, current, self.best):
                self.best = current
                self._write(self.dirpath / "best.safetensors")


class LearningRateScheduler(Callback):
    """Steps a ``torch.optim.lr_scheduler`` after every applied step (``interval="step"``)
    or at the end of every epoch (``"epoch"``). Skipped steps do not advance it."""

    def __init__(self, scheduler: Any, interval: str = "step") -> None:
        if interval not in ("step", "epoch"):
            raise ArgumentError(f"interval={interval!r} is invalid; valid: 'step', 'epoch'")
        self.scheduler = scheduler
        self.interval = interval

    def on_train_batch_end(self, step: int, logs: Logs) -> None:
        if self.interval == "step" and logs["applied"]:
            self.scheduler.step()

    def on_epoch_end(self, epoch: int, logs: Logs) -> None:
        if self.interval == "epoch":
            self.scheduler.step()


class EMA(Callback):
    """An exponential moving average of the weights, in float32, updated on applied steps
    only: ``shadow = decay * shadow + (1 - decay) * weights`` (one multi-tensor lerp)."""

    def __init__(self, decay: float = 0.999) -> None:
        if not 0.0 < decay < 1.0:
            raise ArgumentError(f"decay={decay!r} is invalid; it must be in (0, 1)")
        self.decay = decay
        self.shadow: list[torch.Tensor] = []
        self.updates = 0

    def _weights(self) -> list[torch.Tensor]:
        return [p.detach() for p in self.attached.optimizer.master_params()]

    def on_train_begin(self, logs: Logs) -> None:
        if not self.shadow:
            self.shadow = [w.float().clone() for w in self._weights()]

    def on_train_batch_end(self, step: int, logs: Logs) -> None:
        if logs["applied"]:
            weights = [w.float() for w in self._weights()]
            torch._foreach_lerp_(self.shadow, weights, 1.0 - self.decay)
            self.updates += 1
