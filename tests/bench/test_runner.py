"""The benchmark's runs: every mode runs and its figures are well formed, rounds are
timed in turns and paired against float32, the run's arguments are checked. Speed targets are
measured by `mixprec bench`, never asserted here."""

from __future__ import annotations

import json
import math
import sys

import pytest
import torch

import mixprec as mp
from mixprec import bench, cli
from mixprec._device import resolve_device
from mixprec.bench import runner


@pytest.mark.parametrize("workload", ["mlp-b64", "mlp-b8192", "lm-d512", "cnn"])
def test_every_mode_runs_and_reports_well_formed_numbers(workload):
    modes = [m for m in bench.MODES if "fp16" not in m or workload == "mlp-b64"]
    torch.manual_seed(1234)
    caller = torch.get_rng_state()
    results = bench.run(workload, modes, repeats=1, steps=1, warmup=1, memory=False, small=True,
                        min_round_ms=0)  # fmt: skip
    # It seeded its models with manual_seed(0), and left the caller's run reseeded.
    assert torch.equal(torch.get_rng_state(), caller)
    assert [r.mode for r in results] == modes
    counted = resolve_device("auto").type == "cpu" and sys.platform != "win32"
    base = results[0]
    assert base.mode == "float32" and base.speedup == 1.0
    for r in results:
        assert r.ms_per_step > 0 and r.samples_per_s > 0 and math.isfinite(r.speedup)
        assert math.isfinite(r.final_loss)
        baseline = r.mode == "float32" or r.mode.startswith("torch")
        expected = {"O1": "O1", "O2": "O2", "O3": "O3", "auto": "O2"}
        if r.mode == "auto":  # the hardware's policy: O0 where it picks float32
            assert r.level == ("O2" if mp.Policy("auto").is_mixed else "O0")
        else:
            assert r.level == ("-" if baseline else expected[r.mode.split("-")[0]])
        if workload == "lm-d512":
            assert r.tokens_per_s is not None and r.tokens_per_s > 0
        # On CPU (not Windows) each mode's rounds count their page faults and the kernel's
        # share of their CPU time (bench.faults); elsewhere nothing is counted.
        if counted:
            assert r.page_faults is not None and r.kernel_share is not None, r.mode
            assert 0 <= r.kernel_share <= 1, r.mode
        else:
            assert r.page_faults is None and r.kernel_share is None, r.mode
    # Accuracy is not traded: mixed modes with float32 masters end where float32 does
    # (bfloat16 rounding over three SGD steps: 2 warm-up, 1 timed; measured below 0.005).
    for r in results:
        masters_or_autocast = ("O1-bf16", "O2-bf16", "auto-bf16", "torch-autocast-bf16",
                               "torch-autocast-scaler-bf16")  # fmt: skip
        if r.mode in masters_or_autocast:
            assert abs(r.final_loss - base.final_loss) < 0.05, r.mode
    # Each 16-bit mode below the gain threshold says why, measured; the others say nothing.
    for r in results:
        sixteen = r.mode != "float32" and (r.mode != "auto" or mp.Policy("auto").is_mixed)
        if sixteen and r.speedup < 1.1:
            assert r.no_gain is not None and r.no_gain.startswith(
                f"mixed precision buys little here ({r.speedup:.2f}x): "
            ), r.mode
        elif r.mode != "auto":
            assert r.no_gain is None, r.mode


@pytest.mark.parametrize("workload", ["mlp-b64", "lm-d512"])
def test_16_bit_outputs_train_like_float32_outputs(workload):
    # --outputs-16bit: the mixed models return bfloat16 and the loss still computes in
    # float32 from it, so the losses match the default run's (same arithmetic, only the
    # output's rounding to bfloat16 differs; measured below 0.005).
    modes = ["float32", "torch-autocast-bf16", "O2-bf16", "auto-bf16"]
    kwargs = {"repeats": 1, "steps": 1, "warmup": 1, "memory": False, "small": True,
              "min_round_ms": 0, "explain": False}  # fmt: skip
    default = bench.run(workload, modes, **kwargs)
    sixteen = bench.run(workload, modes, outputs_16bit=True, **kwargs)
    for a, b in zip(default, sixteen, strict=True):
        assert a.mode == b.mode and abs(a.final_loss - b.final_loss) < 0.02, a.mode
    assert default[0].final_loss == sixteen[0].final_loss  # float32 is untouched


