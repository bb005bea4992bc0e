"""Two live ``LossScaleOptimizer`` wrappers over the same weights or the same loss scaler.

torch lets two optimizers step one parameter (an actor-critic's shared trunk), and
torch.amp's recipe shares one ``GradScaler`` among optimizers. Two wrappers cannot always:

- each keeps its own float32 master of a shared 16-bit weight, and whichever steps second
  resets the other's from its rounding: one optimizer's small updates were lost (the
  weight moved by one optimizer's updates alone);
- each unscales the shared gradients in place: with both backwards before both steps (the
  torch.amp order), the second divides them again (a float32 LayerNorm moved half as far
  as in float32);
- one scaler updated by both in that order: the second unscales by a scale the first has
  just halved (its step applied 2x too large).

A wrapper built while others live over the same weights or scaler notes them, both ways
(not where their builder coordinates them: ``coordinated``, the Lightning plugin's). A
step then refuses, before it unscales, once another is in use: it stepped since (shared
masters), it has a backward pending over the shared gradients, or it moved the shared
scale since this wrapper's backward. Left alone: a wrapper no longer stepped (rebuilt for
a second phase, still referenced; one left mid-group), float32 weights or one scaler
shared by wrappers that step in turn (backward and step of one, then of the other), as in
torch. The look costs nothing without a partner.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils.weak import WeakIdKeyDictionary

from mixprec._errors import MisuseError
from mixprec.scaling import DynamicLossScaler

__all__ = [
    "Partner",
    "Sharing",
    "check_partners",
    "check_unscale",
    "coordinated",
    "note_partners",
    "others_live",
]

# Each weight or scaler -> the bookkeeping of every wrapper built over it, weakly (by
# identity: a tensor's == is elementwise).
_OWNERS = WeakIdKeyDictionary()
# Every live wrapper's bookkeeping: a step() with no backward of its own names another
# wrapper's backward as the likely cause only where there is another.
_LIVE = WeakIdKeyDictionary()  # by identity: the bookkeeping is an unhashable dataclass


@dataclass
class Partner:
    """Another live wrapper sharing weights or the scaler with this one."""

    book: weakref.ref[Any]
    shape: tuple[int, ...] | None  # a shared weight's, for the message; None: scaler only
    masters: bool  # a shared 16-bit weight with a master in each
    scaler: bool  # the same loss scaler object
    # The other's backward passes pending when the pair was noted, and its steps then: a
    # wrapper left with a backward it never steps (a phase ended mid-group) is not in use.
    stale: int = 0
    steps: int = 0


@dataclass
class Sharing:
    """One wrapper's side: its partners, whether it stepped since one was noted, whether
    its builder coordinates it, the scale of its step's first backward (a shared scaler),
    and how many of its steps were looked at. Not pickled: a copy shares nothing."""

    partners: list[Partner] = field(default_factory=list)
    stepped: bool = False
    coordinated: bool = False
    backward_scale: float | None = None
    checked: int = 0

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "partners": [], "stepped": False}

    def note_scale(self, scale: float) -> None:
        """At a backward (``get_scaled_loss``, ``scale_loss``): the step's first scale,
        where a partner may share the scaler."""
        if self.partners and self.backward_scale is None:
            self.backward_scale = float(scale)


def note_partners(book: Any, half: list[torch.Tensor], plain: list[torch.Tensor],
                  scaler: Any) -> None:  # fmt: skip
    """At construction: note each live wrapper over any of ``half`` (16-bit weights with
    masters), ``plain`` or ``scaler`` in ``book.share.partners``, and ``book`` in theirs."""
    found: dict[int, Partner] = {}
    # The owners found, strongly, by id: a dropped wrapper's cycle collected between a look
    # and its use (any allocation may run the collector) raised here.
    held: dict[int, Any] = {}
    # A scaler whose scale moves; a static or no-op one shared changes nothing.
    scalers = [scaler] if isinstance(scaler, DynamicLossScaler) else []
    groups: list[tuple[list[Any], bool]] = [(half, True), (plain, False), (scalers, False)]
    mine = weakref.ref(book)
    _LIVE[book] = True
    for things, masters in groups:
        for thing in things:
            alive = [(r, o) for r in _OWNERS.get(thing, ()) if (o := r()) is not None]
            held.update((id(o), o) for _, o in alive)
            refs = [r for r, _ in alive]
            for ref, owner in alive:
                if owner is book or owner.share.coordinated:
                    continue
                is_scaler = thing is scaler
                shape = None if is_scaler else tuple(thing.shape)
                seen = found.setdefault(id(owner), Partner(ref, shape, False, False))
                seen.masters |= masters
                seen.scaler |= is_scaler
                seen.shape = seen.shape or shape
            _OWNERS[thing] = [*refs, mine]
    for key, partner in found.items():
        other: Any = held[key]
        other.share.stepped = False  # in use from now on only if it steps again
        partner.stale = other.backwards if other.fresh else 0
        partner.steps = other.share.checked
        book.share.partners.append(partner)
        mirror = Partner(mine, partner.shape, partner.masters, partner.scaler)
        mirror.stale, mirror.steps = (book.backwards if book.fresh else 0), book.share.checked
        other.share.partners.append(mirror)


def others_live(book: Any) -> bool:
    """Whether a wrapper other than ``book``'s is alive (its backward may have made the
    gradients ``book``'s step found)."""
    return any(other is not book for other in list(_LIVE.keys()))


