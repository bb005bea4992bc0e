"""Checkpoints: safetensors tensors plus a JSON header, written atomically, loaded with
dtype conversion, never executing code from the file.

One ``.safetensors`` file holds every tensor (model weights, optimizer state, RNG states)
and, under the metadata key ``"mixprec"``, a JSON document: format version, mixprec and
torch versions, policy and level (with a float8 policy's recipe and converted layers), the
non-tensor parts of the optimizer and trainer state, and a SHA-256 checksum of the header's
other keys and the tensors (format 1 files, whose checksum covers the tensors only, are
still read). Weights that have float32 masters are stored as the masters: float32 is the
source of truth, and a 16-bit model gets them rounded on load.

A file is treated as hostile until checked: only a regular file is opened; the safetensors
framing (dtypes, shapes, offsets covering the data exactly, entry count against the data's
bytes, data against free memory) and the mixprec header (an explicit schema) are checked
before a tensor is read or hashed; and ``load_checkpoint`` checks everything it will load
(dtypes, non-finite values, ranges, optimizer, scaler and RNG states) before it changes the
model, so that a load either happens in full or not at all.
"""

from __future__ import annotations

import copy
import hashlib
import itertools
import json
import math
import os
import random
import stat
import tempfile
from collections import defaultdict
from collections.abc import Callable, Container, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO, Literal

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file
from torch import nn

from mixprec._dtypes import HALF_DTYPES, dtype_name, parse_dtype
from mixprec._errors import shown
from mixprec._version import __version__
from mixprec.casting import remember_float32
from mixprec.float8 import summary as float8_summary
from mixprec.levels import applied
from mixprec.optim import LossScaleOptimizer

FORMAT = "mixprec-checkpoint"
#: 2: the checksum covers the header and the tensors; 1: the tensors only (still read).
FORMAT_VERSION = 2
OnRange = Literal["error", "clamp", "ignore"]

#: safetensors' own limit on its JSON header; a longer one is refused before it is read.
_MAX_HEADER_BYTES = 100_000_000
#: Tensor entries a file may hold beyond one per byte of tensor data. Reading and hashing
#: cost time and memory per entry whatever its size, so empty entries must not come free
#: (1.2 M of them exhausted memory before any check); models have a handful at most.
_FREE_ENTRIES = 1024
#: Nesting allowed in a header value; save_checkpoint writes fewer than ten levels.
_MAX_DEPTH = 64
#: Counters and dimensions: torch's int64 sizes, itertools' indices.
_MAX_INT = 2**63 - 1

_FLOATS = frozenset({torch.float16, torch.bfloat16, torch.float32, torch.float64})
_INTS = frozenset({torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64})
_FLOAT8_NAMES = ("float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz")
_FLOAT8 = frozenset(
    getattr(torch, n) for n in (*_FLOAT8_NAMES, "float8_e8m0fnu") if hasattr(torch, n)
)
#: safetensors dtype names mixprec reads (the sub-byte F4/F6 types have no torch dtype).
_SAFETENSORS_DTYPES: dict[str, torch.dtype] = {
    name: getattr(torch, attr)
    for name, attr in {
        "BOOL": "bool", "U8": "uint8", "I8": "int8", "I16": "int16", "U16": "uint16",
        "I32": "int32", "U32": "uint32", "I64": "int64", "U64": "uint64", "F16": "float16",
        "BF16": "bfloat16", "F32": "float32", "F64": "float64", "C64": "complex64",
        "F8_E4M3": "float8_e4m3fn", "F8_E5M2": "float8_e5m2", "F8_E8M0": "float8_e8m0fnu",
    }.items()
    if hasattr(torch, attr)
}  # fmt: skip

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
    """What ``load_checkpoint`` did: tensors cast to another dtype, values out of a 16-bit
    range and what ``on_range`` did with them, NaN/inf counts loaded under
    ``on_range="ignore"``, key mismatches, the header's metadata and the trainer state."""

    path: str
    converted: list[tuple[str, str, str]] = field(default_factory=list)  # name, from, to
    out_of_range: list[tuple[str, float, str, str]] = field(default_factory=list)
    non_finite: list[tuple[str, int, int]] = field(default_factory=list)  # name, NaN, inf
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
        for name, nan, inf in self.non_finite:
            lines.append(f"  {name}: {nan} NaN, {inf} inf (loaded as they are)")
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


def _checksum(tensors: Mapping[str, torch.Tensor], header: dict[str, Any] | None = None) -> str:
    """SHA-256 of ``header`` (all keys but ``"checksum"``, as canonical JSON; format 2) and
    of each tensor's name, dtype, shape and bytes. Format 1 checksums pass no header."""
    digest = hashlib.sha256()
    if header is not None:
        body = {k: v for k, v in header.items() if k != "checksum"}
        digest.update(json.dumps(body, sort_keys=True, separators=(",", ":")).encode())
        digest.update(b"\n")
    for name in sorted(tensors):
        t = tensors[name].contiguous()
        digest.update(f"{name}|{t.dtype}|{tuple(t.shape)}|".encode())
        if t.numel():
            digest.update(t.reshape(-1).view(torch.uint8).numpy().data)  # no copy
    return digest.hexdigest()


