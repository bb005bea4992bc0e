"""Which gradients were unscaled by a loss scaler's own ``unscale_``: MindSpore's manual
loop calls ``loss_scaler.unscale_(grads)`` and then steps a plain optimizer, which must not
be told that nothing unscales its gradients, while a plain optimizer whose gradients no
``unscale_`` reached (a GAN's G beside a hand-unscaled D) still is. A scaler notes the
gradients of its first ``NOTED_CALLS`` calls, weakly: a plain optimizer is looked at once,
at its first step, which a loop takes right after its first unscale."""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch.utils.weak import WeakIdKeyDictionary

__all__ = ["NOTED_CALLS", "note_unscaled", "unscaled_by_hand"]

NOTED_CALLS = 8
_UNSCALED: WeakIdKeyDictionary = WeakIdKeyDictionary()


def note_unscaled(grads: Iterable[torch.Tensor | None]) -> None:
    """``grads`` were unscaled (the ``None`` entries of frozen parameters are skipped)."""
    for g in grads:
        if g is not None:
            _UNSCALED[g] = True


def unscaled_by_hand(grads: Iterable[torch.Tensor]) -> bool:
    """Whether every one of ``grads`` (a plain optimizer's, at its first step) went
    through a scaler's ``unscale_``; ``False`` for none."""
    grads = list(grads)
    return bool(grads) and all(g in _UNSCALED for g in grads)
