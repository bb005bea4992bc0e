"""``StepResult``: what one ``LossScaleOptimizer.step()`` did, so that learning-rate
schedulers, EMA and step counters advance only on applied steps; ``DeviceFlag``: its
``applied``/``found_inf`` when the step was decided on the device and is read only when
asked for (``optim.deferred``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from mixprec.trace import Overflow

if TYPE_CHECKING:
    import torch

    from mixprec.optim.deferred import Deferred

__all__ = ["DeviceFlag", "StepResult"]


class _Cell:
    """One step's ``found_inf``: a device tensor until ``Deferred.fold`` reads it."""

    __slots__ = ("deferred", "tensor", "value")

    def __init__(self, tensor: torch.Tensor, deferred: Deferred) -> None:
        self.tensor: torch.Tensor | None = tensor
        self.value: bool | None = None
        self.deferred = deferred


class DeviceFlag:
    """A bool that lives on the device until it is used: ``bool(flag)``, ``flag == True``,
    ``if result.applied:`` read it then (with every other step still unread, in one
    synchronisation). ``found_inf`` is the flag, ``applied`` its negation."""

    __slots__ = ("_cell", "_negated")

    def __init__(self, cell: _Cell, negated: bool = False) -> None:
        self._cell, self._negated = cell, negated

    def __bool__(self) -> bool:
        if self._cell.value is None:
            self._cell.deferred.fold()
        return bool(self._cell.value) != self._negated

    def __int__(self) -> int:
        return int(bool(self))

    def __index__(self) -> int:
        return int(bool(self))

    def __float__(self) -> float:
        return float(bool(self))

    def __add__(self, other: object) -> object:
        return int(bool(self)) + other  # type: ignore[operator]

    __radd__ = __add__

    def __invert__(self) -> DeviceFlag:
        return DeviceFlag(self._cell, not self._negated)

    def __eq__(self, other: object) -> bool:
        return bool(self) == (bool(other) if isinstance(other, (bool, DeviceFlag)) else other)

    def __hash__(self) -> int:
        return hash(bool(self))

    def __repr__(self) -> str:
        return repr(bool(self))

    def __reduce__(self) -> tuple[type[bool], tuple[bool]]:
        # Pickled or copied as the bool it stands for, not with the optimizer behind it.
        return bool, (bool(self),)


@dataclass(frozen=True)
class StepResult:
    """What one ``step()`` did.

    ``applied``: the update was made (advance schedulers, EMA, step counters only then);
    not on a skipped step, nor on a step where no parameter had a gradient.
    ``found_inf``: the gradients held inf/NaN, so the update was skipped.
    ``scale``: the loss scale the gradients were computed with.
    ``grad_norm``: total norm of the unscaled gradients when ``max_grad_norm`` is set.
    ``accumulating``: this call only closed a micro-batch of gradient accumulation.

    A step decided on the device (``optim.deferred``: CUDA or ``torch.compile(opt.step)``
    at a fixed scale) holds ``DeviceFlag`` s in ``applied`` and ``found_inf``: use them as
    bools; each read is a synchronisation, so read them when logging, not every step.
    ``bool(result)`` is ``applied``: ``if opt.step(): scheduler.step()``.
    """

    applied: bool | DeviceFlag
    found_inf: bool | DeviceFlag
    scale: float
    grad_norm: float | None = None
    accumulating: bool = False
    #: With ``trace_overflow``: the first module whose output or gradient was non-finite.
    overflow: Overflow | None = None

    def __bool__(self) -> bool:
        # ``if opt.step(): scheduler.step()`` reads as "if it was applied": without this a
        # dataclass is always true, and a scheduler advanced on skipped steps too.
        return bool(self.applied)

    @property
    def skipped(self) -> bool:
        """The step was due but not applied because of an overflow."""
        return bool(self.found_inf)
