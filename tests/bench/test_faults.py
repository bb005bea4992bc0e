"""Page faults a step (``bench.faults``): the meter counts the faults of memory taken
fresh from the OS and not those of memory reused, and the bench says so under its table
only where a step takes many and spends a notable share of its CPU time in the kernel."""

from __future__ import annotations

import mmap
import os
import platform
import sys

import pytest
import torch

from mixprec.bench.faults import (
    FAULT_SHARE,
    KEEP_HEAP_ENV,
    MIN_FAULTS,
    FaultMeter,
    allocator,
    fault_lines,
)
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
    faults, share = meter.per_step()
    assert faults is not None and share is not None and 0 <= share <= 1
    return faults


@pytest.mark.skipif(
    sys.platform == "win32"
    or platform.libc_ver()[0] != "glibc"
    or "MALLOC_MMAP_THRESHOLD_" in os.environ,
    reason="needs glibc's malloc with its default mmap threshold",
)
def test_meter_counts_fresh_memory_and_not_reused_memory():
    kept = torch.empty(FRESH_BYTES, dtype=torch.uint8)
    fresh = _faults_a_step(lambda: torch.empty(FRESH_BYTES, dtype=torch.uint8).fill_(1))
    reused = _faults_a_step(lambda: kept.fill_(1))
    # 16384 with 4 KiB pages, 32 with transparent huge pages; the reused buffer none.
    assert fresh >= 16
    assert reused <= fresh / 10


def test_meter_without_blocks_reports_none():
    assert FaultMeter().per_step() == (None, None)


def _result(mode: str, faults: float | None, share: float | None) -> ModeResult:
    return ModeResult(
        mode=mode, level="O2", ms_per_step=46.0, samples_per_s=1.0, speedup=1.0,
        final_loss=0.1, peak_mb=None, page_faults=faults, kernel_share=share,
    )  # fmt: skip


def test_many_faults_and_a_share_in_the_kernel_get_a_line():
    results = [
        _result("float32", 100.0, 0.5),  # a large share, but few faults
        _result("auto", 12256.0, 0.32),
        _result("O1-bf16", 9000.0, FAULT_SHARE - 0.01),  # many faults, a small share
        _result("O3-bf16", MIN_FAULTS - 1, 0.9),
        _result("O2-bf16", None, None),  # not counted (CUDA, Windows)
    ]
    lines = fault_lines("mlp-b8192", results)
    mib = 12256 * mmap.PAGESIZE / 2**20
    assert lines == [
        f"mlp-b8192 auto: 12256 page faults a step (at least {mib:.0f} MiB taken from the OS "
        "again), 32% of its CPU time in the kernel: the C allocator hands freed memory back "
        f"after each step. Keep it: {KEEP_HEAP_ENV} in the environment (glibc), or "
        "jemalloc/tcmalloc; see docs/benchmarks.md"
    ]
    # The table prints it under the rows, and only it.
    text = table("mlp-b8192", results)
    assert text.splitlines()[-1] == lines[0]
    assert text.count("page faults a step") == 1


GLIBC_MAPS = "7f00-7f10 r-xp 0 08:01 1 /usr/lib/x86_64-linux-gnu/libc.so.6\n"
ADVICE = 'see docs/benchmarks.md, "Page faults on CPU"'


@pytest.mark.parametrize(
    ("environ", "expected"),
    [
        ({}, "glibc malloc with its defaults: it may hand freed memory back to the OS, and a "
             f"large CPU step then faults it in again each step ({ADVICE})"),
        (dict(pair.split("=") for pair in KEEP_HEAP_ENV.split()),
         "glibc malloc, heap kept (trim and mmap thresholds set)"),
        ({"GLIBC_TUNABLES": "glibc.malloc.trim_threshold=1073741824:"
                            "glibc.malloc.mmap_threshold=1073741824"},
         "glibc malloc, heap kept (trim and mmap thresholds set)"),
        # One of the two alone does not keep the heap (the trim threshold alone measured
        # more faults than neither): said, not taken for kept.
        ({"MALLOC_TRIM_THRESHOLD_": "1073741824"},
         "glibc malloc with MALLOC_TRIM_THRESHOLD_ set but not MALLOC_MMAP_THRESHOLD_: it "
         "still hands freed memory back or maps large blocks afresh, and faults them in again "
         f"each step; set both ({ADVICE})"),
        ({"GLIBC_TUNABLES": "glibc.malloc.mmap_threshold=1073741824"},
         "glibc malloc with MALLOC_MMAP_THRESHOLD_ set but not MALLOC_TRIM_THRESHOLD_: it "
         "still hands freed memory back or maps large blocks afresh, and faults them in again "
         f"each step; set both ({ADVICE})"),
    ],
)  # fmt: skip
def test_allocator_says_whether_glibc_keeps_its_heap(environ, expected):
    assert allocator(environ, maps=GLIBC_MAPS, libc="glibc") == expected


def test_allocator_names_a_preloaded_allocator_and_other_platforms():
    maps = GLIBC_MAPS + "7f20-7f30 r-xp 0 08:01 2 /usr/lib/libjemalloc.so.2\n"
    assert allocator({}, maps=maps, libc="glibc") == "jemalloc (preloaded)"
    assert allocator({}, maps="", libc="") == "the platform's malloc"