def test_rounds_last_at_least_min_round_ms(monkeypatch):
    """On a clock the test controls (steps of 2 and 5 ms), so that it holds on any machine:
    a round is as many steps as the fastest mode needs to last min_round_ms, for every
    mode alike, and ms/step is measured on that clock."""
    now = [0.0]
    calls: dict[str, int] = {}

    def fake_step(mode, work, device, **kwargs):
        def step():
            calls[mode] = calls.get(mode, 0) + 1
            now[0] += {"float32": 0.002, "O2-bf16": 0.005}[mode]
            return torch.tensor(1.0)

        return step

    monkeypatch.setattr(runner, "build_step", fake_step)
    monkeypatch.setattr(runner.time, "perf_counter", lambda: now[0])
    results = bench.run("mlp-b64", ["float32", "O2-bf16"], repeats=2, steps=1, warmup=1,
                        memory=False, small=True, min_round_ms=50.0, explain=False)  # fmt: skip
    # 2 warm-up steps each, then 2 rounds of ceil(50 / 2) = 25 steps each.
    assert calls == {"float32": 2 + 2 * 25, "O2-bf16": 2 + 2 * 25}
    by_mode = {r.mode: r for r in results}
    assert by_mode["float32"].ms_per_step == pytest.approx(2.0)
    assert by_mode["O2-bf16"].ms_per_step == pytest.approx(5.0)


def test_rounds_alternate_direction_and_the_speedup_pairs_them(monkeypatch):
    calls: list[str] = []

    def step_of(name: str):
        def step() -> torch.Tensor:
            calls.append(name)
            return torch.zeros(())

        return step

    built = {m: step_of(m) for m in ("float32", "O1-bf16", "O2-bf16")}
    runner._time_modes(built, repeats=2, steps=1, warmup=2, dev=torch.device("cpu"),
                      min_round_ms=0)  # fmt: skip
    warm = ["float32"] * 2 + ["O1-bf16"] * 2 + ["O2-bf16"] * 2
    assert calls == [*warm, "float32", "O1-bf16", "O2-bf16", "O2-bf16", "O1-bf16", "float32"]
    # Load late in the run (the mode's rounds 3-5, float32's 4-5): the medians of each
    # (1 ms, 10 ms) would say 0.1x; the median of the rounds' own ratios says 0.5x.
    times = {"float32": [1.0, 1.0, 1.0, 9.0, 9.0], "O2-bf16": [2.0, 2.0, 10.0, 10.0, 10.0]}
    last = {m: torch.tensor(1.0) for m in times}
    monkeypatch.setattr(runner, "build_step", lambda mode, *a, **k: step_of(mode))
    monkeypatch.setattr(
        runner, "_time_modes", lambda *a, **k: (times, last, dict.fromkeys(times, 1.0))
    )
    results = bench.run("mlp-b64", ["O2-bf16"], memory=False, small=True, explain=False)
    assert [(r.mode, r.ms_per_step, r.speedup) for r in results] == [
        ("float32", 1.0, 1.0),
        ("O2-bf16", 10.0, 0.5),
    ]


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["bench", "resnet50"], "unknown workload 'resnet50'"),
        (["bench", "mlp-b64", "--modes", "O4-bf16"], "unknown mode 'O4-bf16'"),
        (["bench", "mlp-b64", "--repeats", "0"], "--repeats must be >= 1, got 0"),
        (["bench", "mlp-b64", "--min-round-ms", "-1"], "finite number >= 0, got 2 and -1"),
    ],
)
def test_bench_errors(args, message, capsys):
    assert cli.main(args) == 2
    assert message in capsys.readouterr().err


