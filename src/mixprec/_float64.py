"""float64 parameters and buffers met by ``auto_mixed_precision``.

Mixed precision keeps float32 as its widest dtype (O0/O1 weights, O2/O3 masters). A float64
model is lowered to float32 first, with a warning, so that every level then proceeds as from
a float32 model: O2 keeps the float32 values for its masters instead of starting them from
16-bit roundings, and nothing is lowered without a word. A finite value beyond float32's
range would become inf: such a model is refused before anything changes.
"""

from __future__ import annotations

import torch
from torch import nn

from mixprec._dtypes import finite_peak
from mixprec._errors import ArgumentError

__all__ = ["check_float64", "lower_float64"]

_FLOAT32_MAX = float(torch.finfo(torch.float32).max)


def _float64_tensors(model: nn.Module) -> dict[str, tuple[str, torch.Tensor]]:
    """Name -> ("parameter" or "buffer", tensor), each tensor once (tied weights)."""
    found: dict[int, tuple[str, str, torch.Tensor]] = {}
    for kind, named in (("parameter", model.named_parameters()), ("buffer", model.named_buffers())):
        for name, t in named:
            if t.dtype == torch.float64 and id(t) not in found:
                found[id(t)] = (name, kind, t)
    return {name: (kind, t) for name, kind, t in found.values()}


def check_float64(model: nn.Module) -> None:
    """Raises ``ArgumentError`` naming the first float64 tensor holding a finite value past
    float32's range (``3.40282e+38``): lowering it would make it inf."""
    for name, (kind, t) in _float64_tensors(model).items():
        peak = finite_peak(t)
        if peak > _FLOAT32_MAX:
            raise ArgumentError(
                f"auto_mixed_precision(model=...): {kind} {name!r} is float64 with max |value| "
                f"{peak:.6g}, beyond float32's {_FLOAT32_MAX:.6g}; mixed precision keeps float32 "
                "at most, where it would become inf. Rescale it, or keep the model in float64"
            )


def lower_float64(model: nn.Module) -> tuple[int, int]:
    """Store ``model``'s float64 parameters and buffers in float32 (parameters keep their
    identity; gradients follow). Returns how many parameters and buffers were lowered."""
    tensors = _float64_tensors(model)
    if not tensors:
        return 0, 0
    params = sum(kind == "parameter" for kind, _ in tensors.values())

    def lower(t: torch.Tensor) -> torch.Tensor:
        return t.float() if t.dtype == torch.float64 else t

    model._apply(lower)  # Module._apply assigns .data: optimizers holding them stay valid
    return params, len(tensors) - params
