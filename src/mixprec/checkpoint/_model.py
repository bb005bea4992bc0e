"""A model's tensors as a checkpoint stores them: float32 masters in place of 16-bit weights,
tied tensors once, and which state-dict keys are parameters and which are buffers; and the
classes of the optimizers whose state is stored beside them."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from mixprec._aliases import Memory, memory_of
from mixprec._dist import is_dtensor
from mixprec._dtypes import HALF_DTYPES
from mixprec._errors import ArgumentError, shown
from mixprec._live_masters import (
    float32_values,
    forget_gone_master,
    has_live_master,
    say_masters_gone,
)
from mixprec._plain_optimizers import is_wrapped
from mixprec.checkpoint.format import CheckpointError
from mixprec.optim import LossScaleOptimizer
from mixprec.optim.compensated import compensated_value

__all__ = [
    "check_arguments",
    "master_tensors",
    "masters_in_place",
    "masters_of",
    "optimizer_classes",
]


def check_arguments(who: str, model: Any, optimizer: Any) -> None:
    """``model`` an ``nn.Module`` and ``optimizer`` a torch optimizer or ``None``: a state
    dict or an optimizer's name failed deep inside, as an ``AttributeError``."""
    if not isinstance(model, nn.Module):
        hint = " (a state dict: pass the module it belongs to)" if isinstance(model, dict) else ""
        got = type(model).__name__
        raise ArgumentError(f"{who}(model=...) needs an nn.Module, got {got}{hint}")
    if optimizer is not None and not isinstance(optimizer, torch.optim.Optimizer):
        raise ArgumentError(
            f"{who}(optimizer={shown(optimizer)}) is invalid; valid: a torch.optim.Optimizer "
            "(a LossScaleOptimizer, for float32 masters) or None"
        )
    sharded = next((n for n, p in model.named_parameters() if is_dtensor(p)), None)
    if sharded is not None:
        # Each rank holds part of each weight: the raw "invalid python storage" error of
        # the first tensor read, or a file of one rank's shards.
        raise ArgumentError(
            f"{who}(): the model's parameters are DTensor shards ({sharded!r}; FSDP2's "
            "fully_shard or tensor parallelism): each rank holds part of each weight, which "
            "this one-file format does not gather. Use torch.distributed.checkpoint: "
            "dcp.save(get_state_dict(model, optimizer)) (torch.distributed.checkpoint."
            "state_dict), or get_model_state_dict(model, options=StateDictOptions("
            "full_state_dict=True, cpu_offload=True)) for one full file on rank 0"
        )
    if is_wrapped(optimizer):
        raise ArgumentError(
            f"{who}(optimizer={type(optimizer).__name__}) is the optimizer a "
            "LossScaleOptimizer wraps: its state holds neither the loss scale nor which "
            "weight each float32 master stands for, so a resume would start from a fresh "
            "scale and 16-bit-rounded masters. Pass the LossScaleOptimizer itself"
        )
    if optimizer is not None:
        # Its state maps to parameters by position: saved, it loaded into whichever
        # optimizer loaded the file; loaded, it took this model's moments for another's.
        held = [n for inner in optimizer_param_names(optimizer, model) for g in inner for n in g]
        if held and not any(held):
            raise ArgumentError(
                f"{who}: the optimizer holds none of the model's parameters (its {len(held)} "
                "are another model's): pass the optimizer built over this model"
            )


def check_masters_held(model: nn.Module, optimizer: torch.optim.Optimizer | None) -> None:
    """Refuse a save whose ``LossScaleOptimizer`` keeps masters for weights ``model`` does
    not hold: a master is saved under its weight's name, so the file saved without a word
    and no load of it could restore the optimizer (a layer replaced after the optimizer was
    built; one optimizer over two models, saved with one of them)."""
    if not isinstance(optimizer, LossScaleOptimizer):
        return
    names = _parameter_names(model)
    missing = [w for w, _ in optimizer.master_weights() if id(w) not in names]
    if missing:
        shapes = ", ".join(f"a {tuple(w.shape)} weight" for w in missing[:3])
        more = f" and {len(missing) - 3} more" if len(missing) > 3 else ""
        raise ArgumentError(
            f"save_checkpoint: the optimizer keeps float32 masters for {len(missing)} "
            f"weight(s) the model does not hold ({shapes}{more}): masters are saved under "
            "their weights' names, so load_checkpoint could not restore this optimizer. Save "
            "the module that holds every weight the optimizer steps (several models: one "
            "nn.ModuleDict of them), or, for a layer replaced after the optimizer was built, "
            "build the optimizer again over model.parameters()"
        )


def master_tensors(
    model: nn.Module, optimizer: torch.optim.Optimizer | None, compensated: bool = False
) -> dict[str, torch.Tensor]:
    """The float32 master of each 16-bit weight of ``model`` that ``optimizer`` (a
    ``LossScaleOptimizer``) keeps, under every state-dict key of the weight (a tied weight has
    several, all given the same master); for a weight it does not cover (or with no such
    optimizer), the float32 values the weight still rounds from (``float32_values``). What a
    checkpoint, an export and ``MixprecTrainer``'s ``save_model`` write in place of the
    16-bit values. ``compensated`` (an export): O3 weights too, as weight plus the Kahan
    compensation their optimizer keeps (a checkpoint holds the two apart: ``load`` joins
    them for masters, and an O3 resume stays exact)."""
    names = _parameter_names(model)
    masters: dict[str, torch.Tensor] = {}
    if isinstance(optimizer, LossScaleOptimizer):
        # A weight written since the last step (pretrained weights loaded) is what is saved,
        # not the master it is about to replace.
        optimizer._weights.follow_external_writes()
        optimizer._weights.follow_data_writes()  # and those through .data, which it writes
        for param, master in optimizer.master_weights():
            for name in names.get(id(param), []):
                masters[name] = master
        if compensated:
            masters.update(_compensated(optimizer, names))  # O3 weights Kahan-compensated
    # Weights no given optimizer covers (no optimizer yet, a weights-only save, frozen
    # ones) still stand for float32 values: kept at preparation, or a live master's (also
    # of a weight widened since: model.float()).
    gone = 0
    for param in model.parameters():
        found = names.get(id(param), [])
        if (param.dtype in HALF_DTYPES or has_live_master(param)) and (
            found and found[0] not in masters
        ):
            values = float32_values(param)
            if values is not None:
                masters.update(dict.fromkeys(found, values))
            else:
                gone += forget_gone_master(param)
    say_masters_gone(gone, "the save writes")
    return masters