def _rng_state() -> dict[str, Any]:
    state: dict[str, Any] = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def _cuda_states(state: dict[str, Any]) -> list[torch.Tensor]:
    """The saved CUDA generator states for the devices present: a run resumed on fewer
    GPUs restores the first ones; devices beyond those saved keep their state."""
    if "cuda" not in state or not torch.cuda.is_available():
        return []
    return list(state["cuda"])[: torch.cuda.device_count()]


def _check_rng_state(path: str | os.PathLike[str], state: dict[str, Any]) -> None:
    """Set ``state`` on fresh generators: what ``_set_rng_state`` would refuse is refused
    here, before the model changes, and no generator of the process is touched."""
    try:
        torch.Generator().set_state(state["torch"])
        version, internal, gauss = state["python"]
        random.Random().setstate((version, tuple(internal), gauss))
        for i, saved in enumerate(_cuda_states(state)):
            if saved.numel() != torch.cuda.get_rng_state(i).numel():
                raise ValueError(f"CUDA state {i} has {saved.numel()} bytes")
    except (RuntimeError, ValueError, TypeError, OverflowError) as err:
        raise CheckpointError(
            f"{path}: its RNG state cannot be restored ({err}); restore_rng=False loads the rest"
        ) from None


def _set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    for i, saved in enumerate(_cuda_states(state)):
        torch.cuda.set_rng_state(saved, i)


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
        value = _unwrapped(masters.get(key, value))
        storage = value.untyped_storage().data_ptr()
        ident = (storage, int(value.storage_offset()), tuple(value.shape), value.dtype)
        if value.numel() and ident in seen:
            aliases[key] = seen[ident]
            continue
        seen[ident] = key
        tensors[f"model/{key}"] = value.detach().cpu().contiguous()
    return tensors, aliases, sorted(masters)


