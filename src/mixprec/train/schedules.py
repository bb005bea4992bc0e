"""Callbacks that act on training after each applied step: ``LearningRateScheduler`` and
``EMA``. Both keep state that ``fit(resume_from=...)`` restores (``state_dict``), so a
resumed run schedules and averages as an uninterrupted one."""

from __future__ import annotations

from typing import Any

import torch

from mixprec._errors import ArgumentError, is_number
from mixprec.train.callbacks import Callback, Logs

__all__ = ["EMA", "LearningRateScheduler"]


class LearningRateScheduler(Callback):
    """Steps a ``torch.optim.lr_scheduler`` after every applied step (``interval="step"``)
    or at the end of every epoch (``"epoch"``). Skipped steps do not advance it. Its state
    is saved in ``ModelCheckpoint``'s checkpoints and restored on resume."""

    def __init__(self, scheduler: Any, interval: str = "step") -> None:
        if interval not in ("step", "epoch"):
            raise ArgumentError(f"interval={interval!r} is invalid; valid: 'step', 'epoch'")
        if isinstance(scheduler, torch.optim.lr_scheduler.ReduceLROnPlateau):
            # Its step() takes the metric: it failed after a whole epoch, at the first step.
            raise ArgumentError(
                "scheduler=ReduceLROnPlateau is invalid here: LearningRateScheduler calls "
                "step() without a metric. Step it in a Callback of your own: "
                "on_epoch_end(self, epoch, logs): scheduler.step(logs['val_loss'])"
            )
        if not all(callable(getattr(scheduler, m, None)) for m in ("step", "state_dict")):
            raise ArgumentError(
                f"scheduler={type(scheduler).__name__} is invalid; valid: a torch.optim."
                "lr_scheduler (an object with step(), state_dict() and load_state_dict())"
            )
        self.scheduler = scheduler
        self.interval = interval

    def on_train_batch_end(self, step: int, logs: Logs) -> None:
        if self.interval == "step" and logs["applied"]:
            self.scheduler.step()

    def on_epoch_end(self, epoch: int, logs: Logs) -> None:
        if self.interval == "epoch":
            self.scheduler.step()

    def state_dict(self) -> dict[str, Any]:
        return {"scheduler": self.scheduler.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.scheduler.load_state_dict(state["scheduler"])
        # Resumed into an epoch's end (a state saved during its validation), the scheduler's
        # first step here comes before any optimizer step of this process, and torch warned
        # of the "old pattern" (skipping a schedule value) though the run had stepped.
        trainer = self.trainer
        optimizer = getattr(self.scheduler, "optimizer", None)
        if trainer is not None and trainer.global_step > 0 and optimizer is not None:
            optimizer._opt_called = True


class EMA(Callback):
    """An exponential moving average of the weights, in float32, updated on applied steps
    only: ``shadow = decay * shadow + (1 - decay) * weights`` (one multi-tensor lerp)."""

    def __init__(self, decay: float = 0.999) -> None:
        if not (is_number(decay) and 0.0 < decay < 1.0):  # "0.99" raised a bare TypeError
            raise ArgumentError(f"decay={decay!r} is invalid; it must be a number in (0, 1)")
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

    def copy_to_model(self) -> None:
        """Put the average into the model (to evaluate or save it): each float32 master
        takes its average and its 16-bit weight the rounding of it, so that the optimizer
        and a save hold the average too (``p.data.copy_`` of the model's parameters wrote
        the weights alone: a save then wrote the masters, and a step undid it). Training
        on from here trains from the average."""
        optimizer = self.attached.optimizer
        behind = {id(m): w for w, m in optimizer.master_weights()}
        with torch.no_grad():
            for target, average in zip(optimizer.master_params(), self.shadow, strict=True):
                target.copy_(average)
                weight = behind.get(id(target))
                if weight is not None:  # the master's 16-bit weight, followed as a write
                    weight.copy_(average)

    def state_dict(self) -> dict[str, Any]:
        return {"shadow": list(self.shadow), "updates": self.updates}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        shadow = [t.float() for t in state["shadow"]]
        if [t.shape for t in shadow] != [t.shape for t in self._weights()]:
            raise ValueError(
                f"EMA state: {len(shadow)} averaged tensors that do not match this model's "
                f"{len(self._weights())} weights; resume with the model it was saved from"
            )
        device = self._weights()[0].device if shadow else None
        self.shadow = [t.to(device) for t in shadow]
        self.updates = int(state["updates"])
