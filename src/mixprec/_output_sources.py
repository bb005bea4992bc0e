"""A float32 model output remembers the 16-bit tensor it was upcast from.

Under a mixed policy the model computes its last layer in 16 bits and returns the result
upcast to float32 (``output_dtype``). A float32 loss on that output saves the float32 copy
for backward and sends a float32 gradient back, which the upcast's backward then rounds to
16 bits: for a language model's logits (2048 tokens x 8192 words) that is 64 MiB saved, a
fresh 64 MiB gradient and a cast pass, about a tenth of the step. The upcast is exact, so a
loss that knows the source (``mixprec.cross_entropy``) can read the 16-bit tensor and send
its gradient straight to it, rounded once, which gives the same values bit for bit.

The link is a strong reference from the float32 output to its source, made only while
autograd records (training); it lives as long as the output does.
"""

from __future__ import annotations

import torch

from mixprec._dtypes import HALF_DTYPES

__all__ = ["remember_source", "source_of"]

_ATTR = "_mixprec_upcast_of"


def remember_source(upcast: torch.Tensor, source: torch.Tensor) -> None:
    """Record that float32 ``upcast`` is ``source`` (16-bit) upcast, when autograd records."""
    if (
        torch.is_grad_enabled()
        and source.requires_grad
        and source.grad_fn is not None
        and source.dtype in HALF_DTYPES
        and upcast.dtype == torch.float32
    ):
        setattr(upcast, _ATTR, (source, source._version, upcast._version))


def source_of(tensor: torch.Tensor) -> torch.Tensor | None:
    """The 16-bit tensor ``tensor`` is an unchanged upcast of, or ``None``.

    ``None`` as well where the shortcut would be visible: neither may have been written
    since, and the output must have no gradient hooks and not retain its gradient (its
    gradient is skipped), and the link must still be the output's autograd input."""
    link = getattr(tensor, _ATTR, None)
    if link is None or not torch.is_grad_enabled():
        return None
    source, source_version, version = link
    grad_fn = tensor.grad_fn
    if (
        source._version != source_version
        or tensor._version != version
        or tensor.retains_grad
        or tensor._backward_hooks
        or grad_fn is None
        or not grad_fn.next_functions
        or grad_fn.next_functions[0][0] is not source.grad_fn
    ):
        return None
    return source  # type: ignore[no-any-return]
