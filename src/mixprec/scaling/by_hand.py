"""Which gradients a loop unscaled by hand: MindSpore's manual loop calls its scaler's
``unscale_(grads)`` and then steps a plain optimizer, which must not be told that nothing
unscales its gradients. Every scaler registers here; ``unscale_`` notes (eagerly) the id
of the first gradient it divided."""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from typing import Any

import torch

__all__ = ["LIVE", "unscaled_by_hand"]

#: Every loss scaler made, weakly.
LIVE: weakref.WeakSet[Any] = weakref.WeakSet()


def unscaled_by_hand(grads: Sequence[torch.Tensor]) -> bool:
    """Whether a live scaler's latest ``unscale_`` divided a list that began with one of
    ``grads``: the loop unscales them itself before a plain optimizer steps. Once per
    optimizer, at its first step."""
    firsts = {getattr(s, "_unscaled_first", 0) for s in LIVE}
    return any(id(g) in firsts for g in grads)
