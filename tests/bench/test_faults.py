"""Page faults a step (``bench.faults``): the meter counts the faults of memory taken
fresh from the OS and not those of memory reused, and the bench says so under its table
only where a step takes many and spends a notable share of its CPU time in the kernel."""

from __future__ import annotations

import mmap
import sys

import pytest
import torch

from mixprec.bench.faults import (
    FAULT_SHARE,
    KEEP_HEAP_ENV,
    MIN_FAULTS,
    FaultMeter,
    allocator,
)
from mixprec.bench.report import fault_lines, table
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
    sys.platform == "win32" or not allocator().startswith("glibc malloc with its defaults"),
    reason="needs glibc's malloc with its defaults (a fresh mmap for a 64 MiB block)",
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


ADVICE = 'see docs/benchmarks.md, "Page faults on CPU"'
KEPT = "glibc malloc, heap kept (freed blocks below 1024 MiB stay)"
GIB = "1073741824"


def _not_kept(trim: str, mmap_at: str) -> str:
    return (
        f"glibc malloc with trim threshold {trim}, mmap threshold {mmap_at}: it still hands "
        "freed memory back or maps large blocks afresh, and faults them in again each step; "
        f"set both: {KEEP_HEAP_ENV} ({ADVICE})"
    )


@pytest.mark.parametrize(
    ("environ", "expected"),
    [
        ({}, "glibc malloc with its defaults: it may hand freed memory back to the OS, and a "
             f"large CPU step then faults it in again each step ({ADVICE})"),
        (dict(pair.split("=") for pair in KEEP_HEAP_ENV.split()), KEPT),
        ({"GLIBC_TUNABLES": f"glibc.malloc.trim_threshold=0x40000000:"
                            f"glibc.malloc.mmap_threshold={GIB}"}, KEPT),
        # No mmap at all keeps the heap as a high mmap threshold does.
        ({"MALLOC_TRIM_THRESHOLD_": GIB, "MALLOC_MMAP_MAX_": "0"}, KEPT),
        # One of the two alone does not keep the heap: the trim threshold alone turns the
        # dynamic mmap threshold off, the mmap threshold alone leaves the heap trimmed.
        ({"MALLOC_TRIM_THRESHOLD_": GIB}, _not_kept(GIB, "unset")),
        ({"GLIBC_TUNABLES": f"glibc.malloc.mmap_threshold={GIB}"}, _not_kept("unset", GIB)),
        # Set, but to values that keep nothing: said, not taken for kept.
        ({"MALLOC_TRIM_THRESHOLD_": "0", "MALLOC_MMAP_THRESHOLD_": GIB}, _not_kept("0", GIB)),
        ({"GLIBC_TUNABLES": "glibc.malloc.trim_threshold=0:glibc.malloc.mmap_threshold=0"},
         _not_kept("0", "0")),
    ],
)  # fmt: skip
def test_allocator_says_whether_glibc_keeps_its_heap(environ, expected):
    assert allocator(environ, libc="glibc") == expected


def test_allocator_names_a_preloaded_allocator_and_other_platforms(tmp_path):
    lib = tmp_path / "libjemalloc.so.2"
    lib.write_bytes(b"")
    assert allocator({"LD_PRELOAD": str(lib)}, libc="glibc") == "jemalloc (preloaded)"
    assert allocator({"LD_PRELOAD": "libtcmalloc_minimal.so.4"}, libc="glibc") == (
        "tcmalloc_minimal (preloaded)"
    )
    # A path ld.so cannot load, or a library that is not an allocator, is not named.
    missing = {"LD_PRELOAD": str(tmp_path / "libmimalloc.so")}
    assert allocator(missing, libc="glibc").startswith("glibc malloc with its defaults")
    assert allocator({"LD_PRELOAD": "libfoo.so"}, libc="glibc").startswith("glibc malloc")
    assert allocator({}, libc="") == "the platform's malloc"
