"""Preparing a model for ``MixprecTrainer`` once.

Hugging Face users build several Trainers over one model (resume with another batch size, a
Trainer for evaluation, ``model_init`` returning the same model, a new Trainer after
``train()`` in a notebook). Preparing is idempotent: a model prepared with the same policy and
level is used as it is; only a conflicting preparation is refused.

A new Trainer's ``LossScaleOptimizer`` starts from the masters of the last one over the
same model while that one lives, as any ``LossScaleOptimizer`` does (``optim/masters.py``).
"""

from __future__ import annotations

from collections.abc import Iterable

from torch import nn

from mixprec._errors import ArgumentError
from mixprec._prepare_once import needs_preparation
from mixprec.keep import KeepEntry
from mixprec.policy import Policy

__all__ = ["is_prepared_as"]


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
