"""Floating dtype names and aliases, parsing, and hardware capability probes."""

from __future__ import annotations

import difflib
import functools
from dataclasses import dataclass

import torch

#: The dtypes a policy may use, by canonical name.
CANONICAL: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
}

_ALIASES: dict[str, str] = {
    "f32": "float32",
    "fp32": "float32",
    "float": "float32",
    "single": "float32",
    "f16": "float16",
    "fp16": "float16",
    "half": "float16",
    "bf16": "bfloat16",
}

#: 16-bit floating dtypes: the ones that need float32 master weights and range checks.
HALF_DTYPES: frozenset[torch.dtype] = frozenset({torch.float16, torch.bfloat16})


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.bfloat16`` -> ``"bfloat16"``."""
    return str(dtype).removeprefix("torch.")


def closest(word: str, choices: list[str]) -> str | None:
    """The closest spelling among ``choices``, for error messages."""
    found = difflib.get_close_matches(word, choices, n=1, cutoff=0.4)
    return found[0] if found else None


def parse_dtype(value: str | torch.dtype, *, argument: str = "dtype") -> torch.dtype:
    """Turn ``"bf16"``, ``"torch.float16"`` or ``torch.float32`` into a supported dtype.

    Raises ``ValueError`` naming ``argument``, the value received and the valid names.
    """
    if isinstance(value, torch.dtype):
        if value in CANONICAL.values():
            return value
        raise ValueError(
            f"{argument}={value!r} is not supported; valid dtypes: {', '.join(CANONICAL)}"
        )
    if not isinstance(value, str):
        raise TypeError(
            f"{argument} must be a str or torch.dtype, got {type(value).__name__}: {value!r}"
        )
    key = value.strip().lower().removeprefix("torch.")
    key = _ALIASES.get(key, key)
    if key in CANONICAL:
        return CANONICAL[key]
    valid = list(CANONICAL) + list(_ALIASES)
    hint = closest(key, valid)
    raise ValueError(
        f"{argument}={value!r} is not a known dtype; valid: {', '.join(valid)}"
        + (f" (did you mean {hint!r}?)" if hint else "")
    )


def finfo_max(dtype: torch.dtype) -> float:
    return float(torch.finfo(dtype).max)


@dataclass(frozen=True)
class Hardware:
    """What the machine offers for 16-bit matrix work, and why we think so."""

    device: str
    bf16_fast: bool
    fp16_fast: bool
    detail: str


def cpuinfo_field(name: str) -> str | None:
    """The first ``name`` field of /proc/cpuinfo (``"flags"``, ``"model name"``), or None
    where there is no such file (macOS, Windows) or field."""
    try:
        with open("/proc/cpuinfo", encoding="ascii", errors="replace") as f:
            for line in f:
                if line.startswith(name):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return None


def _cpu_flags() -> set[str]:
    return set((cpuinfo_field("flags") or "").split())


@functools.lru_cache(maxsize=1)
def probe_hardware() -> Hardware:
    """Probe once per process: CUDA first, then the CPU's bf16 matrix units."""
    if torch.cuda.is_available():
        name = torch.cuda.get_device_name()
        major, minor = torch.cuda.get_device_capability()
        # Ampere (8.0) and later run bf16 matmuls on tensor cores at fp16 speed.
        bf16 = bool(torch.cuda.is_bf16_supported()) and major >= 8
        return Hardware("cuda", bf16, major >= 7, f"CUDA {name} (sm_{major}{minor})")
    flags = _cpu_flags()
    units = sorted(flags & {"avx512_bf16", "amx_bf16", "amx_tile"})
    if units:
        return Hardware("cpu", True, "amx_fp16" in flags, "CPU with " + ", ".join(units))
    if not flags:
        # No /proc/cpuinfo (macOS, Windows): ask oneDNN whether it has a bf16 path.
        mkldnn_bf16 = bool(getattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", lambda: False)())
        return Hardware("cpu", mkldnn_bf16, False, "CPU (oneDNN bf16 support reported)")
    return Hardware("cpu", False, False, "CPU without AVX512-BF16 or AMX")
