"""Training callbacks, in the Keras style: the Trainer calls ``on_train_begin``,
``on_epoch_begin``, ``on_train_batch_end`` (after every optimizer step, with ``applied``),
``on_epoch_end`` and ``on_train_end`` with a ``logs`` dict.

Batch logs: ``loss``, ``applied``, ``found_inf``, ``loss_scale``, ``step_ms``, ``size``
(samples), ``overflow`` (with ``trace_overflow``: where a skipped step's inf/NaN came from),
plus ``epoch`` and ``global_step`` (applied steps so far).
Epoch logs: ``loss``, the metrics, ``val_*``, ``ms_per_step``, ``samples_per_s``,
``loss_scale``, ``skipped_steps``. ``on_train_begin``'s: ``epochs``, ``steps`` (per epoch)
and ``initial_epoch`` (where a resumed ``fit`` starts).

A callback with state to keep across a resume returns it from ``state_dict``. Callbacks
that write checkpoints (``writes_checkpoints``) run after the others at every hook, so a
checkpoint holds the others' state after this step or epoch, whatever the list's order.
Here the base class, ``History``, ``ProgressBar`` and ``LossMonitor``; ``loggers``,
``monitors`` and ``schedules`` hold the others.
"""

from __future__ import annotations

import sys
import warnings
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any, TextIO

import numpy

from mixprec._errors import ArgumentError, check_stream
from mixprec.scaling import NoOpLossScaler

if TYPE_CHECKING:
    from mixprec.train.trainer import Trainer

Logs = dict[str, Any]


class Callback:
    """Base class: override the hooks you need. ``self.trainer`` is set before training."""

    trainer: Trainer | None = None
    writes_checkpoints = False  # True: runs after the other callbacks at every hook

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

    def state_dict(self) -> dict[str, Any] | None:
        """What this callback needs to go on as if training had not stopped (a scheduler's
        position, a best value seen): saved in ``ModelCheckpoint``'s checkpoints and given
        to ``load_state_dict`` by ``fit(resume_from=...)``, after ``on_train_begin``.
        ``None`` (the default): nothing. Tensors, numbers, strings, lists and dicts."""
        return None

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Take what ``state_dict`` returned when the checkpoint was saved."""


def given_callbacks(callbacks: Any) -> list[Callback]:
    """``fit``'s ``callbacks`` as a list: an iterable of callbacks (checked one by one by
    ``CallbackList``); a single callback or anything else is refused, naming it."""
    if isinstance(callbacks, (Callback, str)) or not isinstance(callbacks, Iterable):
        one = isinstance(callbacks, Callback)
        raise ArgumentError(
            f"callbacks must be a list of Callback instances, got {type(callbacks).__name__}"
            + (f" (one callback: pass [{type(callbacks).__name__}(...)])" if one else "")
        )
    return list(callbacks)


class CallbackList(Callback):
    """Calls every callback in order, those that write checkpoints last. Every one runs
    even when an earlier one raises, and the first exception then goes on: a callback that
    stops the run right after a step still gets that step's checkpoint written, holding
    every callback's state after that step (a scheduler listed after the one that raised
    had not stepped, and its checkpoint resumed a step behind). At an epoch's and a batch's
    end, ``before_writers(batch_logs)`` runs between the two (``None`` at an epoch's end)
    (the Trainer gathers the ranks' RNG states there, as they are when a checkpoint is
    written), also on a rank that has no writer."""

    def __init__(self, callbacks: Iterable[Callback]) -> None:
        given = list(callbacks)
        for cb in given:
            if not isinstance(cb, Callback):
                raise ArgumentError(
                    f"callbacks must be mixprec Callback instances, got {type(cb).__name__}"
                )
        self._others = [cb for cb in given if not cb.writes_checkpoints]
        self._writers = [cb for cb in given if cb.writes_checkpoints]
        self.callbacks = self._others + self._writers
        self.before_writers: Callable[[Logs | None], None] = lambda batch_logs: None

    def _each(
        self, call: Callable[[Callback], None], between: Callable[[], None] | None = None
    ) -> None:
        raised: list[BaseException] = []
        for cb in self._others:
            try:
                call(cb)
            except BaseException as err:
                raised.append(err)
        try:
            if between is not None:
                between()
            for cb in self._writers:
                try:
                    call(cb)
                except BaseException as err:  # after another's error it went unsaid, as
                    raised.append(err)  # its __context__ only ("no checkpoint was written")
        finally:
            if raised:
                for later in raised[1:]:  # not lost: said beside the first, which goes on
                    warnings.warn(f"a later callback raised too: {later!r}", stacklevel=2)
                raise raised[0]

    def set_trainer(self, trainer: Trainer) -> None:
        for cb in self.callbacks:
            cb.set_trainer(trainer)

    def on_train_begin(self, logs: Logs) -> None:
        self._each(lambda cb: cb.on_train_begin(logs))

    def on_train_end(self, logs: Logs) -> None:
        self._each(lambda cb: cb.on_train_end(logs))

    def on_epoch_begin(self, epoch: int, logs: Logs) -> None:
        self._each(lambda cb: cb.on_epoch_begin(epoch, logs))

    def on_epoch_end(self, epoch: int, logs: Logs) -> None:
        self._each(lambda cb: cb.on_epoch_end(epoch, logs), lambda: self.before_writers(None))

    def on_train_batch_end(self, step: int, logs: Logs) -> None:
        self._each(lambda cb: cb.on_train_batch_end(step, logs), lambda: self.before_writers(logs))


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
        check_stream("ProgressBar", "stream", stream)
        self.stream = stream
        self._bar: Any = None
        self._epochs = 0

    def on_train_begin(self, logs: Logs) -> None:
        self._epochs = int(logs.get("epochs", 0))

    def on_epoch_begin(self, epoch: int, logs: Logs) -> None:
        stream = self.stream or sys.stderr
        isatty = getattr(stream, "isatty", None)  # a stream of one's own may lack it
        if callable(isatty) and isatty():
            from tqdm.auto import tqdm

            self._bar = tqdm(
                total=logs.get("steps"),
                initial=int(logs.get("initial_step", 0)),  # a resumed epoch's batches done
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
        check_stream("LossMonitor", "stream", stream)
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
