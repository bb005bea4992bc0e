"""The benchmark harness: every mode runs, the figures are well formed, outputs are written.
Speed targets are measured by `mixprec bench`, never asserted here."""

from __future__ import annotations

import json
import math

import pytest
import torch
import torch.nn.functional as F

import mixprec as mp
from mixprec import bench, cli


def tiny_workload() -> bench.Workload:
    """A custom workload, loaded as tests.test_bench:tiny_workload."""
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(16, 8, generator=g), torch.randint(0, 3, (16,), generator=g)
    return bench.Workload(
        "tiny", lambda: torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(),
                                            torch.nn.Linear(16, 3)),
        (x, y), F.cross_entropy, 16,
    )  # fmt: skip


@pytest.mark.parametrize("workload", ["mlp-b64", "mlp-b8192", "lm-d512", "cnn"])
def test_every_mode_runs_and_reports_well_formed_numbers(workload):
    modes = [m for m in bench.MODES if "fp16" not in m or workload == "mlp-b64"]
    results = bench.run(workload, modes, repeats=1, steps=1, warmup=1, memory=False, small=True,
                        min_round_ms=0)  # fmt: skip
    assert [r.mode for r in results] == modes
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
    # Accuracy is not traded: mixed modes with float32 masters end where float32 does
    # (bfloat16 rounding over three SGD steps: 2 warm-up, 1 timed; measured below 0.005).
    for r in results:
        masters_or_autocast = ("O1-bf16", "O2-bf16", "auto-bf16", "torch-autocast-bf16",
                               "torch-autocast-scaler-bf16")  # fmt: skip
        if r.mode in masters_or_autocast:
            assert abs(r.final_loss - base.final_loss) < 0.05, r.mode


@pytest.mark.parametrize("workload", ["mlp-b64", "lm-d512"])
def test_16_bit_outputs_train_like_float32_outputs(workload):
    # --outputs-16bit: the mixed models return bfloat16 and the loss still computes in
    # float32 from it, so the losses match the default run's (same arithmetic, only the
    # output's rounding to bfloat16 differs; measured below 0.005).
    modes = ["float32", "torch-autocast-bf16", "O2-bf16", "auto-bf16"]
    kwargs = {"repeats": 1, "steps": 1, "warmup": 1, "memory": False, "small": True,
              "min_round_ms": 0}  # fmt: skip
    default = bench.run(workload, modes, **kwargs)
    sixteen = bench.run(workload, modes, outputs_16bit=True, **kwargs)
    for a, b in zip(default, sixteen, strict=True):
        assert a.mode == b.mode and abs(a.final_loss - b.final_loss) < 0.02, a.mode
    assert default[0].final_loss == sixteen[0].final_loss  # float32 is untouched


def test_outputs_16bit_from_the_command_line_are_recorded_in_the_json(tmp_path):
    out_json = tmp_path / "b.json"
    args = ["bench", "mlp-b64", "--small", "--modes", "float32,O2-bf16", "--outputs-16bit",
            "--no-memory", "--repeats", "1", "--steps", "1", "--warmup", "1",
            "--min-round-ms", "0", "--json", str(out_json)]  # fmt: skip
    assert cli.main(args) == 0
    assert json.loads(out_json.read_text())["outputs_16bit"] is True


def test_outputs_16bit_reach_the_loss_in_bfloat16(monkeypatch):
    seen: list[torch.dtype] = []
    work = bench.get_workload("mlp-b64", small=True)
    loss_fn = work.loss_fn

    def spy(out, y):
        seen.append(out.dtype)
        return loss_fn(out, y)

    work = bench.Workload(work.name, work.make_model, work.batch, spy, work.samples)
    for outputs_16bit in (False, True):
        bench.build_step("O2-bf16", work, torch.device("cpu"), outputs_16bit=outputs_16bit)()
        bench.build_step("torch-autocast-bf16", work, torch.device("cpu"),
                         outputs_16bit=outputs_16bit)()  # fmt: skip
    assert seen == [torch.float32, torch.float32, torch.bfloat16, torch.bfloat16]


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

    monkeypatch.setattr(bench, "build_step", fake_step)
    monkeypatch.setattr(bench.time, "perf_counter", lambda: now[0])
    results = bench.run("mlp-b64", ["float32", "O2-bf16"], repeats=2, steps=1, warmup=1,
                        memory=False, small=True, min_round_ms=50.0)  # fmt: skip
    # 2 warm-up steps each, then 2 rounds of ceil(50 / 2) = 25 steps each.
    assert calls == {"float32": 2 + 2 * 25, "O2-bf16": 2 + 2 * 25}
    by_mode = {r.mode: r for r in results}
    assert by_mode["float32"].ms_per_step == pytest.approx(2.0)
    assert by_mode["O2-bf16"].ms_per_step == pytest.approx(5.0)


def test_peak_memory_is_measured_per_mode():
    results = bench.run("mlp-b64", ["float32", "O2-bf16"], repeats=1, steps=1, warmup=1,
                        memory=True, small=True)  # fmt: skip
    for r in results:
        assert r.peak_mb is not None and r.peak_mb > 0


