"""Callbacks that watch an epoch log: ``EarlyStopping`` and ``ModelCheckpoint``. What they
have seen (the best value, the epochs without improvement) is part of the checkpoints, so
that a resumed ``fit`` neither stops late nor overwrites ``best.safetensors`` with a worse
model."""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Any

import torch

from mixprec._errors import ArgumentError, check_int, check_path, is_number
from mixprec._warn import warn_at_caller
from mixprec.checkpoint import masters_in_place, save_checkpoint, temporary_files
from mixprec.train.callbacks import Callback, Logs

__all__ = ["EarlyStopping", "ModelCheckpoint"]


def _better(mode: str, current: float, best: float, min_delta: float = 0.0) -> bool:
    return current < best - min_delta if mode == "min" else current > best + min_delta


#: Epoch logs whose direction ``mode="auto"`` knows, by name (a ``val_`` prefix aside).
_LOWER_IS_BETTER = ("loss", "mae", "mse", "ms_per_step", "skipped_steps")
_HIGHER_IS_BETTER = ("acc", "samples_per_s")


def _mode_for(callback: str, monitor: str, mode: str) -> str:
    """``mode``, or for ``"auto"`` the direction the name says. A name it cannot place
    (``val_f1``, ``val_auc``) is refused: guessed "min", it would stop an improving run or
    keep the worst epoch as the best."""
    if mode not in ("auto", "min", "max"):
        raise ArgumentError(f"mode={mode!r} is invalid; valid: 'auto', 'min', 'max'")
    if mode != "auto":
        return mode
    name = monitor.removeprefix("val_")
    if name.endswith(_LOWER_IS_BETTER) or "loss" in name:
        return "min"
    if any(word in name for word in _HIGHER_IS_BETTER):
        return "max"
    raise ArgumentError(
        f"{callback}(monitor={monitor!r}, mode='auto'): mode='auto' cannot tell whether "
        f"{monitor!r} is better lower or higher (it knows losses, mae, mse and accuracy by "
        "name); give mode='min' or mode='max', or check the name's spelling"
    )


