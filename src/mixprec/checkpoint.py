"""Checkpoints: safetensors tensors plus a JSON header, written atomically, loaded with
dtype conversion, never executing code from the file.

One ``.safetensors`` file holds every tensor (model weights, optimizer state, RNG states)
and, under the metadata key ``"mixprec"``, a JSON document: format version, mixprec and
torch versions, policy and level (with a float8 policy's recipe and converted layers), the
non-tensor parts of the optimizer and trainer state, and a SHA-256 checksum of the tensors.
Weights that have float32 masters are stored as the masters: float32 is the source of
truth, and a 16-bit model gets them rounded on load.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import random
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file
from torch import nn

from mixprec._dtypes import HALF_DTYPES, dtype_name, parse_dtype
from mixprec.casting import remember_float32
from mixprec.float8 import summary as float8_summary
from mixprec.levels import applied
from mixprec.optim import LossScaleOptimizer

FORMAT = "mixprec-checkpoint"
FORMAT_VERSION = 1
OnRange = Literal["error", "clamp", "ignore"]

__all__ = [
    "CheckpointError",
    "LoadReport",
    "convert_checkpoint",
    "export_weights",
    "load_checkpoint",
    "read_checkpoint",
    "save_checkpoint",
]


class CheckpointError(ValueError):
    """A checkpoint that cannot be used: unreadable, truncated, tampered, unsafe, or not
    matching the model. The message names the file and what is wrong."""


@dataclass
class LoadReport:
    """What ``load_checkpoint`` did."""

    path: str
    converted: list[tuple[str, str, str]] = field(default_factory=list)  # name, from, to
    out_of_range: list[tuple[str, float, str, str]] = field(default_factory=list)
    missing: list[str] = field(default_factory=list)
    unexpected: list[str] = field(default_factory=list)
    mismatched: list[tuple[str, tuple[int, ...], tuple[int, ...]]] = field(default_factory=list)
    metadata: dict[str, Any] = field(default_factory=dict)
    trainer_state: dict[str, Any] = field(default_factory=dict)

    def __str__(self) -> str:
        lines = [f"loaded {self.path}: {len(self.converted)} tensors converted"]
        lines += [f"  {name}: {a} -> {b}" for name, a, b in self.converted]
        for name, peak, dtype, action in self.out_of_range:
            lines.append(f"  {name}: max |value| {peak:.6g} exceeds {dtype} ({action})")
        return "\n".join(lines + self.mismatch_lines())

    def mismatch_lines(self) -> list[str]:
        lines = [
            f"  {label}: {', '.join(names)}"
            for label, names in (("missing", self.missing), ("unexpected", self.unexpected))
            if names
        ]
        return lines + [
            f"  shape mismatch {n}: saved {a}, model {b}" for n, a, b in self.mismatched
        ]


# -- nested state <-> tensors + JSON --------------------------------------------------------


def _flatten(obj: Any, prefix: str, tensors: dict[str, torch.Tensor]) -> Any:
    """Move every tensor of ``obj`` into ``tensors`` and return a JSON-able skeleton."""
    if isinstance(obj, torch.Tensor):
        tensors[prefix] = obj.detach().cpu().contiguous()
        return {"__tensor__": prefix}
    if isinstance(obj, dict):
        return {"__dict__": [[k, _flatten(v, f"{prefix}/{k}", tensors)] for k, v in obj.items()]}
    if isinstance(obj, (list, tuple)):
        items = [_flatten(v, f"{prefix}/{i}", tensors) for i, v in enumerate(obj)]
        return items if isinstance(obj, list) else {"__tuple__": items}
    if isinstance(obj, float) and not math.isfinite(obj):
        return {"__float__": repr(obj)}
    if obj is None or isinstance(obj, (bool, int, float, str)):
        return obj
    raise TypeError(f"cannot store a {type(obj).__name__} in a checkpoint (at {prefix!r})")


def _unflatten(skeleton: Any, tensors: dict[str, torch.Tensor]) -> Any:
    if isinstance(skeleton, list):
        return [_unflatten(v, tensors) for v in skeleton]
    if isinstance(skeleton, dict):
        if "__tensor__" in skeleton:
            return tensors[skeleton["__tensor__"]]
        if "__tuple__" in skeleton:
            return tuple(_unflatten(v, tensors) for v in skeleton["__tuple__"])
        if "__float__" in skeleton:
            return float(skeleton["__float__"])
        return {k: _unflatten(v, tensors) for k, v in skeleton["__dict__"]}
    return skeleton


def _checksum(tensors: dict[str, torch.Tensor]) -> str:
    digest = hashlib.sha256()
    for name in sorted(tensors):
        t = tensors[name].contiguous()
        digest.update(f"{name}|{t.dtype}|{tuple(t.shape)}|".encode())
        digest.update(t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return digest.hexdigest()


def _rng_state() -> dict[str, Any]:
    state: dict[str, Any] = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def _set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


# -- writing -------------------------------------------------------------------------------


def _atomic_write(tensors: dict[str, torch.Tensor], metadata: dict[str, str], path: Path) -> None:
    """Temporary file in the same folder, fsync, rename, fsync the folder: a crash at any
    point leaves the previous file (or none), never a torn one."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    os.close(fd)
    try:
        save_file(tensors, tmp, metadata)
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())
        # mkstemp makes the file 0600; a checkpoint gets the mode any new file would.
        os.chmod(tmp, 0o666 & ~_umask())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    if hasattr(os, "O_DIRECTORY"):
        dir_fd = os.open(path.parent, os.O_RDONLY | os.O_DIRECTORY)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)


