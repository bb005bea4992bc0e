"""The safetensors framing, read as hostile: an 8-byte little-endian header length, a JSON
header of entries (dtype, shape, data offsets) and ``__metadata__``, then the tensor data.

Every entry and the data's layout are checked against the file before a tensor is read, so
that the work which follows is bounded by the file's bytes; the tensors are read last, from
the same open file as the header.
"""

from __future__ import annotations

import itertools
import json
import math
import sys
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, BinaryIO

import torch

from mixprec._dtypes import dtype_name
from mixprec._errors import shown
from mixprec.checkpoint._files import _available_memory
from mixprec.checkpoint.format import (
    _FREE_ENTRIES,
    _MAX_HEADER_BYTES,
    _MAX_INT,
    CheckpointError,
    _is_count,
)

#: safetensors dtype names mixprec reads (the sub-byte F4/F6 types have no torch dtype).
SAFETENSORS_DTYPES: dict[str, torch.dtype] = {
    name: getattr(torch, attr)
    for name, attr in {
        "BOOL": "bool", "U8": "uint8", "I8": "int8", "I16": "int16", "U16": "uint16",
        "I32": "int32", "U32": "uint32", "I64": "int64", "U64": "uint64", "F16": "float16",
        "BF16": "bfloat16", "F32": "float32", "F64": "float64", "C64": "complex64",
        "F8_E4M3": "float8_e4m3fn", "F8_E5M2": "float8_e5m2", "F8_E8M0": "float8_e8m0fnu",
    }.items()
    if hasattr(torch, attr)
}  # fmt: skip

_Entry = tuple[torch.dtype, tuple[int, ...], int, int]  # dtype, shape, begin, end


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
    dtype = SAFETENSORS_DTYPES.get(value["dtype"]) if isinstance(value["dtype"], str) else None
    if dtype is None:
        raise CheckpointError(
            f"{file}: tensor {shown(name)} has dtype {shown(value['dtype'])}; valid: "
            f"{', '.join(SAFETENSORS_DTYPES)}"
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


def _read_tensors(
    handle: BinaryIO, file: Path, entries: Mapping[str, _Entry]
) -> dict[str, torch.Tensor]:
    """The tensors of ``entries``, read once the framing is checked, from ``handle`` where
    ``_safetensors_header`` left it (the start of the data). Header and tensors come from
    the one open file: a writer that replaces the path meanwhile is not seen. Each tensor's
    bytes are read straight into its own memory, as the memory check counted them."""
    start = handle.tell()
    tensors = {}
    for name, (dtype, shape, begin, end) in entries.items():
        try:
            raw = torch.empty(end - begin, dtype=torch.uint8)
        except (MemoryError, RuntimeError) as err:  # torch's allocator raises RuntimeError
            raise CheckpointError(f"{file}: its tensors do not fit in memory ({err})") from None
        try:
            handle.seek(start + begin)
            complete = _read_exactly(handle, raw.numpy().data)
        except OSError as err:
            raise CheckpointError(f"{file}: cannot be read ({err.strerror})") from None
        if not complete:  # shortened in place since its size was checked
            raise CheckpointError(
                f"{file}: truncated or corrupt: tensor {shown(name)} ends past the end of the file"
            )
        if sys.byteorder == "big" and dtype.itemsize > 1:  # safetensors is little-endian
            part = dtype.itemsize // 2 if dtype.is_complex else dtype.itemsize
            raw = raw.view(-1, part).flip(1).reshape(-1)
        tensors[name] = raw.view(dtype).reshape(shape)
    return tensors


def _read_exactly(handle: BinaryIO, into: memoryview) -> bool:
    """Fill ``into`` from ``handle``; False if the file ends first."""
    done = 0
    while done < len(into):
        count = handle.readinto(into[done:])  # type: ignore[attr-defined]
        if not count:
            return False
        done += count
    return True
