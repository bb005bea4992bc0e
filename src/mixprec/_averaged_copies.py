"""A torch ``AveragedModel`` (SWA, EMA) of a prepared model whose weights are 16-bit (O2,
O3) averages in 16 bits: an update smaller than half a unit in the last place of a weight
(1/256 of it in bfloat16) rounds away. At ``decay=0.999`` the average stopped moving: it
moved 0.002 where the model moved 0.02, and ended 2.1e-2 off a float32 run's average (the
model itself: 1.3e-2 off its float32 control).

``AveragedModel`` deep-copies the model, and the copy's ``TagKeeper`` tells this module.
The average is said at the next step, not at the copy, since the fix comes after it: made
float32 (``ema.module.float()``, with a per-tensor ``avg_fn``) it says nothing.
"""

from __future__ import annotations

import sys
import weakref

import torch
from torch import nn
from torch.optim.swa_utils import AveragedModel

from mixprec._dtypes import HALF_DTYPES, dtype_name
from mixprec._param_tags import keeper_of
from mixprec._warn import warn_at_caller

__all__ = ["PENDING", "say_averaged_copies", "watch_averaged_copies"]

_INIT = AveragedModel.__init__.__code__

#: A 16-bit weight of each AveragedModel made since the last step, weakly, and where it
#: was made; the step's check is this list's truth.
PENDING: list[tuple[weakref.ref[torch.Tensor], str]] = []


def watch_averaged_copies(model: nn.Module) -> None:
    """Have a deep copy of the prepared ``model`` note when it is an ``AveragedModel``'s."""
    keeper = keeper_of(model)
    if _note_if_averaged not in keeper.on_copy:
        keeper.on_copy.append(_note_if_averaged)


def _note_if_averaged(copy: nn.Module, params: list[torch.Tensor]) -> None:
    """Note this deep copy if it holds 16-bit weights and an ``AveragedModel`` is making it
    (a look up the stack, made only where a prepared model is copied)."""
    half = next((p for p in params if p.dtype in HALF_DTYPES), None)
    if half is None:
        return
    frame = sys._getframe(0)
    while frame is not None and frame.f_code is not _INIT:
        frame = frame.f_back  # type: ignore[assignment]
    if frame is not None:
        caller = frame.f_back
        where = f"{caller.f_code.co_filename}:{caller.f_lineno}" if caller else "?"
        PENDING.append((weakref.ref(half), where))


def say_averaged_copies() -> None:
    """Warn (at the step's caller) for each noted average that is still 16-bit."""
    noted = list(PENDING)
    PENDING.clear()
    for ref, where in noted:
        weight = ref()
        if weight is None or weight.dtype not in HALF_DTYPES:
            continue  # gone, or made float32 as advised
        name = dtype_name(weight.dtype)
        warn_at_caller(
            f"the AveragedModel made at {where} holds the model's {name} weights, so it "
            f"averages in {name}: an update below half a unit in the last place of a weight "
            "rounds away, and at decay=0.999 (or after a few hundred SWA updates) the average "
            "stops moving. Keep it in float32: give AveragedModel a per-tensor avg_fn "
            "(get_ema_avg_fn(decay) or get_swa_avg_fn(); a multi_avg_fn needs equal dtypes) "
            "and call its .module.float() before the first update_parameters; the Trainer's "
            "mp.EMA(decay) keeps a float32 average too"
        )
