"""The benchmark's peak-memory probes: per mode in a fresh process, the CPU allocator's
peak, and the largest batch within a budget."""

from __future__ import annotations

import torch

from mixprec import bench, cli
from mixprec.bench import memory
from tests.bench._fake_pool import fake_pool


def test_peak_memory_is_measured_per_mode():
    results = bench.run("mlp-b64", ["float32", "O2-bf16"], repeats=1, steps=1, warmup=1,
                        memory=True, small=True, explain=False)  # fmt: skip
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


def test_max_batch_reports_each_probe(monkeypatch):
    """Issue 33 item 9: the search ran minutes of probes without a word. On a fake
    fresh-process pool whose step peaks at 1 MB a sample: what each probe found."""

    fake_pool(monkeypatch, 1.0)
    probes: list[tuple[int, bool]] = []
    found = bench.max_batch("mlp-b64", "float32", 10, small=True, limit=64,
                            progress=lambda batch, fits: probes.append((batch, fits)))  # fmt: skip
    assert found == 10
    assert probes == [(1, True), (2, True), (4, True), (8, True), (16, False), (12, False),
                      (10, True), (11, False)]  # fmt: skip
