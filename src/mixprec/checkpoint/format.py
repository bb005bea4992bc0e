"""The checkpoint format: its name and version, the limits a file is held to, the checksum,
and what a load reports or raises.

One ``.safetensors`` file holds every tensor (model weights, optimizer state, RNG states)
and, under the metadata key ``"mixprec"``, a JSON document: format version, mixprec and
torch versions, policy and level (with a float8 policy's recipe and converted layers), the
non-tensor parts of the optimizer and trainer state, the optimizer's classes (a key readers
do not require), and a SHA-256 checksum of the header's other keys and the tensors (format 1
files, whose checksum covers the tensors only, are still read). Weights that have float32
masters are stored as the masters: float32 is the source of truth, and a 16-bit model gets
them rounded on load.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

import torch

from mixprec._errors import shown

FORMAT = "mixprec-checkpoint"
#: 3: the header names the optimizer's parameters and the model's buffers; 2: the checksum
#: covers the header and the tensors; 1: the tensors only. All are read.
FORMAT_VERSION = 3
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


class CheckpointError(ValueError):
    """A checkpoint that cannot be used: unreadable, truncated, tampered, unsafe, or not
    matching the model. The message names the file and what is wrong."""


class _BadValueError(Exception):
    """A header value of the wrong type or range: its key, the value, and what is valid."""

    def __init__(self, key: str, value: Any, valid: str) -> None:
        super().__init__(key, value, valid)
        self.key, self.value, self.valid = key, value, valid

    def __str__(self) -> str:
        return f"{_cut(self.key)!r} is {shown(self.value)}; valid: {self.valid}"


@dataclass
class LoadReport:
    """What ``load_checkpoint`` (or ``convert_checkpoint``) did: tensors cast to another
    dtype, values out of a 16-bit range and what ``on_range`` did with them, non-zero values
    that became 0 (``underflow``), NaN/inf counts loaded under ``on_range="ignore"``, key
    mismatches, the header's metadata and the trainer state; for a conversion, the state it
    did not write."""

    path: str
    converted: list[tuple[str, str, str]] = field(default_factory=list)  # name, from, to
    out_of_range: list[tuple[str, float, str, str]] = field(default_factory=list)
    non_finite: list[tuple[str, int, int]] = field(default_factory=list)  # name, NaN, inf
    #: Tensors whose non-zero values became 0 in a narrower dtype: name, how many, dtype.
    underflow: list[tuple[str, int, str]] = field(default_factory=list)
    missing: list[str] = field(default_factory=list)
    unexpected: list[str] = field(default_factory=list)
    mismatched: list[tuple[str, tuple[int, ...], tuple[int, ...]]] = field(default_factory=list)
    #: ``strict=False``: keys of one (tied) tensor whose saved values differ; the last won.
    tied_conflicts: list[list[str]] = field(default_factory=list)
    metadata: dict[str, Any] = field(default_factory=dict)
    trainer_state: dict[str, Any] = field(default_factory=dict)
    #: ``convert_checkpoint``: the state of the source that the weights-only output leaves out.
    dropped: list[str] = field(default_factory=list)

    def __str__(self) -> str:
        lines = [f"loaded {self.path}: {len(self.converted)} tensors converted"]
        lines += [f"  {name}: {a} -> {b}" for name, a, b in self.converted]
        for name, peak, dtype, action in self.out_of_range:
            lines.append(f"  {name}: max |value| {peak:.6g} exceeds {dtype} ({action})")
        for name, nan, inf in self.non_finite:
            lines.append(f"  {name}: {nan} NaN, {inf} inf (loaded as they are)")
        lines += [underflow_line(*entry) for entry in self.underflow]
        lines += [f"  dropped: {what}" for what in self.dropped]
        return "\n".join(lines + self.mismatch_lines())

    def mismatch_lines(self) -> list[str]:
        lines = [
            f"  {label}: {', '.join(names)}"
            for label, names in (("missing", self.missing), ("unexpected", self.unexpected))
            if names
        ]
        lines += [f"  shape mismatch {n}: saved {a}, model {b}" for n, a, b in self.mismatched]
        return lines + [
            f"  tied: {', '.join(names)} are one tensor here and differ in the file; "
            f"{names[-1]}'s value was loaded"
            for names in self.tied_conflicts
        ]


def underflow_line(name: str, count: int, dtype: str) -> str:
    """One ``LoadReport.underflow`` entry, as the report and ``mixprec convert`` print it."""
    return f"  {name}: {count} non-zero value{'s' * (count != 1)} below {dtype}'s range became 0"


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


def _cut(text: str, limit: int = 80) -> str:
    """``text`` with its middle cut out if it is longer than ``limit``."""
    return text if len(text) <= limit else f"{text[: limit // 2]}...{text[-(limit // 2 - 3) :]}"


def _is_count(value: Any) -> bool:
    return type(value) is int and 0 <= value <= _MAX_INT  # bool is an int: refused
