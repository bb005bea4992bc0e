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

``distributed_data_parallel(model, opt)`` makes every rank rank 0's copy: DDP sends the
16-bit weights, ``broadcast_masters`` the masters, and ``state_of_rank`` the rest of
``opt``'s state where it differs (two small all-reduces when it agrees): the loss scale
and the inner optimizers' state (Adam's moments). A checkpoint loaded on rank 0 alone
otherwise left the other ranks at a scale of 65536 against rank 0's 256, each unscaling
DDP's average of differently scaled gradients by its own scale (masters 7.95 apart after
5 steps).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch.utils._pytree import tree_leaves, tree_map_only

from mixprec._dist import is_distributed, is_dtensor, rank_bounds
from mixprec._warn import warn_at_caller
from mixprec.optim.masters import MasterWeights

if TYPE_CHECKING:
    from mixprec.optim.loss_scale_optimizer import LossScaleOptimizer

__all__ = ["masters_of_rank0_if_replicas", "state_of_rank"]


def _sums(weights: MasterWeights) -> torch.Tensor:
    """The count and the sums of the 16-bit weights and of the masters."""
    with torch.no_grad():
        # Summed in float64 without a float64 copy of each tensor (8 bytes a value).
        half = torch.stack([p.sum(dtype=torch.float64) for p in weights.half]).sum()
        masters = torch.stack([m.sum(dtype=torch.float64) for m in weights.masters]).sum()
        count = torch.tensor(float(sum(p.numel() for p in weights.half)), device=half.device)
        return torch.stack([count.double(), half, masters])


def masters_of_rank0_if_replicas(weights: MasterWeights) -> bool:
    """At the first step: make every rank's masters rank 0's where the ranks' 16-bit
    weights are replicas and their masters are not. Returns whether the look was taken (not
    while compiling: dynamo would trace the collective; the next eager step takes it)."""
    if torch.compiler.is_compiling():
        return False
    if not is_distributed() or not weights.half or is_dtensor(weights.half[0]):
        return True  # no masters to align (O1, FSDP2's shards are the masters)
    # On the weights' device, as the step's own found_inf all-reduce: NCCL has no CPU.
    highs, lows = rank_bounds(_sums(weights))
    high, low = highs.tolist(), lows.tolist()
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


def _state_sums(opt: LossScaleOptimizer, device: torch.device) -> torch.Tensor:
    """Numbers that differ where two ranks' scaler or inner optimizer states do: the count
    of their numbers and tensors, then the float64 sum of each (a pass over the optimizer
    state, once, when the model is wrapped)."""
    scaler = {k: v for k, v in opt.loss_scaler.state_dict().items() if k != "type"}
    leaves = tree_leaves([scaler, [dict(inner.state) for inner in opt.optimizers]])
    with torch.no_grad():
        values = [
            leaf.detach().sum(dtype=torch.float64).to(device)
            if isinstance(leaf, torch.Tensor)
            else torch.tensor(float(leaf), dtype=torch.float64, device=device)
            for leaf in leaves
            if isinstance(leaf, torch.Tensor | bool | int | float)
        ]
        count = torch.tensor(float(len(values)), dtype=torch.float64, device=device)
        # A rank with more entries than another would compare unequal lengths: the count first.
        return torch.stack([count, *values])


def state_of_rank(opt: LossScaleOptimizer, src: int) -> None:
    """Every rank takes rank ``src``'s loss scaler and inner optimizer state, where any
    rank's differs from it (two small all-reduces when they agree: the lengths, then the
    sums)."""
    if not is_distributed() or torch.compiler.is_compiling():
        return
    params = opt._weights.model_params()
    device = params[0].device if params else torch.device("cpu")
    mine = _state_sums(opt, device)
    high, low = rank_bounds(torch.tensor([float(mine.numel())], device=device))
    same = bool(high == low)
    if same:  # as many entries on every rank: their sums compare element by element
        high, low = rank_bounds(mine)
        same = torch.equal(high, low)
    if same:
        return
    # Through host memory: a CUDA tensor pickled on rank 0 would unpickle onto rank 0's GPU.
    host = tree_map_only(torch.Tensor, lambda t: t.detach().cpu(), opt.state_dict())
    state = [host if dist.get_rank() == src else None]
    dist.broadcast_object_list(state, src=src, device=device if device.type != "cpu" else None)
    if dist.get_rank() != src:
        opt.load_state_dict(state[0] or {})
