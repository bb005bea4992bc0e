"""``_step_profile``: the matmul time of a step, why a mixed step gains little, and a
run's memory by kind."""

from __future__ import annotations

import sys

import torch
from torch import nn

import mixprec as mp
from mixprec import _hardware
from mixprec._hardware import Hardware
from mixprec._step_profile import (
    StepProfile,
    matmul_ms,
    memory_parts,
    no_gain_line,
    other_work,
    profile_step,
    why_no_gain,
)


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


def test_a_step_profile_splits_one_set_of_calls():
    a = torch.randn(256, 256)
    prof = profile_step(lambda: (a @ a).relu().sum(), steps=3)
    assert 0 < prof.matmul_ms <= prof.ms and 0 < prof.matmul_share <= 1
    assert StepProfile(ms=0.0, matmul_ms=0.0).matmul_share == 0.0
    assert StepProfile(ms=1.0, matmul_ms=1.2).matmul_share == 1.0  # clock skew: capped


def test_no_gain_line_words_the_measured_reason():
    """Issue 35 item 4: one line with the measured reason, the same in ``mixprec train``
    and ``mixprec bench``. The overhead-bound wording is the one train prints."""
    line = no_gain_line(0.875, why_no_gain(1.4, 1.6, base_matmul_ms=0.3, mixed_matmul_ms=0.1))
    assert line == (
        "mixed precision buys little here (0.88x): the step is overhead-bound, 0.30 of 1.40 ms "
        "in matmuls, the only part 16-bit math speeds up; the other 1.10 ms (optimizer, casts, "
        "Python) grow to 1.50 ms in the mixed step. A larger batch or model gains."
    )
    # Without the mixed step's profile, or where its rest did not grow: they stay.
    assert why_no_gain(1.4, 1.3, base_matmul_ms=0.3).endswith(
        "the other 1.10 ms (optimizer, casts, Python) stay. A larger batch or model gains."
    )
    assert "stay." in why_no_gain(1.4, 1.3, base_matmul_ms=0.3, mixed_matmul_ms=0.2)
    assert why_no_gain(10.0, 9.0, base_matmul_ms=8.0, mixed_matmul_ms=7.0) == (
        "its matmuls are hardly faster than float32's: 7.00 against 8.00 ms of a 10.00 ms "
        "float32 step"
    )
    assert why_no_gain(10.0, 9.5, base_matmul_ms=8.0, mixed_matmul_ms=2.0) == (
        "its matmuls took 2.00 ms against float32's 8.00, but the rest of its step (casts, "
        "float32 masters, optimizer) took 7.50 ms against float32's 2.00"
    )
    emulated = "bfloat16 matmuls are emulated on this CPU (no AVX512-BF16 or AMX)"
    assert why_no_gain(2.0, 7.0, base_matmul_ms=1.0, emulated=emulated) == (
        emulated + ": 7.00 ms a step against float32's 2.00 ms"
    )


def test_the_rest_of_a_step_names_only_what_the_step_does():
    """The reason named "float32 masters" for every mode, a torch.autocast loop or O1 (no
    masters) included, and "float32's" for any baseline."""
    assert other_work(masters=True) == "casts, float32 masters, optimizer"
    assert other_work(masters=False) == "casts, optimizer"
    assert other_work(masters=False, loss_scaling=True) == "casts, loss scaling, optimizer"
    reason = why_no_gain(10.0, 9.5, base_matmul_ms=8.0, mixed_matmul_ms=2.0,
                         base="mixed_bfloat16 (O2)", rest=other_work(masters=False))  # fmt: skip
    assert reason == (
        "its matmuls took 2.00 ms against mixed_bfloat16 (O2)'s 8.00, but the rest of its "
        "step (casts, optimizer) took 7.50 ms against mixed_bfloat16 (O2)'s 2.00"
    )
    assert no_gain_line(1.05, "why", over="mixed_bfloat16 (O2)") == (
        "mixed precision buys little over mixed_bfloat16 (O2) here (1.05x): why"
    )


def test_slower_16bit_matmuls_are_said_slower_not_hardly_faster(monkeypatch):
    """Matmuls that got slower were "hardly faster" (bench: bfloat16's 8.31 against float32's
    1.78 ms) or, in an overhead-bound step, the "only part 16-bit math speeds up" (train:
    0.33 against 0.13 ms). The rest of the step is named where it grew too."""
    amx = Hardware("cpu", True, False, "CPU with amx_bf16, amx_tile, avx512_bf16")
    monkeypatch.setattr(_hardware, "probe_hardware", lambda: amx)
    assert why_no_gain(2.43, 16.30, base_matmul_ms=1.78, mixed_matmul_ms=8.31) == (
        "its matmuls are 4.7x slower than float32's: 8.31 against 1.78 ms of a 2.43 ms float32 "
        "step, and the rest of its step (casts, float32 masters, optimizer) took 7.99 ms against "
        "float32's 0.65"
    )
    assert why_no_gain(0.57, 0.78, base_matmul_ms=0.13, mixed_matmul_ms=0.33) == (
        "its matmuls are 2.5x slower than float32's: 0.33 against 0.13 ms of a 0.57 ms float32 step"
    )
    assert why_no_gain(10.0, 10.2, base_matmul_ms=8.0, mixed_matmul_ms=8.2).startswith(
        "its matmuls are no faster than float32's: 8.20 against 8.00 ms"
    )
    # A CPU-only machine without fast bfloat16 emulates them: said, against float32 only.
    avx2 = Hardware("cpu", False, False, "CPU without AVX512-BF16 or AMX")
    monkeypatch.setattr(_hardware, "probe_hardware", lambda: avx2)
    monkeypatch.setattr(_hardware, "_cpu_flags", lambda: frozenset({"avx2"}))
    assert why_no_gain(0.57, 0.78, base_matmul_ms=0.13, mixed_matmul_ms=0.33) == (
        "its matmuls are 2.5x slower than float32's, as 16-bit matmuls are emulated on this CPU "
        "(no AVX512-BF16 or AMX): 0.33 against 0.13 ms of a 0.57 ms float32 step"
    )
    over = why_no_gain(1.0, 1.1, base_matmul_ms=0.6, mixed_matmul_ms=0.9, base="mixed_float16 (O2)")
    assert over.startswith("its matmuls are 1.5x slower than mixed_float16 (O2)'s: 0.90 against")
    # With CUDA the step may have run on either device: no emulation is claimed.
    gpu = Hardware("cuda", True, True, "CUDA H100 (sm_90)")
    monkeypatch.setattr(_hardware, "probe_hardware", lambda: gpu)
    assert "emulated" not in why_no_gain(0.57, 0.78, base_matmul_ms=0.13, mixed_matmul_ms=0.33)
    # No matmuls in either step: overhead-bound, as before.
    assert why_no_gain(1.0, 1.2, base_matmul_ms=0.0, mixed_matmul_ms=0.0).startswith(
        "the step is overhead-bound, 0.00 of 1.00 ms in matmuls"
    )
