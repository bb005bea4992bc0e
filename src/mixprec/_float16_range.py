"""Values past float16's range met when ``auto_mixed_precision`` stores a model in float16.

O2 stores the matrix layers' weights in the compute dtype, O3 every parameter and buffer.
In float16 a finite value past 65504 becomes inf: a large bias, or BatchNorm running
statistics of unnormalised features (``running_var`` of raw sensor values), would then
turn the model's outputs to inf or NaN, or to a constant, without a word. Such a model is
refused before anything changes, naming the tensor and what to keep in float32.
"""

from __future__ import annotations

import torch
from torch import nn

from mixprec._dtypes import finfo_max, finite_peak
from mixprec._errors import ArgumentError
from mixprec._module_kinds import is_half_storage
from mixprec.keep import ROOT_NAME

__all__ = ["check_float16_range"]

_FLOAT16_MAX = finfo_max(torch.float16)


def check_float16_range(
    model: nn.Module, level: str, compute: torch.dtype, fixed: set[int]
) -> None:
    """Raise ``ArgumentError`` naming the first floating tensor that ``level`` will store in
    float16 (O2: the matrix layers' parameters; O3: every parameter and buffer; none in
    ``fixed``, the ids of modules kept in their dtype) with a finite value past 65504."""
    if compute != torch.float16 or level not in ("O2", "O3"):
        return
    buffers = level == "O3"
    for name, module in model.named_modules():
        if id(module) in fixed or not (buffers or is_half_storage(module, compute)):
            continue
        tensors = list(module.named_parameters(recurse=False))
        if buffers:
            tensors += list(module.named_buffers(recurse=False))
        for local, t in tensors:
            if not t.is_floating_point() or t.dtype == torch.float16:
                continue
            peak = finite_peak(t)
            if peak > _FLOAT16_MAX:
                where = f"{name}.{local}" if name else local
                keep = repr(name or ROOT_NAME)
                raise ArgumentError(
                    f"auto_mixed_precision: {where!r} has max |value| {peak:.6g}, beyond "
                    f"float16's {_FLOAT16_MAX:.6g}: stored in float16 it would become inf. "
                    f"Keep {keep} in float32 (keep_float32=[{keep}]), rescale the data it "
                    "was computed from, or use bfloat16"
                )
