"""The distributed primitives the numerics need: whether several processes run, agreeing on
an overflow across them, telling a DTensor shard apart, whether an FSDP2 policy computes in
float16. Imports nothing of mixprec, so that
scaling, the optimizer and ``distributed`` can all build on it."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist


def is_distributed() -> bool:
    """Whether ``torch.distributed`` runs more than one process."""
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def agree_found_inf(found_inf: torch.Tensor) -> torch.Tensor:
    """When ``torch.distributed`` is initialised, make every rank see the max ``found_inf``.

    Without this, a rank whose gradients overflowed would skip while the others stepped, and
    the replicas would drift apart.
    """
    if is_distributed():
        dist.all_reduce(found_inf, op=dist.ReduceOp.MAX)
    return found_inf


def rank_bounds(values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Every rank's maxima and minima of ``values`` (one all-reduce of the values and their
    negation): equal where every rank holds the same."""
    bounds = torch.cat([values, -values])
    dist.all_reduce(bounds, op=dist.ReduceOp.MAX)
    return bounds[: values.numel()], -bounds[values.numel() :]


def is_dtensor(t: torch.Tensor) -> bool:
    return type(t).__name__ == "DTensor" and hasattr(t, "to_local")


# FSDP2 makes new parameters (DTensor shards) without the tags a prepared model's carry,
# and no public link leads from them to their MixedPrecisionPolicy. ``fsdp_compute_dtype``
# reads torch's registry of sharded modules; where that is not there (another torch), the
# note ``fsdp_mixed_precision`` makes of a float16 policy stands in.
_FSDP_FLOAT16: list[bool] = [False]


def note_fsdp_float16() -> None:
    _FSDP_FLOAT16[0] = True


def fsdp_computes_in_float16(params: list[torch.Tensor]) -> bool:
    """Whether FSDP2 gathers any of the shards ``params`` in float16 (its ``param_dtype``)."""
    dtype = fsdp_compute_dtype(params)
    return _FSDP_FLOAT16[0] if dtype is None else dtype == torch.float16


def fsdp_compute_dtype(params: list[torch.Tensor]) -> torch.dtype | None:
    """The ``param_dtype`` of the FSDP2 policy that shards one of ``params``; ``None``
    where none is found. torch's module-state registry is private: read defensively."""
    try:
        from torch.distributed._composable_state import _module_state_mapping
    except ImportError:
        return None
    wanted = {id(p) for p in params}
    for ref in list(_module_state_mapping.values()):
        state = ref() if callable(ref) else ref
        for group in _param_groups(state):
            params_of = getattr(group, "fsdp_params", ())
            if any(id(getattr(fp, "sharded_param", None)) in wanted for fp in params_of):
                policy = getattr(group, "mp_policy", None)
                dtype = getattr(policy, "param_dtype", None)
                return dtype if isinstance(dtype, torch.dtype) else torch.float32
    return None


def _param_groups(state: object) -> list[Any]:
    """An FSDP2 state's parameter groups: a list in torch 2.13, one group (or None) in
    torch 2.11. Read the list first: there the singular name is a property that raises
    for a module with more than one group."""
    groups = getattr(state, "_fsdp_param_groups", None)
    if groups is not None:
        return list(groups)
    group = getattr(state, "_fsdp_param_group", None)
    return [] if group is None else [group]
