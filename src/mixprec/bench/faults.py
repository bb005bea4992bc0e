"""Page faults a step: memory the C allocator took from the OS again.

glibc's malloc returns the top of its heap to the OS once more than its trim threshold
lies free there, and serves large blocks with fresh ``mmap`` s; a step that frees its
activations at its end may then fault every page of them in again in the next one.
Whether the heap is trimmed depends on where the last live block lies, so two loops with
the same kernels can differ by it. ``mixprec bench`` counts the faults per mode on CPU
(``FaultMeter``), and ``report.fault_lines`` says so where they take a notable share of
the step (docs/benchmarks.md, "Page faults on CPU"). ``allocator`` says which allocator a
process has and whether it keeps freed memory.
"""

from __future__ import annotations

import os
import platform
import re
import statistics
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

__all__ = [
    "FAULT_SHARE",
    "KEEP_HEAP_ENV",
    "MIN_FAULTS",
    "FaultMeter",
    "allocator",
]

#: A mode whose step spends this share of its CPU time (user + system, every thread) in
#: the kernel, and takes at least ``MIN_FAULTS`` page faults a step, gets a line.
FAULT_SHARE = 0.15
MIN_FAULTS = 256  # 1 MiB of 4 KiB pages

#: The environment that keeps glibc's heap (see mallopt(3)): nothing is trimmed and no
#: block is served by ``mmap``, so freed memory is reused without faulting it in again.
KEEP_HEAP_ENV = "MALLOC_TRIM_THRESHOLD_=1073741824 MALLOC_MMAP_THRESHOLD_=1073741824"


@dataclass
class FaultMeter:
    """Minor page faults a step and the share of CPU time in the kernel, per timed block;
    where the platform has no ``resource`` module (Windows) it counts nothing."""

    faults: list[float] = field(default_factory=list)
    kernel_shares: list[float] = field(default_factory=list)
    _start: tuple[int, float, float] | None = field(default=None, init=False, repr=False)

    @staticmethod
    def _now() -> tuple[int, float, float] | None:
        if sys.platform == "win32":
            return None
        import resource

        usage = resource.getrusage(resource.RUSAGE_SELF)
        return usage.ru_minflt, usage.ru_utime, usage.ru_stime

    def start(self) -> None:
        self._start = self._now()

    def stop(self, steps: int) -> None:
        """Close the block begun by ``start``: ``steps`` steps ran in it."""
        end, begin = self._now(), self._start
        if end is None or begin is None:
            return
        user, system = end[1] - begin[1], end[2] - begin[2]
        self.faults.append((end[0] - begin[0]) / steps)
        self.kernel_shares.append(system / (user + system) if user + system > 0 else 0.0)

    def per_step(self) -> tuple[float | None, float | None]:
        """The medians over the blocks of the faults a step and of the kernel's share of
        the CPU time, or (None, None) where nothing was counted."""
        if not self.faults:
            return None, None
        return statistics.median(self.faults), statistics.median(self.kernel_shares)


# Each keeps the heap only with the other: the trim threshold alone turns glibc's dynamic
# mmap threshold off at 128 KiB, so every large block is a fresh mmap; the mmap threshold
# alone leaves the heap trimmed. Below 32 MiB (the dynamic threshold's ceiling) a set value
# is no better than the defaults.
_MALLOC_VARS = {
    "trim_threshold": "MALLOC_TRIM_THRESHOLD_",
    "mmap_threshold": "MALLOC_MMAP_THRESHOLD_",
    "mmap_max": "MALLOC_MMAP_MAX_",
}
_LEAST = 32 << 20
_PRELOADED = re.compile(r"lib(jemalloc|tcmalloc|tcmalloc_minimal|mimalloc)\b")


def _int(text: str | None) -> int | None:
    try:
        return None if text is None else int(text, 0)
    except ValueError:
        return None


def _malloc_settings(env: Mapping[str, str]) -> dict[str, int | None]:
    """glibc's trim threshold, mmap threshold and mmap_max as set by the ``MALLOC_*_``
    variables or ``GLIBC_TUNABLES``; None where unset. (Where both set one, glibc takes
    whichever comes first in the environment; this reads the tunable.)"""
    settings = {key: _int(env.get(var)) for key, var in _MALLOC_VARS.items()}
    for item in env.get("GLIBC_TUNABLES", "").split(":"):
        name, _, value = item.partition("=")
        key = name.removeprefix("glibc.malloc.")
        if name.startswith("glibc.malloc.") and key in settings:
            settings[key] = _int(value)
    return settings


def allocator(environ: Mapping[str, str] | None = None, libc: str | None = None) -> str:
    """Which C allocator serves this process's CPU tensors, and whether it keeps freed
    memory (``mixprec info``, the bench's JSON), from ``environ`` (``os.environ``) and
    ``libc`` (this process's). malloc reads its variables once, at start-up: set later in
    the process (a notebook's ``os.environ[...] = ...``), they are reported but not used."""
    env = os.environ if environ is None else environ
    for entry in env.get("LD_PRELOAD", "").replace(":", " ").split():
        match = _PRELOADED.match(Path(entry).name)
        if match and ("/" not in entry or Path(entry).exists()):  # ld.so skips a missing path
            return f"{match.group(1)} (preloaded)"
    if (platform.libc_ver()[0] if libc is None else libc) != "glibc":
        return "the platform's malloc"
    s = _malloc_settings(env)
    trim, mmap_at, mmap_max = s["trim_threshold"], s["mmap_threshold"], s["mmap_max"]
    advice = 'see docs/benchmarks.md, "Page faults on CPU"'
    if trim is None and mmap_at is None and mmap_max is None:
        return (
            "glibc malloc with its defaults: it may hand freed memory back to the OS, and a "
            f"large CPU step then faults it in again each step ({advice})"
        )
    no_mmap = mmap_max == 0
    if trim is not None and trim >= _LEAST and (no_mmap or (mmap_at or 0) >= _LEAST):
        kept = trim if no_mmap else min(trim, mmap_at or 0)
        return f"glibc malloc, heap kept (freed blocks below {kept / 2**20:.0f} MiB stay)"
    trim_s, mmap_s = ("unset" if v is None else str(v) for v in (trim, mmap_at))
    return (
        f"glibc malloc with trim threshold {trim_s}, mmap threshold {mmap_s}: it still hands "
        "freed memory back or maps large blocks afresh, and faults them in again each step; "
        f"set both: {KEEP_HEAP_ENV} ({advice})"
    )
