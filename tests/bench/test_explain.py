"""Why a mode buys little: the line under a workload's table, from stubbed timings and
profiles (what it says, not how fast anything is)."""

from __future__ import annotations

import types

import pytest
import torch

import mixprec as mp
from mixprec import bench, cli
from mixprec._hardware import Hardware
from mixprec._step_profile import StepProfile
from mixprec.bench import explain, runner

CPU = torch.device("cpu")


@pytest.fixture
def profiles(monkeypatch):
    """``profile_step`` answers from ``shares`` (mode: matmul share of its step), and
    records which modes it profiled; the CPU has fast bfloat16 and no fast float16."""
    shares: dict[str, float] = {}
    profiled: list[str] = []

    def profile_step(step, steps, device):
        profiled.append(step.mode)
        return StepProfile(ms=10.0, matmul_ms=10.0 * shares[step.mode])

    monkeypatch.setattr(explain, "profile_step", profile_step)
    monkeypatch.setattr(explain, "cpu_fast", lambda dtype: dtype == "bfloat16")
    return types.SimpleNamespace(shares=shares, profiled=profiled)


def steps_of(*modes):
    """Stub steps with the ``level`` that ``build_step`` gives each mode's step."""
    return {m: types.SimpleNamespace(mode=m, level=_level(m)) for m in modes}


def _level(mode):
    if mode.startswith(("float32", "torch-autocast")):
        return "-"  # the hand-written loops
    return "O2" if mode.startswith("auto") else mode[:2]


def test_an_overhead_bound_step_says_so_with_its_matmul_time(profiles):
    """Issue 35 item 4: "mlp-b64 auto-bf16: 0.96x" said nothing about why."""
    profiles.shares.update({"float32": 0.3 / 1.4, "auto-bf16": 0.1 / 1.46})
    ms = {"float32": 1.4, "auto-bf16": 1.46}
    lines, matmuls = explain.reasons(steps_of(*ms), ms, {"float32": 1.0, "auto-bf16": 0.96}, CPU)
    assert lines == {
        "auto-bf16": "mixed precision buys little here (0.96x): the step is overhead-bound, "
        "0.30 of 1.40 ms in matmuls, the only part 16-bit math speeds up; the other 1.10 ms "
        "(optimizer, casts, Python) grow to 1.36 ms in the mixed step. A larger batch or "
        "model gains."
    }
    # The profiled share, applied to the timed ms/step.
    assert matmuls == pytest.approx({"float32": 0.3, "auto-bf16": 0.1})


def test_other_measured_reasons(profiles):
    """A matmul-bound step: its 16-bit matmuls no faster, or faster with the rest of the
    step grown; a mode above the threshold, or in float32, gets no line and no profile."""
    profiles.shares.update({"float32": 0.8, "O1-bf16": 0.75, "O2-bf16": 0.2})
    ms = {"float32": 10.0, "O1-bf16": 10.0, "O2-bf16": 9.5, "O3-bf16": 5.0, "float32-checked": 11.0}
    speedups = {"float32": 1.0, "O1-bf16": 1.0, "O2-bf16": 1.05, "O3-bf16": 2.0,
                "float32-checked": 0.9}  # fmt: skip
    lines, _ = explain.reasons(steps_of(*ms), ms, speedups, CPU)
    assert lines == {
        "O1-bf16": "mixed precision buys little here (1.00x): its matmuls are hardly faster "
        "than float32's: 7.50 against 8.00 ms of a 10.00 ms float32 step",
        "O2-bf16": "mixed precision buys little here (1.05x): its matmuls took 1.90 ms against "
        "float32's 8.00, but the rest of its step (casts, float32 masters, optimizer) took "
        "7.60 ms against float32's 2.00",
    }
    assert sorted(profiles.profiled) == ["O1-bf16", "O2-bf16", "float32"]  # float32 once


def test_the_rest_of_the_step_names_only_what_the_mode_does(profiles, monkeypatch):
    """torch.autocast loops and O1 keep no float32 masters, yet their line blamed them;
    GradScaler and float16's dynamic scaling scale the loss."""
    monkeypatch.setattr(explain, "cpu_fast", lambda dtype: True)  # float16 profiled too
    modes = ["torch-autocast-bf16", "torch-autocast-scaler-bf16", "torch-autocast-fp16",
             "O1-bf16", "O3-bf16", "O2-fp16", "O2-bf16+compile"]  # fmt: skip
    profiles.shares.update({"float32": 0.8, **dict.fromkeys(modes, 0.2)})
    ms = {"float32": 10.0, **dict.fromkeys(modes, 9.5)}
    speedups = {"float32": 1.0, **dict.fromkeys(modes, 1.05)}
    lines, _ = explain.reasons(steps_of(*ms), ms, speedups, CPU)
    rest = {mode: line.split("rest of its step (")[1].split(")")[0] for mode, line in lines.items()}
    assert rest == {
        "torch-autocast-bf16": "casts, optimizer",
        "torch-autocast-scaler-bf16": "casts, loss scaling, optimizer",
        "torch-autocast-fp16": "casts, loss scaling, optimizer",
        "O1-bf16": "casts, optimizer",
        "O3-bf16": "casts, optimizer",
        "O2-fp16": "casts, float32 masters, loss scaling, optimizer",
        "O2-bf16+compile": "casts, float32 masters, optimizer",
    }


