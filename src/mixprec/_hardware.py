"""Hardware capability probes: whether this machine runs 16-bit matrix work fast."""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch


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
