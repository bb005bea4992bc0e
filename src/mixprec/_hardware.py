"""Hardware capability probes: whether this machine runs 16-bit matrix work fast, and how
to name the CPU and its 16-bit units in a title."""

from __future__ import annotations

import functools
import re
import time
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


@functools.lru_cache(maxsize=1)
def _cpu_flags() -> frozenset[str]:
    return frozenset((cpuinfo_field("flags") or "").split())


#: The CPU flags of fast 16-bit matrix work, by the names vendors give them: the bfloat16
#: matrix units (Intel AMX, and AVX512-BF16's dot products) and AMX's float16 one.
#: ``amx_tile`` (AMX's registers) comes with either AMX unit and names no dtype.
CPU_16BIT_UNITS = {"amx_bf16": "AMX-BF16", "avx512_bf16": "AVX512-BF16", "amx_fp16": "AMX-FP16"}


def cpu_16bit_units() -> tuple[str, ...]:
    """This CPU's units for fast 16-bit matrix work, by their vendor names
    (``CPU_16BIT_UNITS``, in its order), from /proc/cpuinfo's flags; empty where it has
    none or there are no flags to read (see ``cpu_fast``)."""
    flags = _cpu_flags()
    return tuple(name for flag, name in CPU_16BIT_UNITS.items() if flag in flags)


def cpu_fast(dtype: str) -> bool:
    """Whether this CPU runs ``dtype`` (``"bfloat16"`` or ``"float16"``) matmuls fast, on
    matrix units; else oneDNN emulates them, slower than float32. From the CPU's flags, as
    ``probe_hardware`` reads them (``amx_tile`` counts for bfloat16), or where there are
    none to read (macOS, Windows), from ``probe_hardware``'s oneDNN answer."""
    cpu = probe_cpu()
    return cpu.bf16_fast if dtype == "bfloat16" else dtype == "float16" and cpu.fp16_fast


def slow_16bit_why(what: str = "16-bit") -> str:
    """Why ``what`` matmuls run slower than float32's on this CPU, for a message: emulated
    (no AVX512-BF16 or AMX), or measured slower (AVX512-BF16 without AMX, where the flag
    says bfloat16 and a matmul says otherwise)."""
    if cpu_16bit_units():
        return f"{what} matmuls measured slower than float32's on this CPU (AVX512-BF16, no AMX)"
    return f"{what} matmuls are emulated on this CPU (no AVX512-BF16 or AMX)"


def cpu_model(name: str | None = None) -> str:
    """The CPU's model name (``name``, or /proc/cpuinfo's ``model name``), shortened for a
    title: trademark signs, the words "CPU" and "Processor", the core count and the clock
    dropped. ``"Intel(R) Xeon(R) Platinum 8481C CPU @ 2.70GHz"``: ``"Intel Xeon Platinum
    8481C"``; ``"AMD EPYC 9B14 96-Core Processor"``: ``"AMD EPYC 9B14"``."""
    if name is None:
        import platform

        name = cpuinfo_field("model name") or platform.processor() or "CPU"
    short = re.sub(r"\((R|TM)\)|@.*$|\b\d+-Core\b|\bCPU\b|\bProcessor\b", " ", name, flags=re.I)
    return " ".join(short.split()) or name.strip() or "CPU"


@functools.lru_cache(maxsize=1)
def probe_hardware() -> Hardware:
    """Probe once per process: CUDA first, then the CPU's bf16 matrix units."""
    if torch.cuda.is_available():
        name = torch.cuda.get_device_name()
        major, minor = torch.cuda.get_device_capability()
        # Ampere (8.0) and later run bf16 matmuls on tensor cores at fp16 speed.
        bf16 = bool(torch.cuda.is_bf16_supported()) and major >= 8
        return Hardware("cuda", bf16, major >= 7, f"CUDA {name} (sm_{major}{minor})")
    return probe_cpu()


#: Where a CPU has AVX512-BF16 and no AMX, ``auto`` takes bfloat16 only where its matmuls
#: measured at least this much faster than float32's (``bf16_matmul_speedup``).
BF16_WORTH = 1.2


@functools.lru_cache(maxsize=1)
def bf16_matmul_speedup() -> float:
    """float32's time over bfloat16's for a 512x512 matmul on this CPU, measured once per
    process (about 20 ms; the best of 5 of each, interleaved; torch's generator untouched).
    AVX512-BF16 without AMX gave 4.3-4.7x on a 2-core AMD EPYC, and 0.52x on a 2-core
    Intel Xeon (2026-11-27), where ``auto`` took bfloat16 by the flag and trained at
    0.57-0.67x float32's speed."""
    generator = torch.Generator().manual_seed(0)
    a, b = (torch.randn(512, 512, generator=generator) for _ in range(2))
    pairs = {dtype: (a.to(dtype), b.to(dtype)) for dtype in (torch.float32, torch.bfloat16)}
    best = dict.fromkeys(pairs, float("inf"))
    for _ in range(6):  # the first round warms up each
        for dtype, (x, y) in pairs.items():
            start = time.perf_counter()
            torch.mm(x, y)
            best[dtype] = min(best[dtype], time.perf_counter() - start)
    return best[torch.float32] / best[torch.bfloat16]


def probe_cpu() -> Hardware:
    """The CPU's 16-bit matrix units, whether or not a GPU is present (``probe_hardware``
    answers for the GPU where there is one). Not cached: it reads the cached CPU flags
    (and, for AVX512-BF16 without AMX, the cached ``bf16_matmul_speedup``)."""
    flags = _cpu_flags()
    units = sorted(flags & {"avx512_bf16", "amx_bf16", "amx_tile"})
    if units and not flags & {"amx_bf16", "amx_tile"}:
        speedup = bf16_matmul_speedup()
        if speedup < BF16_WORTH:
            return Hardware(
                "cpu", False, False,
                f"CPU with avx512_bf16 and no AMX, where bfloat16 matmuls measured "
                f"{speedup:.2f}x float32's speed",
            )  # fmt: skip
    if units:
        return Hardware("cpu", True, "amx_fp16" in flags, "CPU with " + ", ".join(units))
    if not flags:
        # No /proc/cpuinfo (macOS, Windows): ask oneDNN whether it has a bf16 path.
        mkldnn_bf16 = bool(getattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", lambda: False)())
        said = "reports bf16 support" if mkldnn_bf16 else "reports no bf16 support"
        return Hardware("cpu", mkldnn_bf16, False, f"CPU (no CPU flags to read; oneDNN {said})")
    return Hardware("cpu", False, False, "CPU without AVX512-BF16 or AMX")
