"""``torch.distributed`` glue: process groups from ``torchrun``, DDP with every level,
FSDP2 mixed precision from a mixprec ``Policy``, rank-0 helpers.

Overflow agreement itself lives in ``scaling.agree_found_inf`` (used by
``LossScaleOptimizer`` and ``GradScaler``): every rank skips the same steps.
"""

from __future__ import annotations

import datetime
import gc
import math
import os
import struct
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from mixprec._dist import note_fsdp_float16
from mixprec._errors import ArgumentError, check_int, is_number
from mixprec._live_masters import live_master
from mixprec.optim import LossScaleOptimizer
from mixprec.policy import PolicyLike, get_policy

__all__ = [
    "all_gather_object",
    "all_reduce_sum",
    "barrier",
    "broadcast_",
    "check_batch",
    "check_same_on_every_rank",
    "distributed_data_parallel",
    "float_key",
    "fsdp_mixed_precision",
    "gather_object",
    "init_from_env",
    "is_main_process",
    "rank",
    "same_on_every_rank",
    "shard",
    "shutdown",
    "world_size",
]


def world_size() -> int:
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def is_main_process() -> bool:
    """True on rank 0, and when not distributed: where logs, bars and checkpoints go."""
    return rank() == 0


def shutdown(wait: bool = True) -> None:
    """Leave the process group, if there is one: after a barrier (``wait``; every rank done
    with its collectives) and with DDP's reducers collected, since gloo aborts a process
    whose threads outlive the group ("terminate called without an active exception")."""
    if not (dist.is_available() and dist.is_initialized()):
        return
    if wait:
        dist.barrier()
    gc.collect()
    dist.destroy_process_group()


def init_from_env(backend: str = "auto", timeout_s: float = 300.0) -> bool:
    """Start the process group ``torchrun`` describes (``WORLD_SIZE``, ``RANK``...).

    ``backend="auto"``: NCCL with CUDA, gloo otherwise. Collectives time out after
    ``timeout_s`` so a crashed rank ends the run with an error instead of a hang. Returns
    False (and does nothing) when not launched by torchrun with more than one process."""
    # -1 or NaN failed inside torch's init.
    if not (is_number(timeout_s) and 0 < timeout_s < math.inf):
        raise ArgumentError(f"timeout_s={timeout_s!r} is invalid; it must be a finite number > 0")
    if int(os.environ.get("WORLD_SIZE", "1")) <= 1:
        return False
    if dist.is_initialized():
        return True
    if not dist.is_available():
        raise RuntimeError("torch.distributed is not available in this PyTorch build")
    if backend == "auto":
        backend = "nccl" if torch.cuda.is_available() else "gloo"
    available = {"gloo": dist.is_gloo_available(), "nccl": dist.is_nccl_available(),
                 "mpi": dist.is_mpi_available()}  # fmt: skip
    if not available.get(backend, False):
        valid = [name for name, ok in available.items() if ok]
        raise RuntimeError(
            f"backend={backend!r} is not available here; available: {', '.join(valid)}"
        )
    if backend == "nccl":
        local_rank, gpus = int(os.environ.get("LOCAL_RANK", "0")), torch.cuda.device_count()
        if local_rank >= gpus:  # else CUDA's bare "invalid device ordinal"
            raise RuntimeError(
                f"backend='nccl': LOCAL_RANK={local_rank} needs a GPU of its own, and this "
                f"process sees {gpus}; start at most {gpus} per node (torchrun "
                "--nproc_per_node), or run every rank on the CPU with backend='gloo' (or "
                "with the GPUs hidden, CUDA_VISIBLE_DEVICES=, and backend='auto')"
            )
        torch.cuda.set_device(local_rank)
    dist.init_process_group(backend, timeout=datetime.timedelta(seconds=timeout_s))
    return True


def check_batch(global_batch: int) -> int:
    """The per-rank batch for ``global_batch``; it must divide evenly."""
    check_int("batch_size", global_batch, 1)  # 0 and -4 came back as per-rank batches
    size = world_size()
    if global_batch % size:
        raise ArgumentError(
            f"batch_size={global_batch} does not divide across world_size={size} processes; "
            f"use a multiple of {size}"
        )
    return global_batch // size


