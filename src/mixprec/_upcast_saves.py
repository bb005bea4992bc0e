"""Float32 work keeps the 16-bit inputs it upcast, not the float32 copies, for backward.

A function run in float32 inside a 16-bit region (``layer_norm`` under ``Float32Functions``)
or a float32 island (GroupNorm, RMSNorm) receives 16-bit activations,
upcasts them on entry, and autograd saves the float32 copy for backward: twice the bytes of
the activation it came from. The upcast is exact, so saving a 16-bit copy of the source and
upcasting it again in backward gives backward the same values (bit for bit) at half the
memory.

Done with ``torch.autograd.graph.saved_tensors_hooks`` while the region runs (eager only:
under ``torch.compile`` AOTAutograd's partitioner chooses the saved tensors, and it saves the
16-bit input and recomputes the cast by itself; tested). Skipped where
other saved-tensor hooks are active (activation checkpointing has its own, and nesting ours
inside would keep tensors it means to drop) or where torch has disabled them.
"""

from __future__ import annotations

import contextlib
import weakref
from typing import Any

import torch

from mixprec._dtypes import HALF_DTYPES

__all__ = ["functorch_active", "keep_16bit_sources"]

ENABLED = True  # tests switch it off to compare against plain autograd


class _Source:
    """A saved float32 tensor, kept as a copy of the 16-bit tensor it was upcast from.

    A copy, not the tensor itself: code may write into that 16-bit activation in place after
    the float32 function used it (``h += attn(norm(h))``), which is legal when autograd keeps
    the float32 copy, and must stay legal."""

    __slots__ = ("source",)

    def __init__(self, source: torch.Tensor) -> None:
        self.source = source.detach().clone()


def _unpack(packed: Any) -> torch.Tensor:
    # Module-level on purpose: autograd keeps the unpack hook with every saved tensor, and a
    # bound method would keep the region's float32 inputs alive with it.
    if isinstance(packed, _Source):
        return packed.source.to(torch.float32)
    return packed  # type: ignore[no-any-return]


def _hooks_usable() -> bool:
    autograd: Any = torch._C._autograd
    try:
        return bool(autograd._saved_tensors_hooks_is_enabled()) and (
            autograd._top_saved_tensors_default_hooks(False) is None
        )
    except AttributeError:  # a torch without these (private) probes: stay out of the way
        return False


def functorch_active() -> bool:
    """Inside a ``torch.func`` transform (``grad``, ``vmap``): its wrapped tensors have no
    storage to read, nor a value to look at on the host."""
    active = getattr(torch._C, "_are_functorch_transforms_active", None)
    return bool(active()) if active is not None else False


def keep_16bit_sources(
    before: tuple[Any, ...], after: tuple[Any, ...]
) -> contextlib.AbstractContextManager[Any] | None:
    """Saved-tensor hooks for a float32 region whose positional inputs ``before`` were cast
    to ``after``; ``None`` where no input was upcast from 16 bits or hooks cannot be used."""
    # Under torch.compile the partitioner picks what backward saves (saved-tensor hooks do not
    # trace); it keeps the 16-bit input and recomputes the upcast by itself.
    if not ENABLED or not torch.is_grad_enabled() or torch.compiler.is_compiling():
        return None
    if functorch_active():  # per-sample gradients (vmap of grad) raised on data_ptr()
        return None
    # Weak: autograd keeps the pack hook too, and a strong reference would keep every 16-bit
    # input alive as long as the graph (measured: as much memory again as the copies).
    upcast = {
        (up.data_ptr(), up.shape, up.stride()): (weakref.ref(src), up._version)
        for src, up in zip(before, after, strict=False)
        if isinstance(src, torch.Tensor)
        and src.dtype in HALF_DTYPES
        and isinstance(up, torch.Tensor)
        and up.dtype == torch.float32
    }
    if not upcast or not _hooks_usable():
        return None

    def pack(saved: torch.Tensor) -> Any:
        if saved.dtype != torch.float32:
            return saved
        entry = upcast.get((saved.data_ptr(), saved.shape, saved.stride()))
        if entry is None or saved._version != entry[1]:  # not the upcast, or written since
            return saved
        src = entry[0]()
        return saved if src is None else _Source(src)

    return torch.autograd.graph.saved_tensors_hooks(pack, _unpack)
