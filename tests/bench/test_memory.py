"""The benchmark's peak-memory probes: per mode in a fresh process, the CPU allocator's
peak, and the largest batch within a budget."""

from __future__ import annotations

import torch

from mixprec import bench, cli
from mixprec.bench import memory


def test_peak_memory_is_measured_per_mode():
    results = bench.run("mlp-b64", ["float32", "O2-bf16"], repeats=1, steps=1, warmup=1,
                        memory=True, small=True)  # fmt: skip
    for r in results:
        assert r.peak_mb is not None and r.peak_mb > 0


def test_cpu_allocator_peak_counts_tensor_memory():
    def run() -> None:
        a = torch.empty(32 * 2**20, dtype=torch.uint8)  # 32 MiB
        b = torch.empty(16 * 2**20, dtype=torch.uint8)  # 16 MiB, live with a: the peak
        del a, b
        torch.empty(8 * 2**20, dtype=torch.uint8)

    peak = memory._cpu_allocated_peak_mb(run)
    assert peak is not None and 48 <= peak < 48.5


def test_max_batch_finds_a_fitting_batch(capsys):
    # A generous budget for the tiny MLP: the search must double, then stop at the limit.
    # Each probe is a fresh process (~4 s here): five in all.
    assert bench.max_batch("mlp-b64", "float32", 10_000, small=True, limit=2) == 2
    assert bench.max_batch("mlp-b64", "float32", 0.001, small=True, limit=64) == 0
    args = ["bench", "mlp-b8192", "--small", "--modes", "float32,O2-bf16", "--max-batch",
            "100000", "--batch-limit", "1"]  # fmt: skip
    assert cli.main(args) == 0
    out = capsys.readouterr().out
    assert "largest batch within 100000 MB" in out and "O2-bf16" in out