def _umask() -> int:
    mask = os.umask(0)  # the only way to read it; set back at once
    os.umask(mask)
    return mask


def temporary_files(folder: Path) -> list[Path]:
    """Temporary files ``_atomic_write`` leaves behind when its process is killed."""
    return sorted(folder.glob(".*.safetensors.*.tmp"))


def _model_tensors(
    model: nn.Module, optimizer: torch.optim.Optimizer | None
) -> tuple[dict[str, torch.Tensor], dict[str, str], list[str]]:
    """State-dict tensors with masters in place of 16-bit weights; tied tensors stored once."""
    names = _parameter_names(model)
    masters: dict[str, torch.Tensor] = {}
    if isinstance(optimizer, LossScaleOptimizer):
        for param, master in optimizer.master_weights():
            for name in names.get(id(param), []):  # a tied weight has several names
                masters[name] = master
    tensors: dict[str, torch.Tensor] = {}
    aliases: dict[str, str] = {}
    seen: dict[tuple[int, int, tuple[int, ...], torch.dtype], str] = {}
    for key, value in model.state_dict().items():
        value = masters.get(key, value)
        ident = (value.untyped_storage().data_ptr(), value.storage_offset(), tuple(value.shape),
                 value.dtype)  # fmt: skip
        if value.numel() and ident in seen:
            aliases[key] = seen[ident]
            continue
        seen[ident] = key
        tensors[f"model/{key}"] = value.detach().cpu().contiguous()
    return tensors, aliases, sorted(masters)


