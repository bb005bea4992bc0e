"""A model's tensors as a checkpoint stores them: float32 masters in place of 16-bit weights,
tied tensors once, and which state-dict keys are parameters and which are buffers; and the
classes of the optimizers whose state is stored beside them."""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from mixprec.optim import LossScaleOptimizer

__all__ = ["master_tensors", "optimizer_classes"]


def master_tensors(
    model: nn.Module, optimizer: torch.optim.Optimizer | None
) -> dict[str, torch.Tensor]:
    """The float32 master of each 16-bit weight of ``model`` that ``optimizer`` (a
    ``LossScaleOptimizer``) keeps, under every state-dict key of the weight (a tied weight has
    several, all given the same master); empty for any other optimizer or ``None``. What a
    checkpoint and ``MixprecTrainer``'s ``save_model`` write in place of the 16-bit values."""
    names = _parameter_names(model)
    masters: dict[str, torch.Tensor] = {}
    if isinstance(optimizer, LossScaleOptimizer):
        for param, master in optimizer.master_weights():
            for name in names.get(id(param), []):
                masters[name] = master
    return masters


def _model_tensors(
    model: nn.Module, optimizer: torch.optim.Optimizer | None
) -> tuple[dict[str, torch.Tensor], dict[str, str], list[str]]:
    """State-dict tensors with masters in place of 16-bit weights; tied tensors stored once."""
    masters = master_tensors(model, optimizer)
    tensors: dict[str, torch.Tensor] = {}
    aliases: dict[str, str] = {}
    seen: dict[tuple[int, int, tuple[int, ...], torch.dtype], str] = {}
    for key, value in model.state_dict().items():
        value = _unwrapped(masters.get(key, value))
        storage = value.untyped_storage().data_ptr()
        ident = (storage, int(value.storage_offset()), tuple(value.shape), value.dtype)
        if value.numel() and ident in seen:
            aliases[key] = seen[ident]
            continue
        seen[ident] = key
        tensors[f"model/{key}"] = value.detach().cpu().contiguous()
    return tensors, aliases, sorted(masters)


def _unwrapped(value: torch.Tensor) -> torch.Tensor:
    """The plain tensor inside a wrapper subclass that holds one as ``_tensor`` (torchao's
    float8 all-gather weights): the wrapper has no storage of its own."""
    while type(value) is not torch.Tensor and isinstance(
        getattr(value, "_tensor", None), torch.Tensor
    ):
        value = value._tensor  # type: ignore[attr-defined]
    return value


def _parameter_names(model: nn.Module) -> dict[int, list[str]]:
    """Every name of each parameter, by ``id``: a tied weight has several."""
    names: dict[int, list[str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(param), []).append(name)
    return names


def _buffer_names(model: nn.Module, keys: Iterable[str]) -> set[str]:
    """Which state-dict ``keys`` are buffers (not parameters): their values are not weights,
    and non-finite ones are normal (attention masks of -inf)."""
    params = {n for n, _ in model.named_parameters(remove_duplicate=False)}
    return {k for k in keys if k not in params}


def optimizer_classes(optimizer: torch.optim.Optimizer) -> list[str]:
    """The class names of the optimizers whose state ``optimizer.state_dict()`` holds: a
    ``LossScaleOptimizer``'s inner ones, else its own. Each decides what the state means
    (AdamW's decoupled weight decay is a flag in its param groups; SGD has no moments)."""
    if isinstance(optimizer, LossScaleOptimizer):
        return [type(inner).__name__ for inner in optimizer.optimizers]
    return [type(optimizer).__name__]