def test_custom_workload_json_and_plot(tmp_path, capsys):
    out_json, out_png = tmp_path / "b.json", tmp_path / "b.png"
    args = ["bench", "tests.test_bench:tiny_workload", "--modes", "float32,O2-bf16,O1-fp16",
            "--repeats", "2", "--steps", "1", "--warmup", "1", "--no-memory",
            "--json", str(out_json), "--plot", str(out_png)]  # fmt: skip
    assert cli.main(args) == 0
    out = capsys.readouterr().out
    assert "workload tests.test_bench:tiny_workload" in out and "O2-bf16" in out
    data = json.loads(out_json.read_text())
    rows = data["results"]["tests.test_bench:tiny_workload"]
    assert [r["mode"] for r in rows] == ["float32", "O2-bf16", "O1-fp16"]
    assert rows[0]["speedup"] == 1.0 and rows[1]["level"] == "O2"
    assert data["outputs_16bit"] is False
    assert out_png.read_bytes()[:4] == b"\x89PNG"


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["bench", "resnet50"], "unknown workload 'resnet50'"),
        (["bench", "mlp-b64", "--modes", "O4-bf16"], "unknown mode 'O4-bf16'"),
        (["bench", "mlp-b64", "--repeats", "0"], "--repeats must be >= 1, got 0"),
        (["bench", "mlp-b64", "--min-round-ms", "-1"], "must be >= 0, got 2 and -1.0"),
    ],
)
def test_bench_errors(args, message, capsys):
    assert cli.main(args) == 2
    assert message in capsys.readouterr().err


def test_build_step_rejects_unknown_mode():
    with pytest.raises(ValueError, match="unknown mode 'fast'"):
        bench.build_step("fast", bench.get_workload("mlp-b64", small=True), torch.device("cpu"))


def test_max_batch_finds_a_fitting_batch(capsys):
    # A generous budget for the tiny MLP: the search must double, then stop at the limit.
    assert bench.max_batch("mlp-b64", "float32", 10_000, small=True, limit=4) == 4
    assert bench.max_batch("mlp-b64", "float32", 0.001, small=True, limit=64) == 0
    args = ["bench", "mlp-b8192", "--small", "--modes", "float32,O2-bf16", "--max-batch",
            "100000", "--batch-limit", "2"]  # fmt: skip
    assert cli.main(args) == 0
    out = capsys.readouterr().out
    assert "largest batch within 100000 MB" in out and "O2-bf16" in out


def test_lm_flops_counts_matrix_weights_and_attention():
    model = bench.CausalLM(vocab=50, d_model=16, n_layers=2, n_heads=2, max_len=8)
    # Per block: qkv 16*48+48, out 16*16+16, mlp 16*64+64 + 64*16+16, two LayerNorms 4*16;
    # then the final LayerNorm 2*16 and the head 16*50+50. Embeddings (50*16, 8*16) excluded.
    block = (16 * 48 + 48) + (16 * 16 + 16) + (16 * 64 + 64) + (64 * 16 + 16) + 4 * 16
    weights = 2 * block + 2 * 16 + 16 * 50 + 50
    tokens, length = 4 * 8, 8
    expected = 6 * weights * tokens + 12 * 2 * 16 * length * tokens
    assert bench.lm_flops(model, tokens, length) == expected


def test_tflops_and_mfu_are_reported_for_the_lm(monkeypatch):
    monkeypatch.setattr(bench, "peak_tflops", lambda device, kind: 2.0 if kind else None)
    results = bench.run("lm-d512", ["float32", "O2-bf16"], repeats=1, steps=1, warmup=1,
                        memory=False, small=True)  # fmt: skip
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


def test_cpu_allocator_peak_counts_tensor_memory():
    def run() -> None:
        a = torch.empty(32 * 2**20, dtype=torch.uint8)  # 32 MiB
        b = torch.empty(16 * 2**20, dtype=torch.uint8)  # 16 MiB, live with a: the peak
        del a, b
        torch.empty(8 * 2**20, dtype=torch.uint8)

    peak = bench._cpu_allocated_peak_mb(run)
    assert peak is not None and 48 <= peak < 48.5


def test_the_scaler_bf16_loop_skips_a_non_finite_step_and_the_plain_one_does_not():
    base = tiny_workload()
    calls = {"n": 0}

    def loss_inf_once(out, y):
        calls["n"] += 1
        loss = F.cross_entropy(out.float(), y)
        return loss * float("inf") if calls["n"] == 1 else loss

    work = bench.Workload("tiny", base.make_model, base.batch, loss_inf_once, 16)
    for mode, survives in (("torch-autocast-scaler-bf16", True), ("torch-autocast-bf16", False)):
        calls["n"] = 0
        step = bench.build_step(mode, work, torch.device("cpu"))
        step()  # inf loss: inf/NaN gradients
        assert math.isfinite(step().item()) is survives, mode


def test_compiled_modes_report_compile_time_apart():
    modes = bench.with_compiled(["float32", "O2-bf16"])
    assert modes == ["float32", "O2-bf16", "float32+compile", "O2-bf16+compile"]
    results = bench.run("mlp-b64", modes, repeats=1, steps=1, warmup=2, memory=False,
                        small=True, min_round_ms=0)  # fmt: skip
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