def test_tflops_and_mfu_are_reported_for_the_lm(monkeypatch):
    monkeypatch.setattr(runner, "peak_tflops", lambda device, kind: 2.0 if kind else None)
    results = bench.run("lm-d512", ["float32", "O2-bf16"], repeats=1, steps=1, warmup=1,
                        memory=False, small=True, explain=False)  # fmt: skip
    work = bench.get_workload("lm-d512", small=True)
    for r in results:
        assert r.tflops == pytest.approx(work.flops / r.ms_per_step / 1e9)
        assert r.mfu == pytest.approx(r.tflops / 2.0)
    assert "TFLOP/s" in bench.table("lm-d512", results) and "MFU" in bench.table("lm", results)


def test_no_peak_and_no_mfu_on_cpu():
    assert bench.peak_tflops(torch.device("cpu"), "bfloat16") is None
    results = bench.run("lm-d512", ["float32"], repeats=1, steps=1, warmup=1, memory=False,
                        device="cpu", small=True)  # fmt: skip
    assert results[0].tflops is not None and results[0].tflops > 0 and results[0].mfu is None


def test_compiled_modes_report_compile_time_apart():
    modes = bench.with_compiled(["float32", "O2-bf16"])
    assert modes == ["float32", "O2-bf16", "float32+compile", "O2-bf16+compile"]
    results = bench.run("mlp-b64", modes, repeats=1, steps=1, warmup=2, memory=False,
                        small=True, min_round_ms=0, explain=False)  # fmt: skip
    by_mode = {r.mode: r for r in results}
    assert by_mode["float32"].compile_s is None and by_mode["O2-bf16"].compile_s is None
    for mode in ("float32", "O2-bf16"):
        compiled = by_mode[mode + bench.COMPILED]
        assert compiled.compile_s is not None and compiled.compile_s > 0
        assert compiled.level == by_mode[mode].level
        # The same three SGD steps from the same weights: only inductor's summation order
        # differs (bfloat16's rounding of it included), far below a training difference.
        assert compiled.final_loss == pytest.approx(by_mode[mode].final_loss, rel=2e-3)
    assert "compile s" in bench.table("mlp-b64", results)
    with pytest.raises(ValueError, match=r"unknown mode 'O9\+compile'; valid: float32"):
        bench.check_mode("O9+compile")


def test_float32_checked_is_an_opt_in_baseline_that_trains_as_float32():
    # Float32 skipping non-finite steps by hand: what the check costs any loop.
    assert "float32-checked" not in bench.MODES and bench.check_mode("float32-checked+compile")
    results = bench.run("mlp-b64", ["float32-checked", "auto"], repeats=1, steps=2, warmup=2,
                        memory=False, small=True, min_round_ms=0, explain=False)  # fmt: skip
    losses = {r.mode: r.final_loss for r in results}
    assert losses["float32-checked"] == losses["float32"]
    if not mp.Policy("auto").is_mixed:  # float32 here: mixprec's step is the same SGD
        assert losses["auto"] == losses["float32"]


# float8 modes (issue 16 item 7). CPU float8 matmuls are emulated and slow: the tiny LM
# (--small: one block at d=64), one step timed, and at most one compiled float8 graph.


@pytest.mark.float8_rowwise
def test_float8_modes_convert_the_lm_blocks_and_report_them(capsys):
    pytest.importorskip("torchao")
    modes = ["float32", "O2-bf16", *bench.FLOAT8_MODES]
    results = bench.run("lm-d512", modes, repeats=1, steps=1, warmup=1, memory=False,
                        small=True, min_round_ms=0, explain=False)  # fmt: skip
    by_mode = {r.mode: r for r in results}
    assert [r.mode for r in results] == modes
    for mode in modes:
        r = by_mode[mode]
        assert r.ms_per_step > 0 and r.tokens_per_s is not None and r.tokens_per_s > 0
        if mode in bench.FLOAT8_MODES:
            # Every Linear of the block (qkv, out, two MLP) in float8; the head, the fifth
            # Linear, stays bfloat16. torchao's own size rule converts none at d=64.
            assert (r.level, r.float8_layers, r.linear_layers) == ("O2", 4, 5), mode
            # float8 E4M3/E5M2 rounding over three SGD steps from the same weights: the loss
            # stays within 0.05 of float32's (measured below 0.01 for the three recipes).
            assert abs(r.final_loss - by_mode["float32"].final_loss) < 0.05, mode
        else:
            assert r.float8_layers is None and r.linear_layers is None
    text = bench.table("lm-d512", results)
    assert " fp8 " in text.splitlines()[1] and " 4/5 " in text
    for mode in bench.FLOAT8_MODES:
        assert f"{mode}: " in text and "x the tokens/s of O2-bf16" in text


