"""Preparing a model for ``MixprecTrainer`` once, and handing its masters to the next Trainer.

Hugging Face users build several Trainers over one model (resume with another batch size, a
Trainer for evaluation, ``model_init`` returning the same model, a new Trainer after
``train()`` in a notebook). Preparing is idempotent: a model prepared with the same policy and
level is used as it is; only a conflicting preparation is refused.

A new Trainer's ``LossScaleOptimizer`` takes its float32 masters from the values kept for
each 16-bit weight (``_float32_copies.take_float32_copy``). Those kept at preparation are
taken by the first optimizer and are stale once it steps. So before a later Trainer wraps
its optimizer, the latest masters of the same model (those of the last
``LossScaleOptimizer`` built over it) are kept again for each 16-bit weight they still
round to; a weight written since (``load_state_dict``, another optimizer) starts from its
current value.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable

import torch
from torch import nn

from mixprec._errors import ArgumentError
from mixprec._float32_copies import remember_float32
from mixprec._prepare_once import needs_preparation
from mixprec.keep import KeepEntry
from mixprec.optim import LossScaleOptimizer
from mixprec.policy import Policy

__all__ = ["is_prepared_as", "note_optimizer", "pass_on_masters"]

#: The last ``LossScaleOptimizer`` a ``MixprecTrainer`` built over each model. Weak both ways:
#: neither the model nor the optimizer is kept alive, and nothing is stored on the model
#: (which stays picklable).
_LATEST: weakref.WeakKeyDictionary[nn.Module, weakref.ref[LossScaleOptimizer]] = (
    weakref.WeakKeyDictionary()
)


def is_prepared_as(
    model: nn.Module,
    policy: Policy,
    level: str,
    keep_float32: Iterable[KeepEntry],
    where: str = "model",
) -> bool:
    """``False`` for a model not prepared yet, ``True`` for one prepared with ``policy`` and
    ``level`` (and, when given, the same ``keep_float32`` modules); a conflicting preparation
    raises ``ArgumentError`` naming both (``needs_preparation``). ``where``: what the model
    came from (``"model"``, ``"model_init()"``)."""
    if not isinstance(model, nn.Module):
        raise ArgumentError(f"{where} must be a torch.nn.Module, got {type(model).__name__}")
    ours = f"MixprecTrainer(policy={policy.name!r}, level={level!r})"
    return not needs_preparation(
        model,
        policy,
        level,
        where=ours,
        keep_float32=keep_float32,
        subject=where,
        takes_amp_level=False,
    )


def pass_on_masters(model: nn.Module | None, optimizer: torch.optim.Optimizer) -> None:
    """Keep the latest float32 masters of ``model`` for the 16-bit parameters ``optimizer``
    (about to be wrapped) updates, so that its ``LossScaleOptimizer`` starts from them."""
    ref = _LATEST.get(model) if model is not None else None
    previous = ref() if ref is not None else None
    if previous is None:
        return
    ours = {id(p) for group in optimizer.param_groups for p in group["params"]}
    with torch.no_grad():
        for half, master in previous.master_weights():
            # A master is current while the weight is its rounding: a later write to the
            # weight (load_state_dict, another optimizer's step) makes the weight win.
            if id(half) in ours and _rounds_to(master, half):
                remember_float32(half, master.detach().clone())


def _rounds_to(master: torch.Tensor, half: torch.Tensor) -> bool:
    if master.shape != half.shape or master.device != half.device:
        return False
    return bool(torch.equal(master.to(half.dtype), half.detach()))


def note_optimizer(model: nn.Module | None, optimizer: LossScaleOptimizer) -> None:
    """Record ``optimizer`` as the one holding ``model``'s latest masters."""
    if model is not None:
        _LATEST[model] = weakref.ref(optimizer)
