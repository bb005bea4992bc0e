"""Learning-rate schedulers that advance only on applied optimizer steps.

Lightning steps a step-interval scheduler after every optimizer step, whatever the step did;
``MixprecPrecision.connect`` wraps each one so that a step skipped for an overflow does not
move it.
"""

from __future__ import annotations

from typing import Any

from mixprec.integrations.lightning.precision import _Record


class _HeldOnSkip:
    """A step-interval LR scheduler that stays where it is after a skipped optimizer step.

    Lightning steps schedulers after every optimizer step whatever the step did; this wrapper
    makes ``step()`` do nothing when its optimizer's last step was skipped for an overflow.
    Everything else, reads and writes, goes to the scheduler. Its class derives from the
    scheduler's (as Lightning's own ``LightningOptimizer`` does), so that ``isinstance`` in a
    user's ``lr_scheduler_step`` still holds."""

    _mixprec_scheduler: Any
    _mixprec_record: _Record

    def step(self, *args: Any, **kwargs: Any) -> Any:
        if self._mixprec_record.skipped:
            return None
        return self._mixprec_scheduler.step(*args, **kwargs)

    def state_dict(self) -> Any:
        return self._mixprec_scheduler.state_dict()

    def load_state_dict(self, state_dict: Any) -> None:
        self._mixprec_scheduler.load_state_dict(state_dict)

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_mixprec_"):  # during unpickling, before __dict__ is filled
            raise AttributeError(name)
        return getattr(self._mixprec_scheduler, name)

    def __setattr__(self, name: str, value: Any) -> None:
        setattr(self._mixprec_scheduler, name, value)

    def __reduce__(self) -> tuple[Any, ...]:
        return (_held_on_skip, (self._mixprec_scheduler, self._mixprec_record))

    def __repr__(self) -> str:
        return f"HeldOnSkip({self._mixprec_scheduler!r})"


_HELD_CLASSES: dict[type, type] = {}


def _held_class(kind: type) -> type:
    held = _HELD_CLASSES.get(kind)
    if held is None:
        held = _HELD_CLASSES[kind] = type(f"HeldOnSkip{kind.__name__}", (_HeldOnSkip, kind), {})
    return held


def _held_on_skip(scheduler: Any, record: _Record) -> _HeldOnSkip:
    held: _HeldOnSkip = object.__new__(_held_class(type(scheduler)))
    held.__dict__["_mixprec_scheduler"] = scheduler
    held.__dict__["_mixprec_record"] = record
    return held
