"""Plain safetensors weights for inference: ``export_weights`` from a model (from its float32
masters where it has them), ``convert_checkpoint`` from any checkpoint mixprec reads."""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
from torch import nn

from mixprec._dtypes import dtype_name, parse_dtype
from mixprec._version import __version__
from mixprec.checkpoint._conversion import _check_on_range, _convert, _raise_non_finite
from mixprec.checkpoint._files import _atomic_write
from mixprec.checkpoint._model import _buffer_names, _model_tensors
from mixprec.checkpoint.format import LoadReport, OnRange
from mixprec.checkpoint.read import read_checkpoint


def _write_weights(
    weights: dict[str, torch.Tensor],
    dtype: str | torch.dtype,
    on_range: OnRange,
    aliases: dict[str, str],
    source: str,
    path: str | os.PathLike[str],
    buffers: frozenset[str] | set[str] = frozenset(),
) -> LoadReport:
    """Cast the floating-point ``weights`` to ``dtype`` (range- and finiteness-checked; other
    dtypes, step counters say, are kept) and write them as plain safetensors."""
    target = parse_dtype(dtype, argument="dtype")
    report = LoadReport(path=source)
    out = {
        name: _convert(name, value, target, on_range, report, name not in buffers)
        if value.is_floating_point()  # float8 included: _convert refuses it with the reason
        else value
        for name, value in weights.items()
    }
    _raise_non_finite(report, on_range)
    meta = {"written_by": f"mixprec {__version__}", "dtype": dtype_name(target)}
    if aliases:
        meta["aliases"] = json.dumps(aliases)
    _atomic_write(out, meta, Path(path))
    return report


def export_weights(
    model: nn.Module,
    path: str | os.PathLike[str],
    dtype: str | torch.dtype = torch.float32,
    optimizer: torch.optim.Optimizer | None = None,
) -> Path:
    """Write the model's weights in ``dtype`` (float32, bfloat16 or float16) as a plain
    safetensors file for inference; with a ``LossScaleOptimizer``, from its float32 masters.
    Raises ``CheckpointError`` if a value does not fit ``dtype`` or is NaN or inf."""
    tensors, aliases, _ = _model_tensors(model, optimizer)
    weights = {k.removeprefix("model/"): v for k, v in tensors.items()}
    buffers = _buffer_names(model, weights)
    _write_weights(weights, dtype, "error", aliases, type(model).__name__, path, buffers)
    return Path(path)


def convert_checkpoint(
    source: str | os.PathLike[str],
    destination: str | os.PathLike[str],
    dtype: str | torch.dtype = torch.float32,
    on_range: OnRange = "error",
) -> LoadReport:
    """Rewrite the model weights of any readable checkpoint (mixprec, safetensors, a
    ``torch.save`` state dict) as a plain safetensors file in ``dtype``. Floating-point
    weights are cast (float8 ones are refused: their scales are not applied); ``on_range``
    treats out-of-range and non-finite values as ``load_checkpoint`` does."""
    _check_on_range(on_range)
    tensors, header = read_checkpoint(source)
    weights = {k.removeprefix("model/"): v for k, v in tensors.items() if k.startswith("model/")}
    return _write_weights(
        weights, dtype, on_range, header.get("aliases", {}), str(source), destination
    )
