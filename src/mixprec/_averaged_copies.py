"""A torch ``AveragedModel`` (SWA, EMA) of a prepared model whose weights are 16-bit (O2,
O3) averages in 16 bits: an update smaller than half a unit in the last place of a weight
(1/256 of it in bfloat16) rounds away. At ``decay=0.999`` the average stopped moving: it
moved 0.002 where the model moved 0.02, and ended 2.1e-2 off a float32 run's average (the
model itself: 1.3e-2 off its float32 control).

``AveragedModel`` deep-copies the model, and the copy's ``TagKeeper`` tells this module.
The average is said at the next step, not at the copy, since the fix comes after it: made
float32 (``ema.module.float()``, with a per-tensor ``avg_fn``) it says nothing.

An average kept by hand in a plain ``copy.deepcopy`` (timm's ``ModelEmaV2``: ``e.copy_(d *
e + (1 - d) * v)`` over the state dicts) stalls the same way (an O2 bfloat16 EMA moved 0.77
of float32's distance in 60 steps, unsaid). A copy cannot be told from a frozen teacher or a
best model kept aside when it is made, so it is said when it is written in place at each of
the first ``_WRITTEN_STEPS`` steps after it: a version read per copy at those steps, none
after. A copy kept exactly in step with the model (``q.copy_(p)`` after each step: a target
network, the previous step's model for a consistency loss) is written as often but averages
nothing: at the last of those steps it holds the model's weights of the step before, so the
model's 16-bit weights are kept at the look before it (one copy, for one step) and a copy
equal to them, weight for weight, is dropped unsaid.
"""

from __future__ import annotations

import copy
import os
import sys
import weakref
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import torch
from torch import nn
from torch.optim.swa_utils import AveragedModel
from torch.utils.weak import WeakIdKeyDictionary

from mixprec._dtypes import HALF_DTYPES, dtype_name
from mixprec._float32_copies import FP32_COPY_ATTR
from mixprec._param_tags import carry_on_copy, keeper_of
from mixprec._warn import warn_at_caller

__all__ = ["PENDING", "WATCHED", "say_averaged_copies", "watch_averaged_copies"]

_INIT = AveragedModel.__init__.__code__

#: A 16-bit weight of each AveragedModel made since the last step, weakly, and where it
#: was made; the step's check is this list's truth.
PENDING: list[tuple[weakref.ref[torch.Tensor], str]] = []


@dataclass
class _Watched:
    """A plain deep copy with 16-bit weights, over the steps after it was made, as each
    wrapper that steps sees it (a GAN's ``G_ema`` is written after G's steps alone)."""

    weight: weakref.ref[torch.Tensor]
    where: str  # the line that made the copy
    # Each stepping wrapper (its MasterWeights' id) -> the version it last read, and at how
    # many of its steps the copy had been written since its previous one.
    seen: dict[int, tuple[int, int]] = field(default_factory=dict)
    loaded: bool = False  # synced by load_state_dict: a copy, not an average
    looks: int = 0  # steps of any wrapper that looked: at most _LOOKS, then dropped
    # The copy's 16-bit weights and the model's they were copied from, weakly.
    pairs: list[tuple[weakref.ref[torch.Tensor], weakref.ref[torch.Tensor]]] = field(
        default_factory=list
    )
    before: list[torch.Tensor] | None = None  # the model's weights at the look before the last
    moved: bool = False  # the model's weights changed between the two looks before this one


WATCHED: list[_Watched] = []
_WRITTEN_STEPS = 3  # written in place at each of these steps: an average kept by hand
_WATCH_AT_MOST = 8  # copies watched at once (a loop that copies each step adds no cost)
# Steps (of any wrapper) a copy is watched over at most: a copy only another wrapper would
# write (or none) costs no step a look for long. A GAN's two wrappers: 8 to be said.
_LOOKS = 12
# A 16-bit weight of a deep copy being made -> the model's weight it copies, weakly: set by
# the copy's carry (before its on_copy), taken by _note_if_averaged.
_ORIGINALS: WeakIdKeyDictionary = WeakIdKeyDictionary()


def watch_averaged_copies(model: nn.Module) -> None:
    """Have a deep copy of the prepared ``model`` note when it is an ``AveragedModel``'s,
    or watched (``WATCHED``); a load into such a copy unwatches it."""
    keeper = keeper_of(model)
    if _note_if_averaged not in keeper.on_copy:
        keeper.on_copy.append(_note_if_averaged)
    if _loaded not in keeper.on_load:
        keeper.on_load.append(_loaded)


def _loaded(module: nn.Module) -> None:
    """A load into a watched copy: synced (PPO's old policy, a best model kept aside), not
    averaged. Only where something is watched: loads cost nothing more otherwise."""
    if WATCHED:
        ids = {id(p) for p in module.parameters()}
        for entry in WATCHED:
            if id(entry.weight()) in ids:
                entry.loaded = True


def _note_if_averaged(copy: nn.Module, params: list[torch.Tensor]) -> None:
    """Note this deep copy if it holds 16-bit weights and an ``AveragedModel`` is making it
    (a look up the stack, made only where a prepared model is copied)."""
    originals = [_ORIGINALS.pop(p, None) for p in params]
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
        _release(params)  # averaged in place from the first update: stale at once
    elif len(WATCHED) < _WATCH_AT_MOST:
        pairs = [
            (weakref.ref(p), o) for p, o in zip(params, originals, strict=True) if o is not None
        ]
        WATCHED.append(_Watched(weakref.ref(half), _user_frame(), pairs=pairs))


