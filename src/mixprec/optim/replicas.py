"""Replicas whose 16-bit weights agree and whose float32 masters do not, at the first step.

A plain ``torch.nn.parallel.DistributedDataParallel`` built after the ``LossScaleOptimizer``
broadcasts rank 0's 16-bit weights into every rank's model. Rank 0's masters are the exact
values behind them; the other ranks' masters follow the write, and so hold those weights
rounded to 16 bits. The ranks then step different masters from the same gradients and never
agree again (670 of 2372 weights apart after 200 steps, in one run), without a word.
(``mixprec.distributed.distributed_data_parallel`` broadcasts the masters itself.)

So at the first step under ``torch.distributed``, every rank's sums of its 16-bit weights
and of its masters are gathered (one collective of three numbers, once): where the weights
agree on every rank and the masters do not, rank 0's masters are broadcast, and said.
Ranks that hold different weights (models of their own, pipeline stages) are left alone.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from mixprec._dist import is_distributed, is_dtensor
from mixprec._warn import warn_at_caller
from mixprec.optim.masters import MasterWeights

__all__ = ["masters_of_rank0_if_replicas"]


def _sums(weights: MasterWeights) -> torch.Tensor:
    with torch.no_grad():
        half = sum((p.double().sum() for p in weights.half), torch.zeros((), dtype=torch.float64))
        masters = sum(
            (m.double().sum() for m in weights.masters), torch.zeros((), dtype=torch.float64)
        )
    count = float(sum(p.numel() for p in weights.half))
    return torch.stack([torch.tensor(count, dtype=torch.float64), half.cpu(), masters.cpu()])


def masters_of_rank0_if_replicas(weights: MasterWeights) -> bool:
    """At the first step: make every rank's masters rank 0's where the ranks' 16-bit
    weights are replicas and their masters are not. Returns whether the look was taken (not
    while compiling: dynamo would trace the collective; the next eager step takes it)."""
    if torch.compiler.is_compiling():
        return False
    if not is_distributed() or any(is_dtensor(p) for p in weights.half[:1]):
        return True
    mine = _sums(weights)
    device = weights.half[0].device if weights.half else torch.device("cpu")
    if dist.get_backend() == "nccl":
        mine = mine.to(device)
    every = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(every, mine)
    table = torch.stack(every).cpu()
    replicas = bool((table[:, :2] == table[0, :2]).all())
    if not replicas or bool((table[:, 2] == table[0, 2]).all()):
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
