"""``Deferred``: steps applied or skipped on the device, and read later all at once.

At a fixed loss scale (bfloat16, float32, a static scale) nothing about the next step
depends on whether this one overflowed, so nothing needs to be read on the host to apply
it: torch's fused Adam, AdamW and SGD kernels take ``found_inf`` and skip on the device
(``FusedStep.step(found_inf=...)``), and the masters are copied back whether or not they
moved. Where a read costs a device synchronisation (CUDA) or breaks the graph
(``torch.compile(opt.step)``) that is what ``LossScaleOptimizer`` does; on the host, where a
read is free, the default CPU step is faster (``optim.host_step``).

What the step did is then a device tensor. ``Deferred`` keeps them in order and reads them
in one go (``fold``) when something asks: a ``StepResult``'s ``applied``/``found_inf``, the
optimizer's ``loss_scaler`` or ``state_dict()``, a step on the host path, or every
``EVERY`` steps. Each read value then goes, in step order, to ``sink`` (the scaler's
counters and ``ScalerHealth``), so the counters and warnings are those of an eager run,
late by at most ``EVERY`` steps.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from mixprec.optim.step_result import DeviceFlag, StepResult, _Cell
from mixprec.scaling import NoOpLossScaler, StaticLossScaler

if TYPE_CHECKING:
    from mixprec.optim.loss_scale_optimizer import LossScaleOptimizer

__all__ = ["COPIED", "EVERY", "ON_DEVICE", "Deferred", "device_tail", "on_device"]

# Where a step stands once its update went in (``_Bookkeeping.stepped``, read by
# state_dict._after_raise): besides the count of inner optimizers stepped, the masters
# copied into the 16-bit weights, or the step decided on the device.
COPIED = -1
ON_DEVICE = -2

#: Steps read at once at the latest: the scaler's counters and the health warnings lag by
#: at most this many steps, and CUDA synchronises once per this many.
EVERY = 64


class Deferred:
    """Unread ``found_inf`` flags of steps decided on the device, in step order."""

    def __init__(self, sink: Callable[[bool], None]) -> None:
        self.sink = sink
        self.pending: list[_Cell] = []

    def add(self, found_inf: torch.Tensor) -> DeviceFlag:
        """Keep one step's 0-dim ``found_inf``; return it as a flag read when used."""
        cell = _Cell(found_inf, self)
        self.pending.append(cell)
        if len(self.pending) >= EVERY:
            self.fold()
        return DeviceFlag(cell)

    def fold(self) -> None:
        """Read every pending flag (one synchronisation) and give each to ``sink``."""
        if not self.pending:
            return
        cells, self.pending = self.pending, []
        tensors = [c.tensor for c in cells]
        # One step pending (a caller reading each step's result): no stack kernel.
        values = (
            [tensors[0].item()]  # type: ignore[union-attr]
            if len(tensors) == 1
            else torch.stack(tensors).tolist()  # type: ignore[arg-type]
        )
        for cell, value in zip(cells, values, strict=True):
            cell.value, cell.tensor = bool(value), None
        for cell in cells:
            self.sink(bool(cell.value))


#: On the host a read is free and ``host_step`` is faster; tests set this to run the device
#: path on CPU without compiling.
ON_HOST = False


def on_device(opt: LossScaleOptimizer) -> bool:
    """Whether this step is decided on the device: a fixed scale (no schedule reads the
    flag), one inner optimizer, nothing to clip, trace or check on the host (float16
    weights), no sparse gradient; on a GPU (or other non-CPU device), under
    ``torch.compile``, or with ``ON_HOST``. The inner optimizer must then also be one that
    ``FusedStep`` can step with ``found_inf`` (the caller asks it)."""
    weights = opt._weights
    return (
        type(opt._loss_scaler) in (NoOpLossScaler, StaticLossScaler)
        and len(opt.optimizers) == 1
        and opt.max_grad_norm is None
        and opt._tracer is None
        and not weights.checked
        and not weights.saw_sparse
        and not opt._book.post_hooks  # they run on applied steps only, known on the host
        and (not weights.on_host or ON_HOST or torch.compiler.is_compiling())
    )


def _tail(opt: LossScaleOptimizer, found_inf: torch.Tensor, scale: float) -> StepResult:
    """After the kernels (which skipped on the device where ``found_inf`` is set): the
    masters back into the 16-bit weights (unchanged on a skipped step, so the copy writes
    the same values), the step kept unread, the result as device flags."""
    opt._book.micro = 0
    opt._book.found_inf = None
    # A copy: under CUDA graphs the step's output buffer is overwritten by the next replay.
    found = found_inf.clone()
    flag = opt._book.deferred.add(found)
    # Decided on the device: a raise in the copy-back (Ctrl-C) finishes it as the flag
    # says (state_dict._after_raise), read then.
    opt._book.stepped, opt._book.device_found = ON_DEVICE, found
    opt._weights.copy_back()
    opt._book.stepped, opt._book.device_found = 0, None
    return StepResult(applied=~flag, found_inf=flag, scale=scale)


# Eager under torch.compile(opt.step): the graph holds the check and the kernels, which
# decide the step; this bookkeeping (a list that grows, a read every EVERY steps) would
# make guards that recompile every step.
device_tail = torch._disable_dynamo(_tail)  # type: ignore[attr-defined]
