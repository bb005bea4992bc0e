"""Page faults a step (``bench.faults``): the meter counts the faults of memory taken
fresh from the OS and not those of memory reused, and the bench says so under its table
only where a step spends a notable share in the kernel."""

from __future__ import annotations

import mmap
import sys

import pytest
import torch

from mixprec.bench.faults import FAULT_SHARE, KEEP_HEAP_ENV, FaultMeter, fault_lines
from mixprec.bench.report import table
from mixprec.bench.runner import ModeResult

# 64 MiB: above glibc's largest dynamic mmap threshold (32 MiB), so each allocation is a
# fresh mmap whose pages fault in when written (4 KiB pages, or 2 MiB under THP).
FRESH_BYTES = 64 << 20


def _faults_a_step(step, steps: int = 4) -> float:
    meter = FaultMeter()
    step()  # warm: the first call may fault in code and buffers
    for _ in range(3):
        meter.start()
        for _ in range(steps):
            step()
        meter.stop(steps)
    faults, system_ms = meter.per_step()
    assert faults is not None and system_ms is not None and system_ms >= 0
    return faults


@pytest.mark.skipif(sys.platform == "win32", reason="no resource module on Windows")
def test_meter_counts_fresh_memory_and_not_reused_memory():
    kept = torch.empty(FRESH_BYTES, dtype=torch.uint8)
    fresh = _faults_a_step(lambda: torch.empty(FRESH_BYTES, dtype=torch.uint8).fill_(1))
    reused = _faults_a_step(lambda: kept.fill_(1))
    # 16384 with 4 KiB pages, 32 with transparent huge pages; the reused buffer none.
    assert fresh >= 16
    assert reused <= fresh / 10


def test_meter_without_blocks_reports_none():
    assert FaultMeter().per_step() == (None, None)


def _result(mode: str, ms: float, faults: float | None, system_ms: float | None) -> ModeResult:
    return ModeResult(
        mode=mode, level="O2", ms_per_step=ms, samples_per_s=1.0, speedup=1.0,
        final_loss=0.1, peak_mb=None, page_faults=faults, system_ms=system_ms,
    )  # fmt: skip


def test_a_step_spending_a_share_in_the_kernel_gets_a_line():
    results = [
        _result("float32", 40.0, 100.0, 0.5),
        _result("auto", 46.0, 12256.0, 22.0),  # 48% of the step in the kernel
        _result("O1-bf16", 40.0, 9000.0, FAULT_SHARE * 40.0 - 0.1),  # just under the share
        _result("O2-bf16", 40.0, None, None),  # not measured (CUDA, Windows)
    ]
    lines = fault_lines("mlp-b8192", results)
    mb = 12256 * mmap.PAGESIZE / 2**20
    assert lines == [
        f"mlp-b8192 auto: 12256 page faults a step ({mb:.0f} MB of freed memory taken back "
        "from the OS; 22.0 of 46.0 ms a step in the kernel): the C allocator hands freed "
        f"memory back after each step. Keep it: {KEEP_HEAP_ENV} in the environment (glibc), "
        "or jemalloc/tcmalloc; see docs/benchmarks.md"
    ]
    # The table prints it under the rows, and only it.
    text = table("mlp-b8192", results)
    assert text.splitlines()[-1] == lines[0]
    assert text.count("page faults a step") == 1
