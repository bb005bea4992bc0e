"""The distributed primitives the numerics need: whether several processes run, agreeing on
an overflow across them, telling a DTensor shard apart, whether an FSDP2 policy computes in
float16. Imports nothing of mixprec, so that
scaling, the optimizer and ``distributed`` can all build on it."""

from __future__ import annotations

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


def is_dtensor(t: torch.Tensor) -> bool:
    return type(t).__name__ == "DTensor" and hasattr(t, "to_local")


# FSDP2 makes new parameters (DTensor shards) without the tags a prepared model's carry,
# and leaves no link from them to its MixedPrecisionPolicy: ``fsdp_mixed_precision`` notes
# here that one computes in float16, so that a LossScaleOptimizer over shards scales.
_FSDP_FLOAT16: list[bool] = [False]


def note_fsdp_float16() -> None:
    _FSDP_FLOAT16[0] = True


def fsdp_float16_made() -> bool:
    """Whether ``fsdp_mixed_precision`` made a float16 policy in this process."""
    return _FSDP_FLOAT16[0]
