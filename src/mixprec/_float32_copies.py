"""The float32 values a parameter had before ``auto_mixed_precision`` stored it in 16 bits,
kept on the parameter until its optimizer takes them as the master's starting values (or
``to_float``/``upcast_16bit`` takes them back), so that no master starts from rounded values.
"""

from __future__ import annotations

import dataclasses

import torch

__all__ = [
    "FP32_COPY_ATTR",
    "current_float32_copy",
    "release_float32_copies",
    "remember_float32",
    "take_float32_copy",
]

FP32_COPY_ATTR = "_mixprec_fp32"  # Float32Copy of a parameter stored in 16 bits


@dataclasses.dataclass
class Float32Copy:
    """The float32 values of a parameter before it went to 16 bits, and the parameter's
    version counter then: a later in-place write (``load_state_dict``) makes it stale."""

    values: torch.Tensor
    version: int = -1


def take_float32_copy(param: torch.Tensor) -> torch.Tensor | None:
    """Remove and return the float32 values kept for ``param`` if they are still current."""
    values = current_float32_copy(param)
    param.__dict__.pop(FP32_COPY_ATTR, None)
    # A copy: the kept values are a detached view of the float32 parameter as it was, which
    # shares the parameter's version counter; a master sharing it would make every write
    # to the master look like an external write to the weight.
    return None if values is None else values.clone()


def current_float32_copy(param: torch.Tensor) -> torch.Tensor | None:
    """The float32 values kept for ``param`` (left in place) if they are still current."""
    kept = param.__dict__.get(FP32_COPY_ATTR)
    if not isinstance(kept, Float32Copy) or kept.version != param._version:
        return None
    # A write through ``param.data`` (Hugging Face's weight init) leaves the version as it
    # was: the copy is current only if it still rounds to the weight. Once, not per step.
    values = kept.values.to(param.device)  # the model may have moved since
    return values if torch.equal(values.to(param.dtype), param.detach()) else None


def remember_float32(param: torch.Tensor, values: torch.Tensor) -> None:
    """Keep ``values`` (float32) as the current float32 copy of the 16-bit ``param``."""
    record = Float32Copy(values.detach().float(), version=param._version)
    setattr(param, FP32_COPY_ATTR, record)


def release_float32_copies(model: torch.nn.Module) -> int:
    """Drop the float32 values kept on ``model``'s 16-bit parameters, and return how many
    bytes they held.

    O2 keeps them until a ``LossScaleOptimizer`` starts its masters from them; a model used
    only for inference keeps them for good: 4 bytes a parameter beside the 2 of its 16-bit
    weight, more than the float32 model took. After this, a save with no optimizer writes
    the 16-bit values, and masters built later start from them."""
    released = 0
    for param in model.parameters():
        kept = param.__dict__.pop(FP32_COPY_ATTR, None)
        if isinstance(kept, Float32Copy):
            released += kept.values.numel() * kept.values.element_size()
    return released
