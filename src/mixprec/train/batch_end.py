"""What follows a training batch's step in ``Trainer.fit``: the loss read, the counters,
the scaler's health, the epoch's metrics and the batch's callbacks.

A batch is done once its update went in. Its callbacks (a scheduler, an EMA, a step
checkpoint) then run whatever raises after the update: a metric, the health watch, or the
step itself after its update (a step post-hook, Ctrl-C in the copy-back to the 16-bit
weights, ``LossScaleOptimizer.applied_before_raising``). Else a resume, which starts after
the batch, found the scheduler and the EMA one step behind, or applied the batch twice.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

import torch

from mixprec.optim import StepResult
from mixprec.train.callbacks import Callback
from mixprec.train.meter import EpochMeter

if TYPE_CHECKING:
    from mixprec.train.trainer import Trainer

__all__ = ["finish_batch", "finish_raised_step", "step_checkpoint_due"]


def step_checkpoint_due(trainer: Trainer, applied: bool) -> bool:
    """Whether rank 0 may write a step checkpoint after this step, agreed on every rank
    (the cadences are; empty outside torchrun)."""
    return applied and any(trainer.global_step % n == 0 for n in trainer._sync_cadences)


def finish_batch(
    trainer: Trainer,
    cbs: Callback,
    meter: EpochMeter,
    where: tuple[int, int, float],
    loss: torch.Tensor,
    result: StepResult,
    yb: Any,
) -> None:
    """The bookkeeping of a batch whose step returned (or went in and then raised);
    ``where``: the epoch, the batch's index in it and when its step started."""
    epoch, step, start = where
    trainer._step_in_epoch = step + 1
    loss_value = loss.item()  # after the step's own sync: no extra stall
    elapsed = time.perf_counter() - start
    # Plain bools for the logs (DeviceFlags on a device): read after the loss.
    applied, found_inf = bool(result.applied), bool(result.found_inf)
    trainer.global_step += applied
    logs = {
        "epoch": epoch,
        "loss": loss_value,
        "applied": applied,
        "found_inf": found_inf,
        "loss_scale": result.scale,
        "step_ms": 1000 * elapsed,
        "size": len(yb),
        "global_step": trainer.global_step,
        "overflow": str(result.overflow) if result.overflow else None,
    }
    try:
        if not result.accumulating:
            trainer._watch.observe(result, trainer.optimizer.loss_scaler, loss_value)
        meter.add(result, loss_value, elapsed, trainer.step.last_output, yb)
        if step_checkpoint_due(trainer, applied):  # rank 0 writes its resume next:
            meter.sync()  # the sums of every rank's share of the epoch so far
    finally:
        # The batch counts as done: its callbacks run also when the metrics raised.
        cbs.on_train_batch_end(step, logs)


def finish_raised_step(
    trainer: Trainer, cbs: Callback, meter: EpochMeter, where: tuple[int, int, float], yb: Any
) -> bool:
    """After the step raised: whether its update went in first, and then the batch's
    bookkeeping, run as for an applied step (the caller raises the error on)."""
    loss = trainer.step.last_loss  # None: it raised before its step (forward, backward)
    if loss is None or not trainer.optimizer.applied_before_raising:
        return False
    scale = trainer.optimizer.loss_scaler.get_scale()
    result = StepResult(applied=True, found_inf=False, scale=scale)
    finish_batch(trainer, cbs, meter, where, loss, result, yb)
    return True