def _parameter_names(model: nn.Module) -> dict[int, list[str]]:
    names: dict[int, list[str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(param), []).append(name)
    return names


def save_checkpoint(
    path: str | os.PathLike[str],
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    trainer_state: dict[str, Any] | None = None,
) -> Path:
    """Write model, optimizer (inner state, masters, loss scaler), ``trainer_state`` (step,
    epoch, data order...) and RNG states to ``path`` atomically. Returns the path."""
    target = Path(path)
    tensors, aliases, master_names = _model_tensors(model, optimizer)
    optim_state: Any = None
    if optimizer is not None:
        state = optimizer.state_dict()
        if isinstance(optimizer, LossScaleOptimizer):
            state = {k: v for k, v in state.items() if k != "master_weights"}
        optim_state = _flatten(state, "optim", tensors)
    done = applied(model)
    header = {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "mixprec_version": _version(),
        "torch_version": torch.__version__,
        "policy": str(done.policy) if done else None,
        "level": done.level if done else None,
        # Float8 policies: the torchao recipe and the converted layers. Their weights are the
        # float32 (or master) values, as for any layer: float8 copies exist only in a forward.
        "float8": float8_summary(model),
        "aliases": aliases,
        "masters": master_names,
        "optimizer": optim_state,
        "optimizer_kind": type(optimizer).__name__ if optimizer is not None else None,
        "trainer_state": _flatten(trainer_state or {}, "trainer", tensors),
        "rng": _flatten(_rng_state(), "rng", tensors),
    }
    header["checksum"] = _checksum(tensors)
    _atomic_write(tensors, {"mixprec": json.dumps(header)}, target)
    return target


def _version() -> str:
    from mixprec import __version__

    return __version__


# -- reading -------------------------------------------------------------------------------


def _read_torch_file(path: Path) -> dict[str, torch.Tensor]:
    """A ``torch.save`` file, read with ``weights_only=True``: tensors and plain containers
    only; anything else is refused before it can run."""
    try:
        obj = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as err:  # UnpicklingError, RuntimeError, EOFError...
        raise CheckpointError(
            f"{path}: refused: not a plain tensor state dict ({type(err).__name__}: "
            f"{str(err).splitlines()[0] if str(err) else ''}); mixprec never unpickles objects"
        ) from None
    for key in ("state_dict", "model", "model_state_dict"):
        if isinstance(obj, dict) and isinstance(obj.get(key), dict):
            obj = obj[key]
            break
    if not isinstance(obj, dict) or not all(isinstance(v, torch.Tensor) for v in obj.values()):
        raise CheckpointError(f"{path}: holds no state dict of tensors")
    return {f"model/{k}": v for k, v in obj.items()}


def read_checkpoint(path: str | os.PathLike[str]) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """``(tensors, header)`` of a mixprec checkpoint, a plain ``.safetensors`` file or a
    ``torch.save`` state dict (model tensors are named ``model/<key>``), after checking the
    format version and the checksum."""
    file = Path(path)
    if file.is_dir():
        found = sorted(p.name for p in file.glob("*.safetensors"))
        hint = f" (it holds {', '.join(found[:4])})" if found else ""
        raise CheckpointError(f"{str(file)!r} is a directory, not a checkpoint file{hint}")
    if not file.is_file():
        raise CheckpointError(f"{file}: no such checkpoint file")
    with file.open("rb") as f:
        head = f.read(9)
    # safetensors: an 8-byte little-endian header length, then the JSON header. Test for it
    # first: its length's first byte can be 0x80, a pickle's first byte.
    header_end = 8 + int.from_bytes(head[:8], "little") if len(head) == 9 else -1
    if not (head[8:9] == b"{" and header_end <= file.stat().st_size):
        if head[:4] == b"PK\x03\x04" or head[:1] == b"\x80":
            return _read_torch_file(file), {}
        raise CheckpointError(f"{file}: truncated, corrupt, or not a checkpoint")
    try:
        with safe_open(str(file), framework="pt") as f:
            meta = f.metadata() or {}
            tensors = {name: f.get_tensor(name) for name in f.keys()}  # noqa: SIM118
    except (SafetensorError, OSError, ValueError) as err:
        raise CheckpointError(f"{file}: truncated or corrupt safetensors file ({err})") from None
    if "mixprec" not in meta:  # plain weights, e.g. from export_weights or another library
        aliases = json.loads(meta["aliases"]) if "aliases" in meta else {}
        return {f"model/{k}": v for k, v in tensors.items()}, {"aliases": aliases}
    try:
        header = json.loads(meta["mixprec"])
    except json.JSONDecodeError as err:
        raise CheckpointError(f"{file}: corrupt mixprec header ({err})") from None
    if header.get("format") != FORMAT or not isinstance(header.get("format_version"), int):
        raise CheckpointError(f"{file}: not a {FORMAT} header")
    if header["format_version"] > FORMAT_VERSION:
        raise CheckpointError(
            f"{file}: format version {header['format_version']} is newer than this mixprec "
            f"reads ({FORMAT_VERSION}); upgrade mixprec"
        )
    if _checksum(tensors) != header.get("checksum"):
        raise CheckpointError(f"{file}: checksum mismatch: the tensors were modified or damaged")
    return tensors, header


def _convert(
    name: str, value: torch.Tensor, target: torch.Tensor, on_range: OnRange, report: LoadReport
) -> torch.Tensor:
    if not (value.is_floating_point() and target.is_floating_point()):
        return value
    if value.dtype == target.dtype:
        return value
    report.converted.append((name, dtype_name(value.dtype), dtype_name(target.dtype)))
    if target.dtype in HALF_DTYPES and value.numel():
        limit = float(torch.finfo(target.dtype).max)
        finite = value[torch.isfinite(value)]
        peak = float(finite.abs().max()) if finite.numel() else 0.0
        if peak > limit:
            report.out_of_range.append((name, peak, dtype_name(target.dtype), on_range))
            if on_range == "error":
                raise CheckpointError(
                    f"{report.path}: tensor {name!r} has max |value| {peak:.6g}, beyond "
                    f"{dtype_name(target.dtype)}'s {limit:.6g}; pass on_range='clamp' to "
                    "saturate or 'ignore' to cast as is (values become inf)"
                )
            if on_range == "clamp":
                value = value.clamp(-limit, limit)
    return value.to(target.dtype)


def load_checkpoint(
    path: str | os.PathLike[str],
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    strict: bool = True,
    on_range: OnRange = "error",
    restore_rng: bool = False,
) -> LoadReport:
    """Load ``path`` into ``model`` (and ``optimizer``), casting each tensor to the dtype of
    its destination. Returns a ``LoadReport``; with ``strict=True`` missing, unexpected and
    mismatched keys raise one ``CheckpointError`` listing them all."""
    if on_range not in ("error", "clamp", "ignore"):
        raise ValueError(f"on_range={on_range!r} is invalid; valid: 'error', 'clamp', 'ignore'")
    tensors, header = read_checkpoint(path)
    described = ("policy", "level", "float8", "mixprec_version", "torch_version", "format_version")
    report = LoadReport(
        path=str(path), metadata={k: v for k, v in header.items() if k in described}
    )
    saved = {k.removeprefix("model/"): v for k, v in tensors.items() if k.startswith("model/")}
    for key, canonical in header.get("aliases", {}).items():
        saved[key] = saved[canonical]
    current = model.state_dict()
    report.missing = [k for k in current if k not in saved]
    report.unexpected = [k for k in saved if k not in current]
    report.mismatched = [
        (k, tuple(saved[k].shape), tuple(current[k].shape))
        for k in current
        if k in saved and saved[k].shape != current[k].shape
    ]
    if strict and (report.missing or report.unexpected or report.mismatched):
        details = "\n".join(report.mismatch_lines())
        raise CheckpointError(
            f"{path}: does not match the model (strict=False loads what matches)\n{details}"
        )
    skip = {k for k, _, _ in report.mismatched}
    loaded = {
        k: _convert(k, saved[k], current[k], on_range, report)
        for k in current
        if k in saved and k not in skip
    }
    model.load_state_dict(loaded, strict=False)
    _keep_float32_values(model, saved)

    if optimizer is not None:
        _load_optimizer(path, optimizer, model, saved, tensors, header)
    if restore_rng and header.get("rng") is not None:
        _set_rng_state(_unflatten(header["rng"], tensors))
    report.trainer_state = _unflatten(header.get("trainer_state", {"__dict__": []}), tensors)
    return report


def _keep_float32_values(model: nn.Module, saved: dict[str, torch.Tensor]) -> None:
    """16-bit parameters remember the float32 values they were loaded from, so a
    ``LossScaleOptimizer`` built afterwards starts its masters from those, not rounded ones."""
    for name, param in model.named_parameters():
        value = saved.get(name)
        if value is not None and param.dtype in HALF_DTYPES and value.dtype == torch.float32:
            remember_float32(param, value)


def _load_optimizer(
    path: str | os.PathLike[str],
    optimizer: torch.optim.Optimizer,
    model: nn.Module,
    saved: dict[str, torch.Tensor],
    tensors: dict[str, torch.Tensor],
    header: dict[str, Any],
) -> None:
    if header.get("optimizer") is None:
        raise CheckpointError(f"{path}: holds no optimizer state")
    state = _unflatten(header["optimizer"], tensors)
    if isinstance(optimizer, LossScaleOptimizer):
        if "optimizers" not in state:
            kind = header.get("optimizer_kind")
            raise CheckpointError(
                f"{path}: the optimizer state of a LossScaleOptimizer has no 'optimizers' "
                "entry (a damaged or hand-edited header)"
                if kind == "LossScaleOptimizer"
                else f"{path}: optimizer state is from a {kind}, not a LossScaleOptimizer"
            )
        names = _parameter_names(model)
        masters = []
        for param, _ in optimizer.master_weights():
            found = [n for n in names.get(id(param), []) if n in saved]
            if not found:
                wanted = ", ".join(names.get(id(param), [])) or f"a {tuple(param.shape)} weight"
                raise CheckpointError(f"{path}: no saved weight for the master of {wanted}")
            masters.append(saved[found[0]].float())
        state["master_weights"] = masters
    try:
        optimizer.load_state_dict(state)
    except (ValueError, KeyError, RuntimeError) as err:
        raise CheckpointError(
            f"{path}: optimizer state does not fit this optimizer: {err}"
        ) from err


def _write_weights(
    weights: dict[str, torch.Tensor],
    dtype: str | torch.dtype,
    on_range: OnRange,
    aliases: dict[str, str],
    source: str,
    path: str | os.PathLike[str],
) -> LoadReport:
    """Cast ``weights`` to ``dtype`` (range-checked) and write them as plain safetensors."""
    target = parse_dtype(dtype, argument="dtype")
    report = LoadReport(path=source)
    probe = torch.empty(0, dtype=target)
    out = {name: _convert(name, value, probe, on_range, report) for name, value in weights.items()}
    meta = {"written_by": f"mixprec {_version()}", "dtype": dtype_name(target)}
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
    Raises ``CheckpointError`` if a value does not fit ``dtype``."""
    tensors, aliases, _ = _model_tensors(model, optimizer)
    weights = {k.removeprefix("model/"): v for k, v in tensors.items()}
    _write_weights(weights, dtype, "error", aliases, type(model).__name__, path)
    return Path(path)


def convert_checkpoint(
    source: str | os.PathLike[str],
    destination: str | os.PathLike[str],
    dtype: str | torch.dtype = torch.float32,
    on_range: OnRange = "error",
) -> LoadReport:
    """Rewrite the model weights of any readable checkpoint (mixprec, safetensors, a
    ``torch.save`` state dict) as a plain safetensors file in ``dtype``."""
    if on_range not in ("error", "clamp", "ignore"):
        raise ValueError(f"on_range={on_range!r} is invalid; valid: 'error', 'clamp', 'ignore'")
    tensors, header = read_checkpoint(source)
    weights = {k.removeprefix("model/"): v for k, v in tensors.items() if k.startswith("model/")}
    return _write_weights(
        weights, dtype, on_range, header.get("aliases", {}), str(source), destination
    )
