"""``_step_profile``: the matmul time of a step, and a run's memory by kind."""

from __future__ import annotations

import sys

import torch
from torch import nn

import mixprec as mp
from mixprec._step_profile import matmul_ms, memory_parts


def test_matmul_time_counts_matmuls_and_nothing_else(capfd):
    a = torch.randn(256, 256)
    v = torch.randn(1 << 16)
    assert matmul_ms(lambda: a @ a) > 0
    assert matmul_ms(lambda: (v * 2).sum()) == 0  # elementwise work only
    print("after", file=sys.stderr)
    err = capfd.readouterr().err
    assert "profiler_start" not in err and "after" in err  # kineto's lines hidden, fd restored


def test_memory_parts_of_a_float32_and_an_o2_run():
    model = nn.Sequential(nn.Linear(16, 32), nn.LayerNorm(32), nn.Linear(32, 4))
    n = sum(p.numel() for p in model.parameters())
    opt = torch.optim.Adam(model.parameters())
    model(torch.randn(8, 16)).sum().backward()
    opt.step()
    parts = memory_parts(model, opt)
    assert (parts.weights, parts.masters, parts.gradients) == (4 * n, 0, 4 * n)
    assert parts.optimizer_state == 2 * 4 * n + 4 * len(list(model.parameters()))  # moments, step
    assert parts.weights_dtypes == ("float32",)

    mp.auto_mixed_precision(model, "mixed_bfloat16", "O2")
    opt = mp.LossScaleOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    half = sum(p.numel() for p in model.parameters() if p.dtype == torch.bfloat16)
    parts = memory_parts(model, opt)
    assert parts.masters == 4 * half  # a float32 copy of each bfloat16 weight, nothing more
    assert parts.weights == 2 * half + 4 * (n - half)
    assert parts.weights_dtypes == ("bfloat16", "float32")
    assert "float32 masters" in parts.describe()