def test_the_speedup_keeps_the_lowest_and_highest_round_ratio(monkeypatch):
    """Issue 33 item 12: only the median ratio was kept, so the chart could not show how far
    the rounds were apart."""
    times = {"float32": [1.0, 1.0, 1.0, 9.0, 9.0], "O2-bf16": [2.0, 0.8, 10.0, 10.0, 10.0]}
    last = {m: torch.tensor(1.0) for m in times}
    monkeypatch.setattr(runner, "build_step", lambda mode, *a, **k: lambda: torch.zeros(()))
    monkeypatch.setattr(
        runner, "_time_modes", lambda *a, **k: (times, last, dict.fromkeys(times, 1.0))
    )
    base, mixed = bench.run("mlp-b64", ["O2-bf16"], memory=False, small=True, explain=False)
    assert (base.speedup_min, base.speedup, base.speedup_max) == (1.0, 1.0, 1.0)
    assert (mixed.speedup_min, mixed.speedup, mixed.speedup_max) == (0.1, 0.9, 1.25)
    assert json.loads(bench.to_json({"w": [base, mixed]}))["results"]["w"][1]["speedup_max"] == 1.25


def test_a_mode_named_twice_runs_once_and_progress_counts_every_unit(monkeypatch):
    """Issue 32 item 10: duplicate modes printed duplicate rows. Issue 33 item 9: ``run``
    reports each unit of its work (warm-up, rounds, memory probe of every mode)."""
    monkeypatch.setattr(runner, "build_step", lambda mode, *a, **k: lambda: torch.zeros(()))
    done: list[str] = []
    results = bench.run("mlp-b64", ["O2-bf16", "O2-bf16", "auto"], repeats=2, steps=1,
                        warmup=1, memory=False, small=True, min_round_ms=0,
                        progress=done.append)  # fmt: skip
    assert [r.mode for r in results] == ["float32", "O2-bf16", "auto"]
    assert done[:-1] == [
        "float32: warm-up", "O2-bf16: warm-up", "auto: warm-up",
        "float32: round 1/2", "O2-bf16: round 1/2", "auto: round 1/2",
        "auto: round 2/2", "O2-bf16: round 2/2", "float32: round 2/2",
    ]  # fmt: skip
    # Then the matmul profiles behind the reasons of the modes that buy little (one unit).
    assert done[-1] in ("matmul profiles", "no matmul profile needed")
    assert bench.run_units(["O2-bf16", "O2-bf16", "auto"], 2, memory=False) == len(done)
    assert bench.run_units(["float32", "auto"], 5, memory=True) == 2 * 7 + 1
    assert bench.run_units(["float32", "auto"], 5, memory=True, explain=False) == 2 * 7


