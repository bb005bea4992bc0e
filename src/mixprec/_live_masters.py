"""Which float32 master each 16-bit weight stands for, while the ``LossScaleOptimizer``
that keeps it lives: a new optimizer over the same model (a second fit, a later phase)
starts from it, and so do a save, ``mp.to_float`` and the first step after the model was
widened (``model.float()``), rather than from the weight's rounding. Below ``casting`` and
``optim`` so that both read it."""

from __future__ import annotations

import functools
import weakref
from collections.abc import Iterable

import torch
from torch.utils.weak import WeakIdKeyDictionary

from mixprec._dtypes import HALF_DTYPES
from mixprec._float32_copies import (
    FP32_COPY_ATTR,
    LOADED_AT,
    current_float32_copy,
    remember_float32,
    take_float32_copy,
)
from mixprec._param_tags import carry_on_copy
from mixprec._strides import laid_out_as
from mixprec._warn import warn_at_caller

__all__ = [
    "drop_note",
    "float32_start",
    "float32_values",
    "forget_gone_master",
    "has_live_master",
    "live_master",
    "note_master",
    "say_masters_gone",
    "take_masters",
]

# weight -> (the latest master, weakly; the weight's 16-bit dtype when that master was made)
_LATEST: WeakIdKeyDictionary = WeakIdKeyDictionary()
_DIED_AT: WeakIdKeyDictionary = WeakIdKeyDictionary()  # weight -> its version as its master died


def note_master(p: torch.Tensor, master: torch.Tensor, stored: torch.dtype) -> None:
    """``master`` is now ``p``'s, for ``p`` stored in ``stored``: float32 values still kept on
    ``p`` (those a deep copy of the model carried, copied with its optimizer) go, as the
    master holds them."""
    _LATEST[p] = (weakref.ref(master, functools.partial(_died, weakref.ref(p))), stored)
    p.__dict__.pop(FP32_COPY_ATTR, None)


def drop_note(p: torch.Tensor) -> None:
    """``p``'s master was never used (its wrap was refused): no note of it, nor of its
    death, is kept."""
    _LATEST.pop(p, None)


def _died(weight: weakref.ref[torch.Tensor], _: object) -> None:
    """A master is gone: its weight's version then, so that a write since (a load: the
    weight its own again) is told from the roundings the master left."""
    p = weight()
    if p is not None:
        _DIED_AT[p] = p._version


def has_live_master(p: torch.Tensor) -> bool:
    """Whether a live ``LossScaleOptimizer`` keeps a master of ``p`` (a copy of a model
    trained by a wrapper of its own: its weights are written at each step by design)."""
    entry = _LATEST.get(p)
    return entry is not None and entry[0]() is not None


def live_master_of(p: torch.Tensor) -> tuple[torch.Tensor | None, bool]:
    """The latest master of ``p`` while it lives and ``p`` still rounds from it (in the
    16-bit dtype it was stored in, also once widened since), and whether such a master
    existed and is gone. A weight written since (a load) is its own."""
    entry = _LATEST.get(p)
    if entry is None:
        return None, False
    latest = entry[0]()
    if latest is not None and latest.shape == p.shape and latest.device == p.device:
        with torch.no_grad():
            if torch.equal(latest.to(entry[1]).to(p.dtype), p.detach()):
                return latest, False
    return None, latest is None


def live_master(p: torch.Tensor) -> torch.Tensor | None:
    """The float32 master of the latest ``LossScaleOptimizer`` over ``p``, while it lives
    and ``p`` still rounds from it; else ``None``."""
    return live_master_of(p)[0]


def forget_gone_master(p: torch.Tensor) -> bool:
    """Whether ``p``'s latest master is gone (its ``LossScaleOptimizer`` deleted: trained
    inside a function, a Trainer dropped) and ``p`` holds its rounding still (not written
    since); forgotten once asked, so that it is said once."""
    entry = _LATEST.get(p)
    if entry is None or entry[0]() is not None:
        return False
    del _LATEST[p]
    died = _DIED_AT.pop(p, None)  # a load the last write before it: the load's values
    return bool(died == p._version and LOADED_AT.get(p) != died)


def say_masters_gone(count: int, what: str) -> None:
    """``what`` takes the 16-bit roundings of ``count`` weights whose masters are gone."""
    if count:
        warn_at_caller(
            f"{what} the 16-bit roundings of {count} weight(s) whose float32 masters were "
            "in a LossScaleOptimizer that is gone (deleted with the function or Trainer that "
            "trained them): their digits past 16 bits are lost. Save, export or widen while "
            "the optimizer lives (mp.save_checkpoint(path, model, opt)), or keep it"
        )


def take_masters(params: Iterable[torch.Tensor]) -> int:
    """Write into each float32 weight of ``params`` the live master it still rounds from
    (a 16-bit weight widened since: ``model.float()``), and return how many. A new
    optimizer over the widened model, or a plain one's first step, would otherwise start
    from the roundings and lose the masters' digits. Once per optimizer."""
    taken = 0
    with torch.no_grad():
        for p in params:
            if p.dtype != torch.float32 or p not in _LATEST:
                continue
            master = live_master(p)
            if master is not None and not torch.equal(master, p):
                p.copy_(master)
                taken += 1
    return taken


def float32_start(p: torch.Tensor) -> tuple[torch.Tensor, bool]:
    """The float32 values ``p`` starts from (a new master, a weight widened again), and
    whether an earlier master of it is gone: the values auto_mixed_precision (or a
    checkpoint load) kept, while current; else the live master ``p`` still rounds from (a
    weight written since, by a load, wins); else ``p`` itself, widened. Its own copies."""
    original = take_float32_copy(p)
    if original is not None:
        return laid_out_as(original, p), False
    latest, gone = live_master_of(p)
    if latest is not None:
        return laid_out_as(latest.detach().clone(), p), False
    return p.detach().float(), gone


def float32_values(p: torch.Tensor) -> torch.Tensor | None:
    """The float32 values a weight stands for when no optimizer is given (a weights-only
    save, an export, an evaluation-only trainer): those kept when it went to 16 bits while
    current, else the live master it rounds from; ``None`` if neither."""
    kept = current_float32_copy(p) if p.dtype != torch.float32 else None
    return kept if kept is not None else live_master(p)


def _carry_float32_values(original: torch.Tensor, copied: torch.Tensor) -> None:
    """A deep copy of a 16-bit weight (``best = copy.deepcopy(model)``, a fork to fine-tune)
    keeps the float32 values the weight stands for, as ``torch.save`` of the model does:
    ``Parameter.__deepcopy__`` drops the kept copy, and the live master is the original's,
    so the copy's export, save or new optimizer started from the roundings, unsaid. Not
    where the copy has a master of its own (the optimizer copied with it)."""
    if copied.dtype not in HALF_DTYPES or has_live_master(copied):
        return
    values = float32_values(original)
    if values is not None:  # in host memory, as a load keeps them: moved when used
        with torch.no_grad():
            remember_float32(copied, values.detach().to("cpu", copy=True), carried=True)


carry_on_copy(_carry_float32_values)