def _unwrapped(value: torch.Tensor) -> torch.Tensor:
    """The plain tensor inside a wrapper subclass that holds one as ``_tensor`` (torchao's
    float8 all-gather weights): the wrapper has no storage of its own."""
    while type(value) is not torch.Tensor and isinstance(
        getattr(value, "_tensor", None), torch.Tensor
    ):
        value = value._tensor  # type: ignore[attr-defined]
    return value


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
    epoch, data order...) and RNG states to ``path`` atomically. Returns the path.

    ``trainer_state``'s ``global_step``, ``epoch`` and ``step_in_epoch``, where present, must
    be ints >= 0 and ``epoch_rng`` a uint8 tensor (the Trainer's resume state): a
    ``ValueError`` here, rather than a checkpoint that ``load_checkpoint`` refuses."""
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
    # The header as a reader parses it back: what load_checkpoint checks and the checksum
    # covers.
    parsed = json.loads(json.dumps(header))
    # What load_checkpoint will refuse is refused here, before anything is written.
    entries = {n: (t.dtype, tuple(t.shape), 0, 0) for n, t in tensors.items()}
    try:
        _check_trainer_state(parsed["trainer_state"], "trainer_state", entries)
    except _BadValueError as err:
        raise ValueError(f"save_checkpoint: {err}") from None
    parsed["checksum"] = _checksum(tensors, parsed)
    _atomic_write(tensors, {"mixprec": json.dumps(parsed)}, target)
    return target


def _version() -> str:
    return __version__


# -- validation of what a file declares, before anything is read from it -----------------


class _BadValueError(Exception):
    """A header value of the wrong type or range: its key, the value, and what is valid."""

    def __init__(self, key: str, value: Any, valid: str) -> None:
        super().__init__(key, value, valid)
        self.key, self.value, self.valid = key, value, valid

    def __str__(self) -> str:
        return f"{_cut(self.key)!r} is {shown(self.value)}; valid: {self.valid}"


def _cut(text: str, limit: int = 80) -> str:
    """``text`` with its middle cut out if it is longer than ``limit``."""
    return text if len(text) <= limit else f"{text[: limit // 2]}...{text[-(limit // 2 - 3) :]}"


def _is_count(value: Any) -> bool:
    return type(value) is int and 0 <= value <= _MAX_INT  # bool is an int: refused


class _TooManyError(Exception):
    """Raised from inside the JSON parser once a header holds more objects than allowed."""


def _counting(limit: int) -> Callable[[list[tuple[str, Any]]], dict[str, Any]]:
    """A json ``object_pairs_hook`` that raises ``_TooManyError`` at object ``limit + 1``."""
    seen = itertools.count(1)

    def hook(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
        if next(seen) > limit:
            raise _TooManyError
        return dict(pairs)

    return hook


def _json(raw: str | bytes, file: Path, what: str, objects: int | None = None) -> Any:
    """Parse ``raw``; with ``objects``, stop as soon as it holds more JSON objects."""
    try:
        return json.loads(raw, object_pairs_hook=None if objects is None else _counting(objects))
    except RecursionError:
        raise CheckpointError(f"{file}: corrupt {what} (JSON nested too deeply)") from None
    except ValueError as err:  # JSONDecodeError, bad UTF-8, an int of > 4300 digits
        raise CheckpointError(f"{file}: corrupt {what} ({err})") from None


def _open_regular(file: Path) -> tuple[BinaryIO, int]:
    """``file`` opened for reading, and its size. Only a regular file is opened: a device,
    pipe or socket could block, never end or have effects on open; a file that reads as
    empty (procfs's ``/proc/self/mem``) is refused before it is read."""
    try:
        before = os.stat(file)
    except FileNotFoundError:
        raise CheckpointError(f"{file}: no such checkpoint file") from None
    except OSError as err:
        raise CheckpointError(f"{file}: cannot be read ({err.strerror})") from None
    if not stat.S_ISREG(before.st_mode):
        raise CheckpointError(f"{file}: not a regular file (a device, pipe or socket); refused")
    try:
        # O_NONBLOCK: should it have become a pipe since the stat, the open returns at once.
        fd = os.open(file, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_BINARY", 0))
    except OSError as err:
        raise CheckpointError(f"{file}: cannot be read ({err.strerror})") from None
    handle = os.fdopen(fd, "rb")
    now = os.fstat(handle.fileno())
    if (now.st_dev, now.st_ino) != (before.st_dev, before.st_ino) or not stat.S_ISREG(now.st_mode):
        handle.close()
        raise CheckpointError(f"{file}: replaced while being opened; refused")
    if now.st_size == 0:
        handle.close()
        raise CheckpointError(f"{file}: empty (0 bytes): not a checkpoint")
    return handle, now.st_size


def _available_memory() -> int | None:
    """Bytes this process could still fill: the kernel's MemAvailable plus free swap; None
    where unknown. A container's limit can be lower, but its page cache makes any estimate
    of it too low, and a too-low estimate would refuse a checkpoint that fits."""
    try:
        lines = Path("/proc/meminfo").read_text().splitlines()
    except OSError:
        return None
    kib = {}
    for line in lines:
        key, _, rest = line.partition(":")
        value = rest.split()
        if value and value[0].isdigit():
            kib[key] = int(value[0])
    if "MemAvailable" not in kib:
        return None
    return (kib["MemAvailable"] + kib.get("SwapFree", 0)) * 1024


_Entry = tuple[torch.dtype, tuple[int, ...], int, int]  # dtype, shape, begin, end


def _fits_int64(shape: list[int]) -> bool:
    """Whether the product of the dimensions, zeros counted as 1, fits in an int64: torch
    multiplies them all (strides, numel) even beside a 0. Stops as soon as it does not,
    so that a long list of huge dimensions costs no big-int arithmetic."""
    extent = 1
    for d in shape:
        extent *= max(d, 1)
        if extent > _MAX_INT:
            return False
    return True


def _entry(file: Path, name: str, value: Any) -> _Entry:
    """One safetensors header entry, checked: a dtype mixprec reads, a shape torch can
    hold, and offsets that span exactly the shape's bytes."""
    if not (isinstance(value, dict) and {"dtype", "shape", "data_offsets"} <= set(value)):
        raise CheckpointError(
            f"{file}: corrupt safetensors entry {shown(name)}: {shown(value)}; valid: an "
            "object with dtype, shape and data_offsets"
        )
    dtype = _SAFETENSORS_DTYPES.get(value["dtype"]) if isinstance(value["dtype"], str) else None
    if dtype is None:
        raise CheckpointError(
            f"{file}: tensor {shown(name)} has dtype {shown(value['dtype'])}; valid: "
            f"{', '.join(_SAFETENSORS_DTYPES)}"
        )
    shape, offsets = value["shape"], value["data_offsets"]
    if not (isinstance(shape, list) and all(_is_count(d) for d in shape) and _fits_int64(shape)):
        raise CheckpointError(
            f"{file}: tensor {shown(name)} has shape {shown(shape)}; valid: a list of ints "
            ">= 0 whose product is at most 2**63 - 1"
        )
    numel = math.prod(shape)
    if not (
        isinstance(offsets, list)
        and len(offsets) == 2
        and all(_is_count(o) for o in offsets)
        and offsets[1] - offsets[0] == numel * dtype.itemsize
    ):
        raise CheckpointError(
            f"{file}: truncated or corrupt: tensor {shown(name)} has data_offsets "
            f"{shown(offsets)}; valid: [begin, begin + {numel * dtype.itemsize}] for its "
            f"{numel} {dtype_name(dtype)} values"
        )
    return dtype, tuple(shape), offsets[0], offsets[1]


def _safetensors_header(
    handle: BinaryIO, file: Path, size: int
) -> tuple[dict[str, _Entry], dict[str, str]]:
    """The entries and metadata of a safetensors file, checked against the file before any
    tensor is read: the work that follows is bounded by the file's bytes."""
    length = int.from_bytes(handle.read(8), "little")
    if length > _MAX_HEADER_BYTES:
        raise CheckpointError(
            f"{file}: a safetensors header of {length} bytes; at most {_MAX_HEADER_BYTES} are read"
        )
    data = size - 8 - length
    # Each entry is one JSON object, and so are the header and its __metadata__: the parse
    # stops as soon as the entries outnumber what the data's bytes allow.
    limit = _FREE_ENTRIES + data
    too_many = CheckpointError(
        f"{file}: more than {limit} tensor entries for {data} bytes of tensor data; "
        f"refused before reading them (at most {_FREE_ENTRIES} plus one per byte)"
    )
    try:
        parsed = _json(handle.read(length), file, "safetensors header", objects=limit + 2)
    except _TooManyError:
        raise too_many from None
    if not isinstance(parsed, dict):
        raise CheckpointError(f"{file}: corrupt safetensors header (not a JSON object)")
    meta = parsed.pop("__metadata__", None)
    meta = {} if meta is None else meta
    if not (isinstance(meta, dict) and all(isinstance(v, str) for v in meta.values())):
        raise CheckpointError(
            f"{file}: corrupt safetensors header: __metadata__ is {shown(meta)}; valid: an "
            "object of strings"
        )
    if len(parsed) > limit:
        raise too_many
    entries = {name: _entry(file, name, value) for name, value in parsed.items()}
    # The data must be the tensors' bytes, back to back, and nothing else: a header whose
    # offsets run past the end, leave holes or end early (a sparse 64 GiB tail) is refused
    # here, before safetensors maps the file.
    position = 0
    for begin, end, name in sorted((b, e, n) for n, (_, _, b, e) in entries.items()):
        if begin != position:
            raise CheckpointError(
                f"{file}: truncated or corrupt: tensor {shown(name)} starts at byte {begin} "
                f"of the data, not {position}"
            )
        position = end
    if position != data:
        raise CheckpointError(
            f"{file}: truncated or corrupt: the tensors end at byte {position} of the data, "
            f"the file at byte {data}"
        )
    available = _available_memory()
    if available is not None and data > available:
        raise CheckpointError(
            f"{file}: its tensors hold {data / 2**30:.1f} GiB, more than the "
            f"{available / 2**30:.1f} GiB of memory available; refused before reading"
        )
    return entries, meta


# -- the mixprec header's schema -----------------------------------------------------------

_SKELETON = (
    "null, a bool, number or string, a list, or an object with one key: __tensor__ (a "
    "stored tensor's name), __tuple__ or __dict__ (a list of [key, value] pairs), __float__"
)
_RNG = (
    "null or {'__dict__': [['torch', <uint8 tensor>], ['python', {'__tuple__': [version, "
    "[ints], gauss]}], optionally ['cuda', [<uint8 tensor>, ...]]]}"
)
#: Keys of ``Trainer.resume_state()`` that ``fit(resume_from=)`` reads as counters.
_TRAINER_COUNTERS = ("global_step", "epoch", "step_in_epoch")


def _check_skeleton(node: Any, key: str, entries: Mapping[str, _Entry], depth: int = 0) -> None:
    """``node`` is what ``_flatten`` writes: ``_unflatten`` rebuilds it without error."""
    if depth > _MAX_DEPTH:
        raise _BadValueError(key, node, f"at most {_MAX_DEPTH} levels of nesting")
    if node is None or isinstance(node, (bool, int, float, str)):
        return
    if isinstance(node, list):
        for i, item in enumerate(node):
            _check_skeleton(item, f"{key}/{i}", entries, depth + 1)
        return
    if isinstance(node, dict) and len(node) == 1:
        tag, inner = next(iter(node.items()))
        if tag == "__tensor__" and isinstance(inner, str) and inner in entries:
            return
        if tag == "__float__" and inner in ("nan", "inf", "-inf"):
            return
        if tag == "__tuple__" and isinstance(inner, list):
            for i, item in enumerate(inner):
                _check_skeleton(item, f"{key}/{i}", entries, depth + 1)
            return
        if tag == "__dict__" and isinstance(inner, list):
            for pair in inner:
                if not (
                    isinstance(pair, list)
                    and len(pair) == 2
                    and (pair[0] is None or isinstance(pair[0], (bool, int, float, str)))
                ):
                    raise _BadValueError(key, pair, "a [key, value] pair with a scalar key")
                _check_skeleton(pair[1], f"{key}/{pair[0]}", entries, depth + 1)
            return
    raise _BadValueError(key, node, _SKELETON)


def _pairs(node: Any) -> dict[Any, Any] | None:
    """The items of a checked ``{"__dict__": [...]}`` node, or None for any other node."""
    if isinstance(node, dict) and set(node) == {"__dict__"}:
        return dict(node["__dict__"])
    return None


def _is_rng_tensor(node: Any, entries: Mapping[str, _Entry]) -> bool:
    """A reference to a 1-D uint8 tensor, the form of every torch generator state."""
    name = node.get("__tensor__") if isinstance(node, dict) and len(node) == 1 else None
    if not (isinstance(name, str) and name in entries):
        return False
    dtype, shape, _, _ = entries[name]
    return dtype == torch.uint8 and len(shape) == 1


def _check_rng(value: Any, key: str, entries: Mapping[str, _Entry]) -> None:
    if value is None:
        return
    _check_skeleton(value, key, entries)
    parts = _pairs(value)
    if parts is None or not {"torch", "python"} <= set(parts) <= {"torch", "python", "cuda"}:
        raise _BadValueError(key, value, _RNG)
    if not _is_rng_tensor(parts["torch"], entries):
        raise _BadValueError(f"{key}/torch", parts["torch"], "a uint8 tensor (a torch RNG state)")
    python = parts["python"]  # random.getstate(): (version, (625 ints), gauss or None)
    items = python.get("__tuple__") if isinstance(python, dict) else None
    version, internal, gauss = items if isinstance(items, list) and len(items) == 3 else [None] * 3
    internal = internal.get("__tuple__") if isinstance(internal, dict) else internal
    if not (
        type(version) is int
        and isinstance(internal, list)
        and all(type(v) is int for v in internal)
        and (gauss is None or isinstance(gauss, (float, dict)))
    ):
        raise _BadValueError(
            f"{key}/python", python, "random.getstate(): (version, (ints...), gauss)"
        )
    cuda = parts.get("cuda", [])
    cuda = cuda.get("__tuple__") if isinstance(cuda, dict) else cuda
    if not (isinstance(cuda, list) and all(_is_rng_tensor(s, entries) for s in cuda)):
        raise _BadValueError(f"{key}/cuda", parts["cuda"], "a list of uint8 tensors")


def _check_trainer_state(value: Any, key: str, entries: Mapping[str, _Entry]) -> None:
    _check_skeleton(value, key, entries)
    parts = _pairs(value)
    if parts is None:
        raise _BadValueError(key, value, "{'__dict__': [[key, value], ...]} (a dict)")
    for name in _TRAINER_COUNTERS:
        if name in parts and not _is_count(parts[name]):
            raise _BadValueError(f"{key}/{name}", parts[name], "an int from 0 to 2**63 - 1")
    if parts.get("epoch_rng") is not None and not _is_rng_tensor(parts["epoch_rng"], entries):
        raise _BadValueError(f"{key}/epoch_rng", parts["epoch_rng"], "null or a uint8 tensor")


def _check_aliases(value: Any, key: str, stored: Container[str]) -> None:
    if not isinstance(value, dict):
        raise _BadValueError(key, value, "an object mapping a state-dict key to a stored one")
    for alias, canonical in value.items():
        if not (isinstance(canonical, str) and f"model/{canonical}" in stored):
            raise _BadValueError(f"{key}/{alias}", canonical, "the name of a stored model tensor")


def _check_names(value: Any, key: str) -> None:
    if not (isinstance(value, list) and all(isinstance(v, str) for v in value)):
        raise _BadValueError(key, value, "a list of strings")


def _check_text(value: Any, key: str, null: bool = True) -> None:
    if not (isinstance(value, str) or (null and value is None)):
        raise _BadValueError(key, value, "a string or null" if null else "a string")


def _check_float8(value: Any, key: str) -> None:
    if value is None:
        return
    if not (isinstance(value, dict) and set(value) == {"recipe", "converted"}):
        raise _BadValueError(key, value, "null or {'recipe': str, 'converted': [layer names]}")
    _check_text(value["recipe"], f"{key}/recipe", null=False)
    _check_names(value["converted"], f"{key}/converted")


def _check_checksum(value: Any, key: str) -> None:
    if not (isinstance(value, str) and len(value) == 64 and set(value) <= set("0123456789abcdef")):
        raise _BadValueError(key, value, "a SHA-256 digest: 64 lowercase hex digits")


def _check_header(header: dict[str, Any], entries: Mapping[str, _Entry]) -> None:
    """``header`` against the schema of what ``save_checkpoint`` writes (``format`` and
    ``format_version`` are checked by the caller). Raises ``_BadValueError``."""
    checks = {
        "format": lambda v, k: None,
        "format_version": lambda v, k: None,
        "mixprec_version": lambda v, k: _check_text(v, k, null=False),
        "torch_version": lambda v, k: _check_text(v, k, null=False),
        "policy": _check_text,
        "level": _check_text,
        "float8": _check_float8,
        "aliases": lambda v, k: _check_aliases(v, k, entries),
        "masters": _check_names,
        "optimizer": lambda v, k: _check_skeleton(v, k, entries),
        "optimizer_kind": _check_text,
        "trainer_state": lambda v, k: _check_trainer_state(v, k, entries),
        "rng": lambda v, k: _check_rng(v, k, entries),
        "checksum": _check_checksum,
    }
    for key, value in header.items():
        if key not in checks:
            raise _BadValueError(key, value, f"only the keys mixprec writes: {', '.join(checks)}")
        checks[key](value, key)
    if "checksum" not in header:
        raise _BadValueError("checksum", None, "a SHA-256 digest: 64 lowercase hex digits")


def _mixprec_header(file: Path, text: str, entries: Mapping[str, _Entry]) -> dict[str, Any]:
    header = _json(text, file, "mixprec header")
    if not isinstance(header, dict) or header.get("format") != FORMAT:
        raise CheckpointError(f"{file}: not a {FORMAT} header")
    version = header.get("format_version")
    if type(version) is not int or version < 1:
        raise CheckpointError(
            f"{file}: mixprec header: 'format_version' is {shown(version)}; valid: an int "
            f"from 1 to {FORMAT_VERSION}"
        )
    if version > FORMAT_VERSION:
        raise CheckpointError(
            f"{file}: format version {version} is newer than this mixprec reads "
            f"({FORMAT_VERSION}); upgrade mixprec"
        )
    try:
        _check_header(header, entries)
    except _BadValueError as bad:
        raise CheckpointError(f"{file}: mixprec header: {bad}") from None
    return header


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


def _read_tensors(file: Path, entries: Mapping[str, _Entry]) -> dict[str, torch.Tensor]:
    try:
        with safe_open(str(file), framework="pt") as f:
            same = set(f.keys()) == set(entries)
            tensors = {name: f.get_tensor(name) for name in entries} if same else {}
    except (SafetensorError, OSError, ValueError, RuntimeError, MemoryError) as err:
        raise CheckpointError(f"{file}: truncated or corrupt safetensors file ({err})") from None
    if not same:
        raise CheckpointError(f"{file}: changed while being read")
    return tensors


def read_checkpoint(path: str | os.PathLike[str]) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """``(tensors, header)`` of a mixprec checkpoint, a plain ``.safetensors`` file or a
    ``torch.save`` state dict (model tensors are named ``model/<key>``).

    Before a tensor is read: the file must be a regular file; the safetensors framing
    (dtypes, shapes, offsets, the entry count against the data's bytes, the data against
    free memory) and the mixprec header (its schema, its format version) are checked. Then
    the checksum (header and tensors; tensors only for format 1). Any problem is a
    ``CheckpointError``."""
    file = Path(path)
    if file.is_dir():
        found = sorted(p.name for p in file.glob("*.safetensors"))
        hint = f" (it holds {', '.join(found[:4])})" if found else ""
        raise CheckpointError(f"{str(file)!r} is a directory, not a checkpoint file{hint}")
    handle, size = _open_regular(file)
    with handle:
        try:
            head = handle.read(9)
            # safetensors: an 8-byte little-endian header length, then the JSON header. Test
            # for it first: its length's first byte can be 0x80, a pickle's first byte.
            header_end = 8 + int.from_bytes(head[:8], "little") if len(head) == 9 else -1
            if not (head[8:9] == b"{" and header_end <= size):
                if head[:4] == b"PK\x03\x04" or head[:1] == b"\x80":
                    return _read_torch_file(file), {}
                raise CheckpointError(f"{file}: truncated, corrupt, or not a checkpoint")
            handle.seek(0)
            entries, meta = _safetensors_header(handle, file, size)
        except OSError as err:
            raise CheckpointError(f"{file}: cannot be read ({err.strerror})") from None
    if "mixprec" not in meta:  # plain weights, e.g. from export_weights or another library
        aliases = _json(meta["aliases"], file, "aliases metadata") if "aliases" in meta else {}
        try:
            _check_aliases(aliases, "aliases", {f"model/{k}" for k in entries})
        except _BadValueError as bad:
            raise CheckpointError(f"{file}: metadata {bad}") from None
        tensors = _read_tensors(file, entries)
        return {f"model/{k}": v for k, v in tensors.items()}, {"aliases": aliases}
    header = _mixprec_header(file, meta["mixprec"], entries)
    tensors = _read_tensors(file, entries)
    covered = header if header["format_version"] >= 2 else None
    if _checksum(tensors, covered) != header["checksum"]:
        what = "header or tensors" if covered is not None else "tensors"
        raise CheckpointError(f"{file}: checksum mismatch: the {what} were modified or damaged")
    return tensors, header


# -- loading -------------------------------------------------------------------------------


def _refusal(saved: torch.dtype, target: torch.dtype) -> str | None:
    """Why a ``saved`` tensor does not convert meaningfully to ``target``, or None."""
    if saved == target:
        return None
    if target in _FLOATS:
        if saved in _FLOATS:
            return None
    elif target in _INTS:
        if saved in _INTS:
            return None  # range-checked in _convert
    elif target.is_complex and (saved.is_complex or saved in _FLOATS):
        return None
    if saved in _FLOAT8:
        return "float8 values mean something only with the scales stored beside them"
    if target in _FLOAT8:
        return "a float8 destination needs scales; mixprec does not quantize"
    if saved.is_complex:
        return "the imaginary parts would be dropped"
    if saved == torch.bool:
        return "booleans are flags, not values"
    if target.is_floating_point:
        return "integers in a floating-point parameter are quantized or foreign data"
    if saved.is_floating_point:
        return "the fractions would be cut off"
    return "the values would be reinterpreted"


def _count_non_finite(name: str, value: torch.Tensor, report: LoadReport) -> bool:
    """Whether every value is finite; if not, the counts go into ``report.non_finite``."""
    if not (value.is_floating_point() or value.is_complex()) or not value.numel():
        return True
    wide = value.float() if value.dtype in _FLOAT8 else value  # no isfinite for float8
    finite = torch.isfinite(wide)
    if bool(finite.all()):
        return True
    bad, nan = int((~finite).sum()), int(torch.isnan(wide).sum())
    report.non_finite.append((name, nan, bad - nan))
    return False


def _raise_non_finite(report: LoadReport, on_range: OnRange) -> None:
    """NaN and inf are refused under 'error' and under 'clamp' (no finite value can stand
    in for a NaN, and an inf master means training diverged: saturating would hide it);
    'ignore' loads them as they are, listed in ``report.non_finite``."""
    if not report.non_finite or on_range == "ignore":
        return
    listed = [f"{name!r} ({nan} NaN, {inf} inf)" for name, nan, inf in report.non_finite]
    more = f" and {len(listed) - 8} more" if len(listed) > 8 else ""
    raise CheckpointError(
        f"{report.path}: non-finite values in {len(listed)} tensor(s): "
        f"{', '.join(listed[:8])}{more}; a model or optimizer loaded with them skips every "
        "step. on_range='ignore' loads them as they are"
    )


def _convert(
    name: str,
    value: torch.Tensor,
    target: torch.dtype,
    on_range: OnRange,
    report: LoadReport,
    check_finite: bool = True,
) -> torch.Tensor:
    """``value`` as ``target``: refused where the dtype does not convert meaningfully;
    non-finite values counted (see ``_raise_non_finite``) unless ``check_finite`` is off
    (buffers: a causal mask of -inf is normal); out-of-range values per ``on_range``."""
    reason = _refusal(value.dtype, target)
    if reason is not None:
        raise CheckpointError(
            f"{report.path}: tensor {name!r} is {dtype_name(value.dtype)} in the checkpoint; it "
            f"does not convert to {dtype_name(target)} ({reason})"
        )
    finite = _count_non_finite(name, value, report) if check_finite else None
    if value.dtype == target:
        return value
    report.converted.append((name, dtype_name(value.dtype), dtype_name(target)))
    if target in _INTS and value.numel():
        low, high, info = int(value.min()), int(value.max()), torch.iinfo(target)
        if low < info.min or high > info.max:
            raise CheckpointError(
                f"{report.path}: tensor {name!r} holds {low}..{high}, beyond "
                f"{dtype_name(target)}'s {info.min}..{info.max}"
            )
    if target in HALF_DTYPES and value.numel():
        limit = float(torch.finfo(target).max)
        if finite:  # known finite: one read, no copy of the finite values
            least, most = torch.aminmax(value)
            peak = max(-float(least), float(most))
        else:
            kept = value[torch.isfinite(value)]
            peak = float(kept.abs().max()) if kept.numel() else 0.0
        if peak > limit:
            report.out_of_range.append((name, peak, dtype_name(target), on_range))
            if on_range == "error":
                raise CheckpointError(
                    f"{report.path}: tensor {name!r} has max |value| {peak:.6g}, beyond "
                    f"{dtype_name(target)}'s {limit:.6g}; pass on_range='clamp' to "
                    "saturate or 'ignore' to cast as is (values become inf)"
                )
            if on_range == "clamp":
                # In float32 for a bfloat16 source: 65504 is no bfloat16 value (it rounds to
                # 65536, float16's inf).
                wide = value.float() if value.dtype == torch.bfloat16 else value
                value = wide.clamp(-limit, limit)
    return value.to(target)


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
    mismatched keys raise one ``CheckpointError`` listing them all.

    All or nothing: everything is checked before the model, the optimizer or the RNGs
    change, and any problem raises ``CheckpointError`` with all three as they were. Refused:
    a tensor whose dtype does not convert meaningfully to its destination's (complex, bool,
    integer or float8 values into a floating-point parameter; float8 values need their
    scales); NaN or inf in a parameter or the optimizer state (buffers are exempt: a mask
    of -inf is normal) (under
    ``on_range="error"`` and ``"clamp"``: no finite value stands in for a NaN; ``"ignore"``
    loads them and lists them in ``LoadReport.non_finite``); a value beyond a 16-bit
    destination's range (``"error"``; ``"clamp"`` saturates it, ``"ignore"`` casts it to
    inf); an optimizer, loss-scaler or (with ``restore_rng``) RNG state that does not load.
    ``trainer_state`` counters (``global_step``, ``epoch``, ``step_in_epoch``) are ints >= 0.
    """
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

    # Check and prepare everything; nothing changes before the commit below.
    skip = {k for k, _, _ in report.mismatched}
    buffers = _buffer_names(model, current)
    loaded = {
        k: _convert(k, saved[k], current[k].dtype, on_range, report, k not in buffers)
        for k in current
        if k in saved and k not in skip
    }
    optim_state: Any = None
    if optimizer is not None:
        if header.get("optimizer") is None:
            raise CheckpointError(f"{path}: holds no optimizer state")
        for name in _tensor_names(header["optimizer"]):
            _count_non_finite(name, tensors[name], report)
    _raise_non_finite(report, on_range)
    if optimizer is not None:
        optim_state = _optimizer_state(path, optimizer, model, saved, tensors, header)
    rng_state = None
    if restore_rng and header.get("rng") is not None:
        rng_state = _unflatten(header["rng"], tensors)
        _check_rng_state(path, rng_state)
    trainer_state = _unflatten(header.get("trainer_state", {"__dict__": []}), tensors)

    # Commit: every value was checked above to fit its destination.
    model.load_state_dict(loaded, strict=False)
    _keep_float32_values(model, saved)
    if optimizer is not None:
        try:
            optimizer.load_state_dict(optim_state)
        except (ValueError, TypeError, KeyError, RuntimeError) as err:
            # Only an optimizer with a load_state_dict of its own gets here (torch's is
            # tried on a stand-in first): its checks cannot run before the model loads.
            raise CheckpointError(
                f"{path}: optimizer state does not fit this optimizer: {err}"
            ) from err
    if rng_state is not None:
        _set_rng_state(rng_state)
    report.trainer_state = trainer_state
    return report


def _tensor_names(node: Any) -> list[str]:
    """The tensors a checked skeleton refers to."""
    if isinstance(node, list):
        return [name for item in node for name in _tensor_names(item)]
    if isinstance(node, dict):
        if "__tensor__" in node:
            return [node["__tensor__"]]
        if "__dict__" in node:
            return [name for _, item in node["__dict__"] for name in _tensor_names(item)]
        return _tensor_names(node.get("__tuple__", []))
    return []


def _keep_float32_values(model: nn.Module, saved: dict[str, torch.Tensor]) -> None:
    """16-bit parameters remember the float32 values they were loaded from, so a
    ``LossScaleOptimizer`` built afterwards starts its masters from those, not rounded ones."""
    for name, param in model.named_parameters():
        value = saved.get(name)
        if value is not None and param.dtype in HALF_DTYPES and value.dtype == torch.float32:
            remember_float32(param, value)


def _optimizer_state(
    path: str | os.PathLike[str],
    optimizer: torch.optim.Optimizer,
    model: nn.Module,
    saved: dict[str, torch.Tensor],
    tensors: dict[str, torch.Tensor],
    header: dict[str, Any],
) -> Any:
    """The state to give ``optimizer.load_state_dict``, tried on stand-ins first: whatever
    the optimizer, its inner optimizers or its loss scaler would refuse is refused here."""
    state = _unflatten(header["optimizer"], tensors)
    if not isinstance(optimizer, LossScaleOptimizer):
        _try_load(path, optimizer, state)
        return state
    if not isinstance(state, dict) or "optimizers" not in state:
        kind = header.get("optimizer_kind")
        raise CheckpointError(
            f"{path}: the optimizer state of a LossScaleOptimizer has no 'optimizers' "
            "entry (a damaged or hand-edited header)"
            if kind == "LossScaleOptimizer"
            else f"{path}: optimizer state is from a {kind}, not a LossScaleOptimizer"
        )
    inner = state["optimizers"]
    if not isinstance(inner, list) or len(inner) != len(optimizer.optimizers):
        raise CheckpointError(
            f"{path}: optimizer state: 'optimizers' is {shown(inner)}; valid: a list of "
            f"{len(optimizer.optimizers)} optimizer state(s)"
        )
    if not _is_count(state.get("micro_steps", 0)):
        raise CheckpointError(
            f"{path}: optimizer state: 'micro_steps' is {shown(state['micro_steps'])}; "
            "valid: an int >= 0"
        )
    if not isinstance(state.get("loss_scaler"), dict):
        raise CheckpointError(
            f"{path}: optimizer state: 'loss_scaler' is {shown(state.get('loss_scaler'))}; "
            "valid: a loss scaler's state_dict()"
        )
    try:  # the scaler's load checks each value by name; a copy keeps the real one as it is
        copy.deepcopy(optimizer.loss_scaler).load_state_dict(state["loss_scaler"])
    except Exception as err:  # whatever a bad state makes it raise
        raise CheckpointError(f"{path}: loss scaler state does not load: {err}") from None
    for each, each_state in zip(optimizer.optimizers, inner, strict=True):
        _try_load(path, each, each_state)
    names = _parameter_names(model)
    masters = []
    for param, master in optimizer.master_weights():
        found = [n for n in names.get(id(param), []) if n in saved]
        if not found:
            wanted = ", ".join(names.get(id(param), [])) or f"a {tuple(param.shape)} weight"
            raise CheckpointError(f"{path}: no saved weight for the master of {wanted}")
        value = saved[found[0]]
        if value.shape != master.shape:  # possible with strict=False
            raise CheckpointError(
                f"{path}: the saved {found[0]!r} has shape {tuple(value.shape)}, its float32 "
                f"master {tuple(master.shape)}"
            )
        masters.append(value.float())
    state["master_weights"] = masters
    return state


def _try_load(path: str | os.PathLike[str], optimizer: torch.optim.Optimizer, state: Any) -> None:
    """Load ``state`` into a stand-in for a torch optimizer: same class, groups and
    defaults, meta tensors for parameters (no memory), no state and no hooks. What torch's
    ``load_state_dict`` and the class's ``__setstate__`` (Adam's, say, reading ``step``)
    refuse is refused here, and ``optimizer`` is not touched."""
    if type(optimizer).load_state_dict is not torch.optim.Optimizer.load_state_dict:
        return  # a load_state_dict of its own: only the real load can tell
    stand_in = type(optimizer).__new__(type(optimizer))
    groups = [
        {**g, "params": [torch.empty_like(p, device="meta") for p in g["params"]]}
        for g in optimizer.param_groups
    ]
    try:
        stand_in.__setstate__(
            {
                "defaults": dict(optimizer.defaults),
                "state": defaultdict(dict),
                "param_groups": groups,
            }
        )
        stand_in.load_state_dict(state)
    except NotImplementedError:
        return  # an operation with no meta kernel: the real load decides
    except Exception as err:  # a hostile state can make torch raise anything
        raise CheckpointError(
            f"{path}: optimizer state does not fit this optimizer: {type(err).__name__}: "
            f"{_cut(str(err), 200)}"
        ) from None


def _buffer_names(model: nn.Module, keys: Iterable[str]) -> set[str]:
    """Which state-dict ``keys`` are buffers (not parameters): their values are not weights,
    and non-finite ones are normal (attention masks of -inf)."""
    params = {n for n, _ in model.named_parameters(remove_duplicate=False)}
    return {k for k in keys if k not in params}


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
    if on_range not in ("error", "clamp", "ignore"):
        raise ValueError(f"on_range={on_range!r} is invalid; valid: 'error', 'clamp', 'ignore'")
    tensors, header = read_checkpoint(source)
    weights = {k.removeprefix("model/"): v for k, v in tensors.items() if k.startswith("model/")}
    return _write_weights(
        weights, dtype, on_range, header.get("aliases", {}), str(source), destination
    )
