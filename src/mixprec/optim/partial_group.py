"""An accumulation group shorter than ``accumulation_steps`` applied as the mean of its
micro-batches: the last batches of an epoch (the Trainer's ``flush``, and a loop of one's own
that steps every N-th batch and once more at the epoch's end)."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from mixprec.optim.loss_scale_optimizer import LossScaleOptimizer
    from mixprec.optim.step_result import StepResult

__all__ = ["apply_partial_group"]


def apply_partial_group(optimizer: LossScaleOptimizer) -> StepResult:
    """``optimizer.step()``, applying the accumulated gradients even when fewer than
    ``accumulation_steps`` micro-steps were taken, after a ``backward``.

    Each micro-step's backward added ``grad / accumulation_steps``; a group of ``k`` is
    rescaled by ``accumulation_steps / k`` in the unscale's pass (a 16-bit gradient in its
    float32 master), so the update is the mean over the ``k`` micro-steps, as a full
    group's is over its own. The finiteness check sees the rescaled gradients; clipping and
    the loss scale's update then run as on any step."""
    taken = optimizer.pending_micro_steps  # this backward included; 0 for a full group
    group = optimizer.accumulation_steps
    if not 0 < taken < group:
        return optimizer.step()
    optimizer.accumulation_steps = taken  # a group of `taken`, for this step only
    try:
        # The rescale in the unscale's own pass, before its inf/NaN check: multiplied after
        # it, an O3 float16 gradient could overflow past the check into the weight. An
        # unscale_() of the user's (to clip) did it already (checks.unscale_group_factor).
        if optimizer._book.found_inf is None:
            optimizer.unscale_(factor=group / taken)
        return optimizer.step()
    finally:
        optimizer.accumulation_steps = group