def _compensated(
    optimizer: LossScaleOptimizer, names: dict[int, list[str]]
) -> dict[str, torch.Tensor]:
    """The float32 values of the 16-bit weights a Kahan-compensated optimizer steps in
    place (O3, ``CompensatedAdamW``): the weight plus what its rounding lost, kept in its
    state. Saved as the 16-bit weight, a resume at O2 started its masters without them
    (23% of 30 steps' movement lost, now joined at the load) and an export wrote them
    rounded."""
    values: dict[str, torch.Tensor] = {}
    for inner in optimizer.optimizers:
        for param, state in inner.state.items():
            lost = state.get("compensation") if isinstance(state, dict) else None
            if (
                isinstance(lost, torch.Tensor)
                and param.dtype in HALF_DTYPES
                and lost.shape == param.shape
            ):
                whole = compensated_value(param, lost)
                values.update(dict.fromkeys(names.get(id(param), []), whole))
    return values


def masters_of(
    model: nn.Module, optimizers: Iterable[torch.optim.Optimizer | None]
) -> dict[str, torch.Tensor]:
    """``master_tensors`` over each of ``optimizers``, by state-dict key."""
    masters: dict[str, torch.Tensor] = {}
    for optimizer in optimizers:
        masters.update(master_tensors(model, optimizer))
    return masters


def masters_in_place(
    model: nn.Module, optimizers: Iterable[torch.optim.Optimizer | None] = (None,)
) -> dict[str, torch.Tensor] | None:
    """``model.state_dict()`` with each 16-bit weight's float32 master (``master_tensors``,
    over each of ``optimizers``) in its place under every key of the weight, detached;
    ``None`` where no weight has one. What a checkpoint's weights hold at O2: the values
    training reached, not their 16-bit rounding."""
    masters = masters_of(model, optimizers)
    if not masters:
        return None
    state = model.state_dict()
    return {key: masters[key].detach() if key in masters else state[key] for key in state}


def _model_tensors(
    model: nn.Module, optimizer: torch.optim.Optimizer | None, compensated: bool = False
) -> tuple[dict[str, torch.Tensor], dict[str, str], list[str]]:
    """State-dict tensors with masters in place of 16-bit weights; tied tensors stored once."""
    masters = master_tensors(model, optimizer, compensated)
    tensors: dict[str, torch.Tensor] = {}
    aliases: dict[str, str] = {}
    seen: dict[Memory, str] = {}
    for key, value in model.state_dict().items():
        value = _unwrapped(masters.get(key, value))
        # The strides count too: a transposed view of a weight has its storage, offset and
        # (when square) shape, and is another tensor.
        ident = memory_of(value)
        if ident is not None and ident in seen:
            aliases[key] = seen[ident]
            continue
        if ident is not None:
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


def optimizer_param_names(optimizer: torch.optim.Optimizer, model: nn.Module) -> list[Any]:
    """Per inner optimizer (one for a plain optimizer), per param group, each parameter's
    name in ``model`` (a master's, its 16-bit weight's; "" for one the model does not
    hold): torch maps a state to parameters by position, which these names check."""
    names = _parameter_names(model)
    weight_of: dict[int, torch.Tensor] = {}
    inners = [optimizer]
    if isinstance(optimizer, LossScaleOptimizer):
        weight_of = {id(master): weight for weight, master in optimizer.master_weights()}
        inners = list(optimizer.optimizers)
    return [
        [
            [(names.get(id(weight_of.get(id(p), p))) or [""])[0] for p in group["params"]]
            for group in inner.param_groups
        ]
        for inner in inners
    ]


def check_param_names(path: str, saved: Any, mine: list[Any], skipped: set[str]) -> None:
    """Refuse an optimizer state whose parameters are not this optimizer's by name (a model
    whose parameters were registered in another order has the same shapes and keys), or
    one that holds state for a weight the load skipped (``strict=False``, another shape)."""
    held = {name for inner in mine for group in inner for name in group}
    if held & skipped:
        raise CheckpointError(
            f"{path}: the optimizer state holds state for {', '.join(sorted(held & skipped))}, "
            "whose saved weights have other shapes and were not loaded: load the model alone "
            "(optimizer=None) and start the optimizer afresh"
        )
    if not isinstance(saved, list) or len(saved) != len(mine):
        return  # a checkpoint from before the names were saved: torch's checks alone
    for i, (theirs, ours) in enumerate(zip(saved, mine, strict=True)):
        for g, (a, b) in enumerate(zip(theirs, ours, strict=False)):
            for j, (x, y) in enumerate(zip(a, b, strict=False)):
                if x and y and x != y:
                    raise CheckpointError(
                        f"{path}: optimizer {i} param_groups[{g}] position {j} holds the "
                        f"state of {x!r} in the checkpoint and is {y!r} here: the model's "
                        "parameters are in another order. Build the optimizer over the "
                        "parameters in the saved order, or load the model alone"
                    )
