"""Page faults a step: memory the C allocator handed back to the OS and took again.

glibc's malloc returns the top of its heap to the OS once more than its trim threshold
lies free there, and serves large blocks with fresh ``mmap`` s: a step whose activations are
freed at its end then faults every page of them in again in the next one. On a 2-core Xeon
the batch-8192 MLP spent 12-20 of its 40-48 ms a step so (12,000 faults a step), and
whether the heap is trimmed depends on where the last live block lies, so two loops with the
same kernels paid 0.85x each other. ``mixprec bench`` counts them per mode and says so.
"""

from __future__ import annotations

import mmap
import statistics
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from mixprec.bench.runner import ModeResult

__all__ = ["FAULT_SHARE", "KEEP_HEAP_ENV", "FaultMeter", "fault_lines"]

#: A mode whose step spends this share of its time in the kernel (system time, which page
#: faults dominate in a training step) gets a line under its workload's table.
FAULT_SHARE = 0.15

#: The environment that keeps glibc's heap (see mallopt(3)): nothing is trimmed and no
#: block is served by ``mmap``, so freed memory is reused without faulting it in again.
KEEP_HEAP_ENV = "MALLOC_TRIM_THRESHOLD_=1073741824 MALLOC_MMAP_THRESHOLD_=1073741824"


@dataclass
class FaultMeter:
    """Minor page faults and system ms per step over timed blocks, per block; where the
    platform has no ``resource`` module (Windows) it counts nothing and reports None."""

    faults: list[float] = field(default_factory=list)
    system_ms: list[float] = field(default_factory=list)
    _start: tuple[int, float] | None = None

    @staticmethod
    def _now() -> tuple[int, float] | None:
        if sys.platform == "win32":
            return None
        import resource

        usage = resource.getrusage(resource.RUSAGE_SELF)
        return usage.ru_minflt, usage.ru_stime

    def start(self) -> None:
        self._start = self._now()

    def stop(self, steps: int) -> None:
        """Close the block begun by ``start``: ``steps`` steps ran in it."""
        end, begin = self._now(), self._start
        if end is None or begin is None:
            return
        self.faults.append((end[0] - begin[0]) / steps)
        self.system_ms.append(1000 * (end[1] - begin[1]) / steps)

    def per_step(self) -> tuple[float | None, float | None]:
        """The median faults and system ms a step over the blocks, or (None, None)."""
        if not self.faults:
            return None, None
        return statistics.median(self.faults), statistics.median(self.system_ms)


def fault_lines(workload: str, results: Sequence[ModeResult]) -> list[str]:
    """One line for each mode whose step spends ``FAULT_SHARE`` or more in the kernel, with
    its page faults a step and how to keep the heap."""
    lines = []
    for r in results:
        faults, system, ms = r.page_faults, r.system_ms, r.ms_per_step
        if faults is None or system is None or system < FAULT_SHARE * ms:
            continue
        mb = faults * mmap.PAGESIZE / 2**20
        lines.append(
            f"{workload} {r.mode}: {faults:.0f} page faults a step ({mb:.0f}"
            f" MB of freed memory taken back from the OS; {system:.1f} of {ms:.1f} ms a step in"
            " the kernel): the C allocator hands freed memory back after each step. Keep it: "
            f"{KEEP_HEAP_ENV} in the environment (glibc), or jemalloc/tcmalloc; see "
            "docs/benchmarks.md"
        )
    return lines
