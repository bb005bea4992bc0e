"""Whether a tensor's elements fill its memory densely: what torch's fused optimizer kernels
(which walk a parameter, its gradient and its state as flat memory) and a master laid out
as its weight need."""

from __future__ import annotations

import torch

__all__ = ["is_dense", "laid_out_as"]


def is_dense(t: torch.Tensor) -> bool:
    """Whether ``t``'s elements fill its memory without gaps or overlaps, in any order
    (contiguous, channels_last, transposed): what a fused kernel's flat walk needs. Not a
    slice with a step (``W[:, ::2]``), whose gradient autograd makes contiguous."""
    if t.is_sparse or t.numel() <= 1:
        return not t.is_sparse
    expected = 1
    dims = sorted((st, sz) for st, sz in zip(t.stride(), t.shape, strict=True) if sz != 1)
    for stride, size in dims:
        if stride != expected:
            return False
        expected *= size
    return True


def laid_out_as(values: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """``values`` (of ``like``'s shape) in ``like``'s memory layout where ``like`` is dense
    and laid out otherwise (a channels_last conv's master built from a contiguous copy:
    each step's gradient load and copy-back converted layouts, 6% of a CNN's step)."""
    if values.stride() == like.stride() or not is_dense(like):
        return values
    return torch.empty_like(like, dtype=values.dtype).copy_(values)
