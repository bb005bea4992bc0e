"""Two tensors over the same memory: a second ``nn.Parameter`` made over a weight
(``head.weight = nn.Parameter(emb.weight)``) is another object with the weight's storage.
Casting each on its own untied them; at O2 each got a float32 master of its own, and the
copy-back of one overwrote the other's update."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch

from mixprec._errors import ArgumentError

__all__ = ["Memory", "frozen_aliases", "memory_of"]

Memory = tuple[int, int, tuple[int, ...], tuple[int, ...], torch.dtype]


def memory_of(t: torch.Tensor) -> Memory | None:
    """Where ``t``'s values live (storage, offset, shape, strides, dtype); ``None`` where that
    says nothing (meta, empty, sparse, or a tensor subclass without storage of its own)."""
    if (
        type(t) not in (torch.Tensor, torch.nn.Parameter)
        or t.layout != torch.strided  # a sparse tensor has no storage to ask
        or t.device.type == "meta"
    ):
        return None
    ptr = t.untyped_storage().data_ptr()
    if not t.numel() or not ptr:
        return None
    return ptr, int(t.storage_offset()), tuple(t.shape), tuple(t.stride()), t.dtype


def frozen_aliases(
    params: Sequence[Any],
    earlier: Iterable[torch.Tensor],
    where: str,
    needs_master: Callable[[torch.Tensor], bool],
) -> set[int]:
    """Among the 16-bit weights that would get float32 masters (``earlier``, then those of a
    group's ``params`` that need one), two parameter objects over the same memory: the ids
    of the frozen ones (``requires_grad=False``), which get none (their master's copy-back
    would undo the trainable one's update); two trainable ones are refused (one's update
    would overwrite the other's). The same object under two names (a tied weight) is one
    parameter."""
    groups: dict[Memory, dict[int, tuple[int, torch.Tensor]]] = {}  # memory -> id -> (j, p)
    for j, p in enumerate(params):
        if isinstance(p, torch.Tensor) and needs_master(p) and (key := memory_of(p)):
            groups.setdefault(key, {})[id(p)] = (j, p)
    earlier_at = {key: p for p in earlier if (key := memory_of(p))} if groups else {}
    frozen: set[int] = set()
    for key, objects in groups.items():
        first = earlier_at.get(key)  # given a master before this group (position -1)
        if first is not None:
            objects.setdefault(id(first), (-1, first))
        if len(objects) < 2:
            continue
        trainable = [jp for jp in objects.values() if jp[1].requires_grad]
        trainable.sort(key=lambda jp: jp[0])  # the message names the latest position
        if len(trainable) > 1 or (first is not None and not first.requires_grad and trainable):
            j, p = trainable[-1]
            raise ArgumentError(
                f"{where}['params'][{j}] (shape {tuple(p.shape)}, {p.dtype}) is a second "
                "nn.Parameter over the memory of another parameter of this optimizer (made "
                "as nn.Parameter(other.weight)): each would get a float32 master of its own "
                "and one's update would overwrite the other's. Tie the weights by assigning "
                "the parameter itself (head.weight = emb.weight), or freeze one "
                "(requires_grad=False) before the optimizer is built"
            )
        frozen.update(id(p) for j, p in objects.values() if j >= 0 and not p.requires_grad)
    return frozen