def test_each_mode_is_paired_with_plain_autocast_in_its_dtype(monkeypatch):
    """Issue 30 item 5: each mode's ratio to plain autocast (bfloat16: no GradScaler;
    float16: with one), the median of the rounds' own ratios as for float32, where the
    peer ran."""
    times = {
        "float32": [4.0, 4.0, 4.0],
        "torch-autocast-bf16": [2.0, 2.0, 4.0],
        "O2-bf16": [1.0, 2.5, 8.0],  # against the peer: 2.0, 0.8, 0.5
        "torch-autocast-scaler-bf16": [2.0, 2.0, 4.0],
        "O1-fp16": [3.0, 3.0, 3.0],  # its peer, torch-autocast-fp16, did not run
        "float32-checked": [4.0, 4.0, 4.0],
    }
    last = {m: torch.tensor(1.0) for m in times}
    monkeypatch.setattr(runner, "build_step", lambda mode, *a, **k: lambda: torch.zeros(()))
    monkeypatch.setattr(
        runner, "_time_modes", lambda *a, **k: (times, last, dict.fromkeys(times, 1.0))
    )
    results = bench.run("mlp-b64", list(times), memory=False, small=True, explain=False)
    got = {r.mode: (r.autocast_peer, r.vs_autocast) for r in results}
    assert got == {
        "float32": (None, None),
        "torch-autocast-bf16": (None, None),  # a peer is not compared with itself
        "O2-bf16": ("torch-autocast-bf16", 0.8),
        "torch-autocast-scaler-bf16": ("torch-autocast-bf16", 1.0),
        "O1-fp16": (None, None),
        "float32-checked": (None, None),
    }
    text = bench.table("mlp-b64", results)
    assert " vs autocast " in text.splitlines()[1]
    row = next(line for line in text.splitlines() if line.startswith("O2-bf16 "))
    assert "  1.60x       0.80x " in row  # vs f32 (median of 4, 1.6, 0.5), vs autocast
    row = next(line for line in text.splitlines() if line.startswith("O1-fp16 "))
    assert "  1.33x           - " in row
    # Without a peer in the run, no column.
    alone = [r for r in results if r.mode in ("float32", "O1-fp16")]
    for r in alone:
        r.vs_autocast = None
    assert "vs autocast" not in bench.table("mlp-b64", alone)


def test_autocast_peers_are_run_the_same_way():
    assert bench.autocast_peer("O2-bf16+compile") == "torch-autocast-bf16+compile"
    assert bench.autocast_peer("auto-fp16") == "torch-autocast-fp16"
    assert bench.autocast_peer("O2-fp8") == "torch-autocast-bf16"  # float8: against bf16
    assert bench.autocast_peer("float32+compile") is None
    # A peer is not its own: "vs autocast 1.00x" against itself said nothing.
    assert bench.autocast_peer("torch-autocast-bf16") is None
    assert bench.autocast_peer("torch-autocast-fp16+compile") is None
    assert bench.autocast_peer("torch-autocast-scaler-bf16") == "torch-autocast-bf16"
    assert bench.autocast_peer("auto") == (
        None if mp.Policy("auto").compute_dtype == torch.float32 else "torch-autocast-bf16"
    )


def test_an_unknown_compile_mode_is_refused_before_any_work(monkeypatch):
    """Issue 32 item 13: torch refused it at the first compiled step, deep in dynamo."""
    monkeypatch.setattr(runner, "build_step", lambda *a, **k: pytest.fail("work started"))
    with pytest.raises(ValueError, match="unknown compile mode 'bogus'; torch.compile's modes"):
        bench.run("mlp-b64", ["O2-bf16+compile"], compile_mode="bogus", small=True)
    valid = bench.compile_modes()
    assert {"default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs"} <= set(
        valid
    )
    assert bench.check_compile_mode("max-autotune") == "max-autotune"


def test_compiled_modes_get_room_past_dynamos_eight_versions(monkeypatch):
    """Every mode's step shares one code object, of which dynamo compiles 8 versions: from
    the 9th compiled mode on, a '+compile' mode ran eagerly under its label."""
    limits: list[int] = []

    def step_of(mode, *args, **kwargs):
        def step() -> torch.Tensor:
            limits.append(torch._dynamo.config.recompile_limit)  # read while timed
            return torch.zeros(())

        return step

    monkeypatch.setattr(runner, "build_step", step_of)
    base = ["torch-autocast-bf16", "O1-bf16", "O2-bf16", "O3-bf16", "auto-bf16", "O1-fp16",
            "O2-fp16", "auto-fp16", "auto"]  # fmt: skip
    modes = [f"{m}{bench.COMPILED}" for m in base]
    bench.run("mlp-b64", modes, repeats=1, steps=1, warmup=0, memory=False, small=True,
              min_round_ms=0, explain=False)  # fmt: skip
    default = torch._dynamo.config.recompile_limit
    assert limits and min(limits) >= default + len(modes)
