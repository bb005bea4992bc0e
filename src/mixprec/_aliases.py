"""Two tensors over the same memory: a second ``nn.Parameter`` made over a weight
(``head.weight = nn.Parameter(emb.weight)``) is another object with the weight's storage.
Casting each on its own untied them; at O2 each got a float32 master of its own, and the
copy-back of one overwrote the other's update."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch

from mixprec._errors import ArgumentError

__all__ = ["Memory", "memory_of", "refuse_aliases"]

Memory = tuple[int, int, tuple[int, ...], tuple[int, ...], torch.dtype]


def memory_of(t: torch.Tensor) -> Memory | None:
    """Where ``t``'s values live (storage, offset, shape, strides, dtype); ``None`` where that
    says nothing (meta, empty, or a tensor subclass without storage of its own)."""
    if type(t) not in (torch.Tensor, torch.nn.Parameter) or t.device.type == "meta":
        return None
    ptr = t.untyped_storage().data_ptr()
    if not t.numel() or not ptr:
        return None
    return ptr, int(t.storage_offset()), tuple(t.shape), tuple(t.stride()), t.dtype


def refuse_aliases(
    params: Sequence[Any],
    earlier: Iterable[torch.Tensor],
    where: str,
    needs_master: Callable[[torch.Tensor], bool],
) -> None:
    """Refuse two parameter objects over the same memory among the 16-bit weights that get
    float32 masters (``earlier``, then those of a group's ``params`` that need one): one
    master's copy-back would undo the other's update. The same object under two names (a
    tied weight) is one parameter."""
    seen: dict[Memory, int] = {}
    for p in earlier:
        key = memory_of(p)
        if key is not None:
            seen[key] = id(p)
    for j, p in enumerate(params):
        if not isinstance(p, torch.Tensor) or not needs_master(p):
            continue
        key = memory_of(p)
        if key is None:
            continue
        if seen.setdefault(key, id(p)) != id(p):
            raise ArgumentError(
                f"{where}['params'][{j}] (shape {tuple(p.shape)}, {p.dtype}) is a second "
                "nn.Parameter over the memory of another parameter of this optimizer (made "
                "as nn.Parameter(other.weight)): each would get a float32 master of its own "
                "and one's update would overwrite the other's. Tie the weights by assigning "
                "the parameter itself (head.weight = emb.weight)"
            )