def coordinated(book: Any) -> None:
    """``book``'s wrapper shares weights or its scaler with others by design, and whoever
    built them makes that right (the Lightning plugin: one scaler, each backward's scale
    recorded, gradients brought to the scale of the step): no partner of anyone."""
    book.share.coordinated = True
    for partner in book.share.partners:
        other = partner.book()
        if other is not None:
            other.share.partners[:] = [p for p in other.share.partners if p.book() is not book]
    book.share.partners.clear()


def _check(book: Any, scale: float | None) -> None:
    book.share.checked += 1
    live = [p for p in book.share.partners if p.book() is not None]
    book.share.partners[:] = live
    for partner in live:
        other = partner.book()
        if not other.fresh or other.share.checked != partner.steps:
            partner.stale = 0  # stepped since, or idle: any pending backward is new
        pending = other.fresh and other.backwards > partner.stale and partner.shape is not None
        rescaled = moved_scale(book, partner, scale)
        if pending or rescaled or (other.share.stepped and partner.masters):
            raise MisuseError(_message(partner, pending, rescaled))
    book.share.stepped = True


def moved_scale(book: Any, partner: Partner, scale: float | None) -> bool:
    """The shared scaler's scale moved since this wrapper's first backward of the step."""
    then = book.share.backward_scale
    return bool(partner.scaler and scale is not None and then not in (None, scale))


def check_unscale(book: Any, scaler: Any) -> None:
    """At ``get_unscaled_gradients`` (Keras' flows unscale there): refuse where a partner
    moved the shared scale since this wrapper scaled its loss; the unscale is done then."""
    if book.share.partners:
        scale = float(scaler.get_scale())
        for partner in [p for p in book.share.partners if p.book() is not None]:
            if moved_scale(book, partner, scale):
                raise MisuseError(_message(partner, False, True))
    book.share.backward_scale = None


def _message(partner: Partner, pending: bool, rescaled: bool) -> str:
    what = (
        "this LossScaleOptimizer and another live one share their loss scaler"
        if partner.shape is None
        else f"a {partner.shape} weight (and maybe others) is stepped by this "
        "LossScaleOptimizer and by another live one"
    )
    why = []
    if pending:
        why.append("the other's backward is pending over the same gradients, which each "
                   "step unscales in place (the second divides them again)")  # fmt: skip
    if partner.masters:
        why.append("each keeps its own float32 master of a shared 16-bit weight, so one's "
                   "small updates are lost to the other's rounding")  # fmt: skip
    if rescaled:
        why.append("the other moved the shared scale since this one's backward, so this "
                   "step would unscale by the wrong scale")  # fmt: skip
    return (
        f"{what}: {'; '.join(why)}. Step shared weights with one wrapper: one torch optimizer "
        "with a param group per part (trunk, heads; their own learning rates) and one "
        "backward of the summed losses, opt.backward(loss_a + loss_b); several torch "
        "optimizers over disjoint parameters: mp.LossScaleOptimizer([opt_a, opt_b]); a "
        "scaler of its own for each wrapper (copy.deepcopy(scaler) to start from its scale)"
    )


# Runs eagerly under torch.compile(opt.step), and only where a partner was noted.
_check_eagerly = torch._disable_dynamo(_check)  # type: ignore[attr-defined]


def check_partners(book: Any, scaler: Any) -> None:
    """At ``step()`` (and ``apply_gradients``), before the unscale: refuse while a
    partner is in use (see above)."""
    if book.share.partners:
        _check_eagerly(book, float(scaler.get_scale()))