def test_emulated_16_bit_matmuls_are_the_reason_without_a_profile(profiles, monkeypatch):
    """On a CPU without fast bf16 the reason is that its bf16 matmuls are emulated."""
    monkeypatch.setattr(explain, "cpu_fast", lambda dtype: False)
    from mixprec import _hardware

    monkeypatch.setattr(_hardware, "_cpu_flags", lambda: frozenset({"avx2"}))  # no units
    ms = {"float32": 2.0, "O2-bf16": 7.0, "O2-fp16": 40.0, "O2-fp8": 9.0}
    speedups = {"float32": 1.0, "O2-bf16": 0.29, "O2-fp16": 0.05, "O2-fp8": 0.22}
    lines, matmuls = explain.reasons(steps_of(*ms), ms, speedups, CPU)
    assert lines == {
        "O2-bf16": "mixed precision buys little here (0.29x): bfloat16 matmuls are emulated "
        "on this CPU (no AVX512-BF16 or AMX): 7.00 ms a step against float32's 2.00 ms",
        "O2-fp16": "mixed precision buys little here (0.05x): float16 matmuls are emulated on "
        "this CPU (no AMX-FP16): 40.00 ms a step against float32's 2.00 ms",
        "O2-fp8": "mixed precision buys little here (0.22x): float8 matmuls are emulated on "
        "CPU (no float8 matrix units): 9.00 ms a step against float32's 2.00 ms",
    }
    assert matmuls == {} and profiles.profiled == []


def test_auto_that_picks_float32_says_so(profiles, monkeypatch):
    slow = Hardware("cpu", False, False, "CPU without AVX512-BF16 or AMX")
    monkeypatch.setattr("mixprec.policy.probe_hardware", lambda: slow)
    assert mp.Policy("auto").compute_dtype == torch.float32
    ms = {"float32": 2.0, "auto": 2.02}
    lines, _ = explain.reasons(steps_of(*ms), ms, {"float32": 1.0, "auto": 0.99}, CPU)
    assert lines == {
        "auto": "auto picks float32 here (CPU without AVX512-BF16 or AMX: no fast 16-bit "
        "matrix units; float32 is fastest): 0.99x, a float32 run"
    }
    assert profiles.profiled == []


def test_bench_prints_the_line_under_the_workloads_table(profiles, monkeypatch, capsys):
    """The whole command on a clock the test controls: float32 2 ms a step, O2-bf16
    1.9 ms (1.05x), torch-autocast-bf16 1 ms (2x); the profile says float32's step is a
    fifth matmuls."""
    now = [0.0]
    step_ms = {"float32": 2.0, "O2-bf16": 1.9, "torch-autocast-bf16": 1.0}

    def build_step(mode, work, device, **kwargs):
        def step():
            now[0] += step_ms[mode] / 1000
            return torch.tensor(1.0)

        step.mode = mode
        return step

    monkeypatch.setattr(runner, "build_step", build_step)
    monkeypatch.setattr(runner, "time", types.SimpleNamespace(perf_counter=lambda: now[0]))
    profiles.shares.update({"float32": 0.2, "O2-bf16": 0.1})
    argv = ["bench", "mlp-b64", "--modes", "float32,torch-autocast-bf16,O2-bf16", "--small",
            "--no-memory", "--repeats", "3", "--steps", "1", "--min-round-ms", "0"]  # fmt: skip
    assert cli.main(argv) == 0
    out = capsys.readouterr().out.splitlines()
    line = ("mlp-b64 O2-bf16: mixed precision buys little here (1.05x): the step is "
            "overhead-bound, 0.40 of 2.00 ms in matmuls, the only part 16-bit math speeds up; "
            "the other 1.60 ms (optimizer, casts, Python) grow to 1.71 ms in the mixed step. A "
            "larger batch or model gains.")  # fmt: skip
    workload = out.index("workload mlp-b64")
    assert out[workload + 6] == line  # header, rule, 3 rows, the line
    assert [x for x in out if "buys little here" in x] == [line]  # autocast's 2x: no line
    assert any(x.startswith("buys little: a 16-bit mode below 1.1x float32") for x in out)
    assert (
        out[0] == f"mixprec bench on {bench.device_description('auto')}, torch {torch.__version__}"
    )