def _collective_device() -> torch.device:
    """Where a small collective's tensor lives: NCCL has no CPU tensors."""
    return torch.device("cuda") if dist.get_backend() == "nccl" else torch.device("cpu")


def float_key(value: float) -> int:
    """An int64 that is equal on every rank where ``value`` is (its bits): Python's
    ``hash`` of a NaN is the object's, and differs between processes."""
    return int(struct.unpack("<q", struct.pack("<d", value))[0])


def check_same_on_every_rank(what: str, values: dict[str, int], remedy: str) -> None:
    """Raise ``ValueError`` on every rank when ``values`` differ between ranks (one
    collective). Ranks that disagree on, say, their number of batches would otherwise run
    different numbers of collectives and die in the backend's raw mismatch abort."""
    size = world_size()
    if size == 1:
        return
    device = _collective_device()
    mine = torch.tensor(list(values.values()), dtype=torch.int64, device=device)
    gathered = [torch.empty_like(mine) for _ in range(size)]
    dist.all_gather(gathered, mine)
    rows = [g.tolist() for g in gathered]
    if all(row == rows[0] for row in rows):
        return
    keys = list(values)
    seen = "; ".join(
        f"rank {r}: " + ", ".join(f"{k}={v}" for k, v in zip(keys, row, strict=True))
        for r, row in enumerate(rows)
    )
    raise ValueError(f"{what} differ between ranks ({seen}); {remedy}")


def all_gather_object(value: Any) -> list[Any]:
    """Every rank's ``value`` (picklable), by rank, on every rank (one collective;
    ``[value]`` outside torchrun)."""
    if world_size() == 1:
        return [value]
    gathered: list[Any] = [None] * world_size()
    dist.all_gather_object(gathered, value)
    return gathered


def gather_object(value: Any, dst: int = 0) -> list[Any] | None:
    """Every rank's ``value`` (picklable), by rank, on rank ``dst``; ``None`` on the others
    (one collective; ``[value]`` outside torchrun). Nothing of it goes to the other ranks,
    so its cost grows with the number of ranks on ``dst`` alone."""
    if world_size() == 1:
        return [value]
    gathered: list[Any] | None = [None] * world_size() if rank() == dst else None
    dist.gather_object(value, gathered, dst=dst)
    return gathered


def same_on_every_rank(values: list[int]) -> bool:
    """Whether every rank passes the same ``values`` (one collective; True outside
    torchrun)."""
    gathered = all_gather_object(list(values))
    return all(g == gathered[0] for g in gathered)


def broadcast_(tensor: torch.Tensor, src: int = 0) -> torch.Tensor:
    """``tensor`` from rank ``src`` on every rank (through the backend's device)."""
    if world_size() == 1:
        return tensor
    device = torch.device("cuda") if dist.get_backend() == "nccl" else tensor.device
    moved = tensor.to(device)
    dist.broadcast(moved, src)
    return moved.to(tensor.device)


def all_reduce_sum(values: list[float]) -> list[float]:
    """Element-wise sums of ``values`` over all ranks (one collective)."""
    if world_size() == 1:
        return values
    device = _collective_device()
    tensor = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(tensor)
    return [float(v) for v in tensor.tolist()]