def _monitored(callback: str, monitor: str, logs: Logs) -> float:
    if monitor not in logs:
        raise KeyError(
            f"{callback} monitor={monitor!r} is not in the epoch logs; available: {', '.join(logs)}"
        )
    return float(logs[monitor])


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
        if not isinstance(monitor, str):
            raise ArgumentError(f"monitor={monitor!r} is invalid; it must be an epoch log's name")
        check_int("patience", patience, 0)
        if not is_number(min_delta) or not math.isfinite(
            min_delta
        ):  # NaN or inf made no epoch an improvement: every run stopped after `patience`
            raise ArgumentError(f"min_delta={min_delta!r} is invalid; it must be a finite number")
        self.monitor = monitor
        self.min_delta = abs(min_delta)
        self.patience = patience
        self.mode = _mode_for("EarlyStopping", monitor, mode)
        self.restore_best_weights = restore_best_weights
        self.stopped_epoch: int | None = None

    def on_train_begin(self, logs: Logs) -> None:
        self._wait = 0
        self._best = math.inf if self.mode == "min" else -math.inf
        self._best_state: dict[str, torch.Tensor] | None = None
        self.stopped_epoch = None

    def on_epoch_end(self, epoch: int, logs: Logs) -> None:
        current = _monitored("EarlyStopping", self.monitor, logs)
        if _better(self.mode, current, self._best, self.min_delta):
            self._best, self._wait = current, 0
            if self.restore_best_weights:
                self._best_state = self._weights()
            return
        self._wait += 1
        if self._wait >= self.patience:  # as Keras: patience=1 stops at the first miss
            self.stopped_epoch = epoch
            self.attached.stop_training = True

    def on_train_end(self, logs: Logs) -> None:
        # As Keras 3: at the end of fit, stopped early or not; after the last epoch's
        # checkpoint, which holds the weights that epoch ended with.
        if self.restore_best_weights and self._best_state is not None:
            self.attached.model.load_state_dict(self._best_state)

    def _weights(self) -> dict[str, torch.Tensor]:
        """The model's weights alone (Keras' ``get_weights``), each 16-bit one as its
        float32 master: loaded back, O2 keeps those digits for the masters to follow. The
        optimizer, the loss scale and the step count go on from where training stands."""
        model, optimizer = self.attached.model, self.attached.optimizer
        state = masters_in_place(model, [optimizer]) or model.state_dict()
        return {k: v.detach().clone() for k, v in state.items()}

    def state_dict(self) -> dict[str, Any]:
        # The best weights too, where they are to be restored: a checkpoint then holds the
        # model twice.
        return {
            "wait": self._wait,
            "best": self._best,
            "best_state": self._best_state,
            "stopped_epoch": self.stopped_epoch,  # a checkpoint of the epoch that stopped
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._wait, self._best = int(state["wait"]), float(state["best"])
        best = state["best_state"] if self.restore_best_weights else None
        if isinstance(best, dict) and "global_step" in best:  # a checkpoint before 2026-11-26
            best = best["model"]  # held the whole trainer; the weights are what is restored
        self._best_state = best
        stopped = state.get("stopped_epoch")  # None in a checkpoint before 2026-11-27
        if stopped is not None:
            # Written at the epoch it stopped (ModelCheckpoint saves after it): the run it
            # resumes ended there, and trained on for another epoch, unsaid.
            self.stopped_epoch = int(stopped)
            self.attached.stop_training = True
            warn_at_caller(
                f"EarlyStopping: the run this checkpoint is from stopped after epoch "
                f"{self.stopped_epoch + 1} ({self.monitor} did not improve for "
                f"{self.patience} epoch(s)), so this fit ends there too; to train on, resume "
                "without EarlyStopping, or with a new one after a first fit"
            )
        if self.restore_best_weights and best is None and math.isfinite(self._best):
            warn_at_caller(
                f"EarlyStopping(restore_best_weights=True) resumed from a checkpoint that kept "
                f"no best weights (saved with restore_best_weights=False): its best "
                f"{self.monitor} {self._best:.6g} cannot be restored. Only an epoch from here "
                "that beats it will be; the run ends with its last weights otherwise"
            )


class ModelCheckpoint(Callback):
    """Save a checkpoint (``save_checkpoint``: model, optimizer with float32 masters and
    loss scaler, where training stands, the callbacks' state, RNG states) every
    ``every_n_epochs`` epochs or ``every_n_steps`` applied steps; keep the last
    ``keep_last``; with ``monitor``, also keep ``best.safetensors`` by that epoch log.
    ``fit(resume_from=path)`` continues."""

    rank_zero_only = True  # under torchrun, only rank 0 prints and writes
    writes_checkpoints = True  # after the other callbacks: it saves their state

    def __init__(
        self,
        dirpath: str | os.PathLike[str],
        every_n_epochs: int | None = 1,
        every_n_steps: int | None = None,
        keep_last: int = 3,
        monitor: str | None = None,
        mode: str = "auto",
    ) -> None:
        check_int("every_n_epochs", every_n_epochs, 1, optional=True)
        check_int("every_n_steps", every_n_steps, 1, optional=True)
        check_int("keep_last", keep_last, 1)
        if every_n_epochs is None and every_n_steps is None and monitor is None:
            raise ArgumentError(
                "ModelCheckpoint would never save: every_n_epochs, every_n_steps and monitor "
                "are all None; give at least one"
            )
        check_path("ModelCheckpoint", "dirpath", dirpath, "folder")
        if monitor is not None and not isinstance(monitor, str):
            raise ArgumentError(f"monitor={monitor!r} is invalid; valid: an epoch log's name")
        self.dirpath = Path(dirpath)
        self.every_n_epochs = every_n_epochs
        self.every_n_steps = every_n_steps
        self.keep_last = keep_last
        self.monitor = monitor
        self.mode = _mode_for("ModelCheckpoint", "loss" if monitor is None else monitor, mode)
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
        if self.monitor is not None:
            current = _monitored("ModelCheckpoint", self.monitor, logs)
            # A NaN or inf epoch is never the best: kept first, no later value compared
            # better than NaN, and best.safetensors held the diverged weights for good.
            better = self.best is None or _better(self.mode, current, self.best)
            if math.isfinite(current) and better:
                best = self.dirpath / "best.safetensors"
                if self.best is None and best.exists():  # not this run's, nor resumed from
                    warn_at_caller(
                        f"ModelCheckpoint: {best} holds an earlier run's best, and this run "
                        f"(not resumed from that run: fit(resume_from=...)) replaces it with "
                        f"its own ({self.monitor} {current:.6g}). Give each run a directory "
                        "of its own to keep both"
                    )
                # Noted before the saves below, so that they hold it; put back if the write
                # fails, or a later fit compared against a best no file held.
                earlier, self.best = self.best, current
                try:
                    self._write(best)
                except BaseException:
                    self.best = earlier
                    raise
        n = self.every_n_epochs
        if n and (epoch + 1) % n == 0:
            self._save(f"epoch-{epoch + 1:04d}.safetensors")

    def state_dict(self) -> dict[str, Any] | None:
        return None if self.monitor is None else {"best": self.best}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.best = None if state["best"] is None else float(state["best"])
