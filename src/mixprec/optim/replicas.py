"""Replicas whose 16-bit weights agree and whose float32 masters do not, at the first step.

A plain ``torch.nn.parallel.DistributedDataParallel`` built after the ``LossScaleOptimizer``
broadcasts rank 0's 16-bit weights into every rank's model. Rank 0's masters are the exact
values behind them; the other ranks' masters follow the write, and so hold those weights
rounded to 16 bits. The ranks then step different masters from the same gradients and never
agree again (670 of 2372 weights apart after 200 steps, in one run), without a word.
(``mixprec.distributed.distributed_data_parallel`` broadcasts the masters itself.)

So at the first step under ``torch.distributed``, the ranks compare the sums of their
16-bit weights and of their masters (one all-reduce of six numbers, once, on the weights'
device): where the weights agree on every rank and the masters do not, rank 0's masters are
broadcast, and said. Ranks that hold different weights (models of their own, pipeline
stages) are left alone, as are models with no masters (O1; FSDP2, whose shards are them).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from mixprec._dist import is_distributed, is_dtensor
from mixprec._warn import warn_at_caller
from mixprec.optim.masters import MasterWeights

__all__ = ["masters_of_rank0_if_replicas"]


def _sums(weights: MasterWeights) -> torch.Tensor:
    """The count and the sums of the 16-bit weights and of the masters, each with its
    negation (one all-reduce of the maxima gives every rank the maxima and the minima)."""
    with torch.no_grad():
        # Summed in float64 without a float64 copy of each tensor (8 bytes a value).
        half = torch.stack([p.sum(dtype=torch.float64) for p in weights.half]).sum()
        masters = torch.stack([m.sum(dtype=torch.float64) for m in weights.masters]).sum()
        count = torch.tensor(float(sum(p.numel() for p in weights.half)), device=half.device)
        sums = torch.stack([count.double(), half, masters])
    return torch.cat([sums, -sums])


def masters_of_rank0_if_replicas(weights: MasterWeights) -> bool:
    """At the first step: make every rank's masters rank 0's where the ranks' 16-bit
    weights are replicas and their masters are not. Returns whether the look was taken (not
    while compiling: dynamo would trace the collective; the next eager step takes it)."""
    if torch.compiler.is_compiling():
        return False
    if not is_distributed() or not weights.half or is_dtensor(weights.half[0]):
        return True  # no masters to align (O1, FSDP2's shards are the masters)
    # On the weights' device, as the step's own found_inf all-reduce: NCCL has no CPU.
    bounds = _sums(weights)
    dist.all_reduce(bounds, op=dist.ReduceOp.MAX)
    high, low = bounds[:3].tolist(), (-bounds[3:]).tolist()
    replicas = high[0] == low[0] and high[1] == low[1]
    if not replicas or high[2] == low[2]:
        return True
    weights.broadcast(0)
    if dist.get_rank() == 0:
        warn_at_caller(
            "the ranks' 16-bit weights are replicas but their float32 master weights were not "
            "(a DistributedDataParallel built after the LossScaleOptimizer broadcast rank "
            "0's weights, and the other ranks' masters held them rounded): every rank's "
            "masters are now rank 0's. Wrap with mixprec.distributed."
            "distributed_data_parallel(model, opt), which sends the masters too"
        )
    return True
