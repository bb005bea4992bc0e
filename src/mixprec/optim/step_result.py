"""``StepResult``: what one ``LossScaleOptimizer.step()`` did, so that learning-rate
schedulers, EMA and step counters advance only on applied steps."""

from __future__ import annotations

from dataclasses import dataclass

from mixprec.trace import Overflow

__all__ = ["StepResult"]


@dataclass(frozen=True)
class StepResult:
    """What one ``step()`` did.

    ``applied``: the update was made (advance schedulers, EMA, step counters only then);
    not on a skipped step, nor on a step where no parameter had a gradient.
    ``found_inf``: the gradients held inf/NaN, so the update was skipped.
    ``scale``: the loss scale the gradients were computed with.
    ``grad_norm``: total norm of the unscaled gradients when ``max_grad_norm`` is set.
    ``accumulating``: this call only closed a micro-batch of gradient accumulation.
    """

    applied: bool
    found_inf: bool
    scale: float
    grad_norm: float | None = None
    accumulating: bool = False
    #: With ``trace_overflow``: the first module whose output or gradient was non-finite.
    overflow: Overflow | None = None

    @property
    def skipped(self) -> bool:
        """The step was due but not applied because of an overflow."""
        return self.found_inf