def _pair(original: torch.Tensor, copied: torch.Tensor) -> None:
    """Each 16-bit weight of a deep copy of a prepared model: the model's weight it copies."""
    if copied.dtype in HALF_DTYPES:
        _ORIGINALS[copied] = weakref.ref(original)


carry_on_copy(_pair)


def _user_frame() -> str:
    """The line that made the copy: the first frame outside ``copy``, torch and mixprec."""
    frame = sys._getframe(1)
    skipped = (copy.__file__, os.path.dirname(torch.__file__), os.path.dirname(__file__))
    while frame is not None and frame.f_code.co_filename.startswith(skipped):
        frame = frame.f_back  # type: ignore[assignment]
    return f"{frame.f_code.co_filename}:{frame.f_lineno}" if frame is not None else "?"


def _say_written_copies(stepped: Callable[[torch.Tensor], bool], stepper: int) -> None:
    """At a step of the wrapper ``stepper``: a watched copy written in place since that
    wrapper's previous step, at each of its ``_WRITTEN_STEPS`` steps after its first, is
    said; one left alone between two of its steps, or loaded into, is dropped."""
    kept = []
    for entry in WATCHED:
        weight = entry.weight()
        entry.looks += 1
        if weight is None or stepped(weight):
            continue  # gone, or trained by a wrapper of its own (which took its values)
        if weight.dtype not in HALF_DTYPES or entry.loaded:  # made float32 (.float()), synced
            _release([c() for c, _ in entry.pairs])  # their rounding: never current again
            continue
        if entry.looks > _LOOKS:
            continue  # not written at every step of any one wrapper: no average
        # A wrapper's first step after the copy may come before its first update.
        version, steps = entry.seen.get(stepper, (weight._version, -1))
        if weight._version == version and steps != -1:
            continue  # left alone over a step: no average kept by hand
        entry.seen[stepper] = (weight._version, steps + 1)
        if steps + 1 < _WRITTEN_STEPS:
            if max(n for _, n in entry.seen.values()) + 1 >= _WRITTEN_STEPS:
                entry.before = _model_weights(entry)  # the next look may be the last
            kept.append(entry)
            continue
        synced = _in_step(entry)
        if synced is None:  # no move of the model seen yet (skipped steps): a later look
            kept.append(entry)
            continue
        _release([c() for c, _ in entry.pairs])  # written in place: no longer current
        if synced:
            continue  # kept equal to the model (a target network): nothing averages
        name = dtype_name(weight.dtype)
        warn_at_caller(
            f"the copy of the model made at {entry.where} holds its {name} weights and was "
            f"written in place at each step since: an average kept by hand (an EMA, as "
            f"timm's ModelEmaV2 keeps one; or a plain optimizer's steps) moves in {name}, "
            "where an update below half a unit in the last place of a weight rounds away, "
            "and at decay=0.999 it stops moving. Keep the copy in float32 (copy.float() "
            "once made: the state dict's values are cast as they are copied in), or use "
            "the Trainer's mp.EMA(decay)"
        )
    WATCHED[:] = kept


def _model_weights(entry: _Watched) -> list[torch.Tensor] | None:
    """The model's weights that ``entry`` copies, as they are now (``None`` if one is gone)."""
    weights = [original() for _, original in entry.pairs]
    if not weights or any(w is None for w in weights):
        return None
    return [w.detach().clone() for w in weights if w is not None]


def _in_step(entry: _Watched) -> bool | None:
    """Whether the copy equals, weight for weight, the model as it was at the look before
    this one, after a move of the model: written after (or before) each step from the
    model, as a synced copy is. An average moves a fraction of the way, and differs.
    ``None`` where it equals it and no move of the model was seen (steps skipped, or the
    first look): an average of a still model equals it too; the model's weights now are
    then kept for the next look, with whether they moved."""
    before = entry.before
    if before is None:
        return False
    with torch.no_grad():
        copies = [copied() for copied, _ in entry.pairs]
        if any(c is None for c in copies) or not _same(copies, before):  # type: ignore[arg-type]
            return False
        if entry.moved:
            return True
        entry.before = _model_weights(entry)
        entry.moved = entry.before is not None and not _same(entry.before, before)
    return None


def _release(params: Iterable[torch.Tensor | None]) -> None:
    """Drop the float32 values a deep copy carried (``_live_masters``) from ``params``: a
    copy written in place, or widened by ``.float()``, no longer rounds from them, and an
    EMA or a target network kept them (4 bytes a parameter) for good."""
    for p in params:  # not values a load kept since (float32 weights loaded into the copy)
        if p is not None and getattr(p.__dict__.get(FP32_COPY_ATTR), "carried", False):
            del p.__dict__[FP32_COPY_ATTR]


def _same(tensors: list[torch.Tensor], others: list[torch.Tensor]) -> bool:
    return all(
        a.shape == b.shape and a.dtype == b.dtype and torch.equal(a.detach(), b)
        for a, b in zip(tensors, others, strict=True)
    )


def say_averaged_copies(stepped: Callable[[torch.Tensor], bool], stepper: object = None) -> None:
    """Warn (at the step's caller) for each noted average that is still 16-bit, and for
    each watched copy written at every step of the wrapper ``stepper`` so far that no
    wrapper steps (``stepped``)."""
    if WATCHED:
        _say_written_copies(stepped, id(stepper))  # id taken here, eagerly
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
