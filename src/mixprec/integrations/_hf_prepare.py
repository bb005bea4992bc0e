"""Preparing a model for ``MixprecTrainer`` once, and taking a checkpoint's float32 values
back into it after the Trainer loaded the checkpoint into its 16-bit weights.

Hugging Face users build several Trainers over one model (resume with another batch size, a
Trainer for evaluation, ``model_init`` returning the same model, a new Trainer after
``train()`` in a notebook). Preparing is idempotent: a model prepared with the same policy and
level is used as it is; only a conflicting preparation is refused.

A new Trainer's ``LossScaleOptimizer`` starts from the masters of the last one over the
same model while that one lives, as any ``LossScaleOptimizer`` does (``optim/masters.py``).
"""

from __future__ import annotations

import os
from collections.abc import Iterable

import torch
from torch import nn

from mixprec._dtypes import HALF_DTYPES
from mixprec._errors import ArgumentError
from mixprec._float32_copies import keep_loaded_float32
from mixprec._prepare_once import needs_preparation
from mixprec.keep import KeepEntry
from mixprec.policy import Policy

__all__ = ["float32_from_checkpoint", "is_prepared_as"]


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


def float32_from_checkpoint(model: nn.Module, directory: str | None) -> None:
    """After the Trainer loaded a checkpoint's ``model.safetensors`` from ``directory`` into
    the 16-bit weights (a resume, the best model at the end), keep on each weight the
    float32 values the file holds for it (``_save`` wrote the masters and kept float32
    copies; ``keep_loaded_float32``): its master takes them at the optimizer's next look at
    external writes (``follow_external_writes``) where the weight rounds from them, and a
    weight no optimizer holds (a frozen one) saves them. The load's own hooks keep them
    already for modules O2 stored in 16 bits; this covers the rest."""
    saved = os.path.join(directory or "", "model.safetensors")
    if not os.path.exists(saved):
        return
    from safetensors import safe_open

    done: set[int] = set()
    with safe_open(saved, framework="pt") as f, torch.no_grad():
        stored = set(f.keys())
        # Every name of a tied weight: the file holds it under one of them.
        for name, param in model.named_parameters(remove_duplicate=False):
            if name not in stored or param.dtype not in HALF_DTYPES or id(param) in done:
                continue
            done.add(id(param))
            keep_loaded_float32(param, f.get_tensor(name))