def shard(indices: torch.Tensor, pad: bool = True) -> torch.Tensor:
    """This rank's share of ``indices``, as ``DistributedSampler`` deals them (padded by
    wrapping around, so every rank gets as many)."""
    size = world_size()
    if size == 1:
        return indices
    if pad and len(indices) % size:
        extra = size - len(indices) % size
        # Repeated as often as needed: with fewer items than ranks, one copy is too short.
        repeats = -(-extra // len(indices)) if len(indices) else 0
        indices = torch.cat([indices, indices.repeat(repeats)[:extra]])
    return indices[rank() :: size]


def _fp32_allreduce_hook(state, bucket):  # type: ignore[no-untyped-def]
    # No annotations: DDP checks them at run time and this module's are strings.
    """DDP comm hook: sum 16-bit gradients in float32 (fewer rounding steps), then average
    and hand them back in their own dtype."""
    buffer = bucket.buffer()
    wide = buffer.float()
    # ``state``: DDP's process group (registered below), which may be a data-parallel
    # subgroup: its ranks alone sum, and its size averages.
    future = dist.all_reduce(wide, group=state, async_op=True).get_future()  # type: ignore[union-attr]
    ranks = dist.get_world_size(group=state)

    def done(fut: torch.futures.Future[Any]) -> torch.Tensor:
        summed: torch.Tensor = fut.value()[0]
        return summed.div_(ranks).to(buffer.dtype)

    result: torch.futures.Future[torch.Tensor] = future.then(done)
    return result


def distributed_data_parallel(
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    fp32_allreduce: bool = False,
    **kwargs: Any,
) -> DistributedDataParallel:
    """Wrap a model prepared with ``auto_mixed_precision`` (any level) in DDP.

    At O2/O3 the weights, and so the gradients DDP all-reduces, are 16-bit;
    ``fp32_allreduce=True`` sums them in float32. float32 masters stay consistent across
    ranks because every rank applies the same averaged gradients and skips the same steps,
    and they start from rank 0's: those of ``optimizer`` (the ``LossScaleOptimizer``), or,
    without it, those of any optimizer already built over the model (where rank 0 has
    none, the other ranks' take the 16-bit weights DDP broadcasts).
    """
    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError(
            "distributed_data_parallel needs an initialised process group: launch with "
            "torchrun and call mixprec.distributed.init_from_env() first"
        )
    # Without the optimizer, the masters of one built before: before DDP's broadcast.
    follow = _broadcast_masters(model) if optimizer is None else []
    ddp = DistributedDataParallel(model, **kwargs)
    with torch.no_grad():
        for weight, master in follow:
            master.copy_(weight)
    if isinstance(optimizer, LossScaleOptimizer):
        optimizer.broadcast_masters()
    if fp32_allreduce:
        ddp.register_comm_hook(ddp.process_group, _fp32_allreduce_hook)
    return ddp


def _broadcast_masters(model: nn.Module) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Rank 0's float32 masters (of an optimizer already built over the model) on every
    rank that has one. Without it, a model wrapped without its optimizer got rank 0's
    16-bit weights from DDP while each rank's masters stayed its own, and the first step
    copied them back: the ranks drifted apart for good. Read before DDP's broadcast, while
    each rank's weights still round from its own masters. Rank 0 decides: returns the
    (weight, master) pairs where rank 0 had none (weights loaded on rank 0 alone), which
    must take the weights DDP broadcasts."""
    pairs = [(p, live_master(p)) for p in model.parameters()]
    mine = torch.tensor([m is not None for _, m in pairs], dtype=torch.uint8)
    zeros = broadcast_(mine)
    with torch.no_grad():
        for (p, master), at_zero in zip(pairs, zeros.tolist(), strict=True):
            if at_zero:  # every rank joins; one without a master receives and drops it
                received = broadcast_(master if master is not None else p.detach().float())
                if master is not None:
                    master.copy_(received)
    return [
        (p, m) for (p, m), z in zip(pairs, zeros.tolist(), strict=True) if m is not None and not z
    ]


def barrier() -> None:
    """Wait for every rank (nothing outside torchrun): rank 0's writes are then on disk
    for the others to read."""
    if world_size() > 1:
        dist.barrier()


def fsdp_mixed_precision(policy: PolicyLike = None, reduce_dtype: torch.dtype | None = None) -> Any:
    """The FSDP2 ``MixedPrecisionPolicy`` for a mixprec policy: parameters gathered in the
    compute dtype, gradients reduced in float32 (or ``reduce_dtype``), outputs in the
    policy's output dtype. FSDP2 keeps the sharded parameters in float32 (they are the master
    weights), so use it with a ``LossScaleOptimizer`` and level ``O0``: FSDP does the casts.
    """
    from torch.distributed.fsdp import MixedPrecisionPolicy

    resolved = get_policy(policy)
    if resolved.compute_dtype == torch.float16:
        note_fsdp_float16()  # the shards' LossScaleOptimizer then scales (optim.fused)
    return MixedPrecisionPolicy(
        param_dtype=resolved.compute_dtype,
        reduce_dtype=reduce_dtype or torch.float32,
        output_dtype=resolved.output_dtype,
    )
