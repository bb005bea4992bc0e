"""Plain safetensors weights for inference: ``export_weights`` from a model (from its float32
masters where it has them), ``convert_checkpoint`` from any checkpoint mixprec reads."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch
from torch import nn

from mixprec._dtypes import dtype_name, parse_dtype
from mixprec._errors import ArgumentError
from mixprec._version import __version__
from mixprec.checkpoint._conversion import _check_on_range, _convert, _raise_non_finite
from mixprec.checkpoint._files import _atomic_write, as_path, same_file, writable_path
from mixprec.checkpoint._model import _buffer_names, _model_tensors, check_arguments
from mixprec.checkpoint.format import LoadReport, OnRange
from mixprec.checkpoint.read import read_checkpoint


def _write_weights(
    weights: dict[str, torch.Tensor],
    dtype: str | torch.dtype,
    on_range: OnRange,
    aliases: dict[str, str],
    source: str,
    path: str | os.PathLike[str],
    buffers: frozenset[str] | set[str] | None = frozenset(),
    who: str = "export_weights",
) -> LoadReport:
    """Cast the floating-point ``weights`` to ``dtype`` (range- and finiteness-checked; other
    dtypes, step counters say, are kept) and write them as plain safetensors. ``buffers``:
    the names exempt from the finiteness check; ``None`` where the source does not say."""
    destination = writable_path(who, path, "path" if who == "export_weights" else "destination")
    target = parse_dtype(dtype, argument="dtype")
    report = LoadReport(path=source)
    exempt = buffers or frozenset()
    out = {
        name: _convert(name, value, target, on_range, report, name not in exempt)
        if value.is_floating_point()  # float8 included: _convert refuses it with the reason
        else value
        for name, value in weights.items()
    }
    _raise_non_finite(report, on_range, buffers_listed=buffers is not None)
    out = _separate(out)
    meta = {"written_by": f"mixprec {__version__}", "dtype": dtype_name(target)}
    if aliases:
        meta["aliases"] = json.dumps(aliases)
    _atomic_write(out, meta, destination)
    return report


def _separate(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Contiguous tensors that share no memory, as safetensors writes them: a ``torch.save``
    file's tied weights come back as one storage, and views are not contiguous."""
    seen: set[int] = set()
    out = {}
    for name, value in tensors.items():
        value = value.contiguous()
        ptr = value.untyped_storage().data_ptr() if value.numel() else 0
        if ptr and ptr in seen:
            value = value.clone()
        seen.add(ptr)
        out[name] = value
    return out


def export_weights(
    model: nn.Module,
    path: str | os.PathLike[str],
    dtype: str | torch.dtype = torch.float32,
    optimizer: torch.optim.Optimizer | None = None,
) -> Path:
    """Write the model's weights in ``dtype`` (float32, bfloat16 or float16) as a plain
    safetensors file for inference; with a ``LossScaleOptimizer``, from its float32 masters.
    Raises ``CheckpointError`` if a value does not fit ``dtype`` or is NaN or inf."""
    check_arguments("export_weights", model, optimizer)
    tensors, aliases, _ = _model_tensors(model, optimizer, compensated=True)
    weights = {k.removeprefix("model/"): v for k, v in tensors.items()}
    buffers = _buffer_names(model, weights)
    _write_weights(weights, dtype, "error", aliases, type(model).__name__, path, buffers)
    return Path(path)


def convert_checkpoint(
    source: str | os.PathLike[str],
    destination: str | os.PathLike[str],
    dtype: str | torch.dtype = torch.float32,
    on_range: OnRange = "error",
    *,
    in_place: bool = False,
) -> LoadReport:
    """Rewrite the model weights of any readable checkpoint (mixprec, safetensors, a
    ``torch.save`` state dict) as a plain safetensors file in ``dtype``. Floating-point
    weights are cast (float8 ones are refused: their scales are not applied); ``on_range``
    treats out-of-range and non-finite values as ``load_checkpoint`` does.

    The output holds the weights only: the report's ``dropped`` lists what else the source
    held (optimizer, masters at full precision, loss scaler, RNG and trainer state). A
    ``destination`` that is the ``source`` file (through links or relative paths too) would
    lose all of that: an ``ArgumentError`` unless ``in_place=True``."""
    _check_on_range(on_range)
    as_path("convert_checkpoint", source, "source")
    as_path("convert_checkpoint", destination, "destination")
    if not isinstance(in_place, bool):
        raise ArgumentError(f"in_place must be a bool, got {type(in_place).__name__}")
    if same_file(source, destination):
        if not in_place:
            raise ArgumentError(
                f"convert_checkpoint: destination {str(destination)!r} is the source file; "
                "writing it would replace the checkpoint with its model weights alone, "
                "losing any optimizer, master-weight, loss-scaler, RNG and trainer state in "
                "it. Give another destination, or in_place=True to overwrite it"
            )
        # The file itself is replaced: through a symlink, the link stays and points to it.
        destination = os.path.realpath(destination)
    tensors, header = read_checkpoint(source)
    weights = {k.removeprefix("model/"): v for k, v in tensors.items() if k.startswith("model/")}
    report = _write_weights(
        weights, dtype, on_range, header.get("aliases", {}), str(source), destination,
        set(header["buffers"]) if "buffers" in header else None, "convert_checkpoint",
    )  # fmt: skip
    report.dropped = _dropped(header, parse_dtype(dtype, argument="dtype"))
    return report


def _dropped(header: dict[str, Any], dtype: torch.dtype) -> list[str]:
    """What a weights-only file leaves out of a checkpoint with ``header``."""
    dropped = []
    kind, classes = header.get("optimizer_kind"), header.get("optimizer_classes")
    if header.get("optimizer") is not None:
        inner = f" over {', '.join(classes)}" if kind == "LossScaleOptimizer" and classes else ""
        dropped.append(f"optimizer state ({kind}{inner})" if kind else "optimizer state")
        if kind == "LossScaleOptimizer":
            dropped.append("loss scaler state")
    masters = header.get("masters") or []
    if masters and dtype != torch.float32:
        dropped.append(
            f"float32 master weights of {len(masters)} parameter(s) (written rounded to "
            f"{dtype_name(dtype)})"
        )
    if header.get("rng") is not None:
        dropped.append("RNG states")
    trainer = [str(k) for k, _ in header.get("trainer_state", {}).get("__dict__", [])]
    if trainer:
        more = f", +{len(trainer) - 6} more" if len(trainer) > 6 else ""
        dropped.append(f"trainer state ({', '.join(trainer[:6])}{more})")
    if header.get("policy") is not None:
        dropped.append(f"policy and level ({header['policy']}, {header.get('level')})")
    if header.get("float8") is not None:
        dropped.append("float8 recipe and converted-layer list")
    other = header.get("other_entries") or []
    if other:  # a torch.save file's entries beside its state dict
        dropped.append(f"the file's other entries ({', '.join(other)})")
    return dropped
