"""The benchmark harness: every mode runs, the figures are well formed, outputs are written.
Speed targets are measured by `mixprec bench`, never asserted here."""

from __future__ import annotations

import json
import math
import sys

import pytest
import torch
import torch.nn.functional as F

import mixprec as mp
from mixprec import bench, cli
from mixprec._hardware import Hardware


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
    # Each probe is a fresh process (~4 s here): five in all.
    assert bench.max_batch("mlp-b64", "float32", 10_000, small=True, limit=2) == 2
    assert bench.max_batch("mlp-b64", "float32", 0.001, small=True, limit=64) == 0
    args = ["bench", "mlp-b8192", "--small", "--modes", "float32,O2-bf16", "--max-batch",
            "100000", "--batch-limit", "1"]  # fmt: skip
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


# float8 modes (issue 16 item 7). CPU float8 matmuls are emulated and slow: the tiny LM
# (--small: one block at d=64), one step timed, and at most one compiled float8 graph.


def test_float8_modes_convert_the_lm_blocks_and_report_them(capsys):
    pytest.importorskip("torchao")
    modes = ["float32", "O2-bf16", *bench.FLOAT8_MODES]
    results = bench.run("lm-d512", modes, repeats=1, steps=1, warmup=1, memory=False,
                        small=True, min_round_ms=0)  # fmt: skip
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


def test_float8_modes_match_the_float8_policies():
    assert sorted(bench.FLOAT8_MODES.values()) == sorted(mp.policy.FLOAT8_PRESETS)
    assert not set(bench.FLOAT8_MODES) & set(bench.MODES)  # opt-in: not in the default list
    assert bench.mode_for_policy("mixed_float8_rowwise") == "O2-fp8-rowwise"
    with pytest.raises(ValueError, match="policy 'mixed_float8' is mode 'O2-fp8'"):
        bench.check_mode("mixed_float8")


def test_float8_layer_choice_follows_the_workload_or_the_override():
    pytest.importorskip("torchao")
    work, cpu = bench.get_workload("lm-d512", small=True), torch.device("cpu")
    assert work.float8 == mp.Float8Options(min_features=64)  # d_model: all block Linears
    assert bench.build_step("O2-fp8", work, cpu).float8 == (4, 5)
    torchao_rule = bench.build_step("O2-fp8-rowwise", work, cpu, float8=mp.Float8Options())
    assert torchao_rule.float8 == (0, 5)
    # The MLP keeps torchao's thresholds (784->512 is below them): no float8 layer.
    mlp_step = bench.build_step("O2-fp8", bench.get_workload("mlp-b64"), cpu)
    assert mlp_step.float8 == (0, 3)


def test_auto_never_picks_float8():
    """`auto` is the hardware's bfloat16/float16/float32 choice: float8 only when asked."""
    step = bench.build_step("auto", bench.get_workload("lm-d512", small=True), torch.device("cpu"))
    assert step.float8 is None
    assert mp.Policy("auto").float8_recipe is None


def test_one_compiled_float8_mode_runs_and_trains_as_eager(monkeypatch):
    """The bench's wiring of O2-fp8+compile: the compiled forward and loss, the layers
    converted, compile time apart. AOTAutograd's graphs run eagerly (``aot_eager``) to keep
    this test near a second; inductor's code for torchao's float8 is test_float8's."""
    pytest.importorskip("torchao")
    monkeypatch.setattr(
        bench, "compile_step", lambda fn, options, model: torch.compile(fn, backend="aot_eager")
    )
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(32, 16, generator=g), torch.randint(0, 4, (32,), generator=g)
    work = bench.Workload(
        "tiny-fp8", lambda: torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(),
                                                torch.nn.Linear(32, 16), torch.nn.ReLU(),
                                                torch.nn.Linear(16, 4)),
        (x, y), F.cross_entropy, 32, float8=mp.Float8Options(min_features=16),
    )  # fmt: skip
    monkeypatch.setattr(bench, "get_workload", lambda spec, small=False, batch=None: work)
    results = bench.run("tiny-fp8", ["O2-fp8", "O2-fp8+compile"], repeats=1, steps=1,
                        warmup=2, memory=False, min_round_ms=0)  # fmt: skip
    eager, compiled = results[1], results[2]
    assert compiled.mode == "O2-fp8+compile" and compiled.compile_s is not None
    assert (compiled.float8_layers, compiled.linear_layers) == (2, 3) == (
        eager.float8_layers, eager.linear_layers)  # fmt: skip
    # The same float8 casts and matmuls, traced: the same three steps' loss.
    assert compiled.final_loss == pytest.approx(eager.final_loss, rel=1e-5)


def test_float8_modes_without_torchao_name_the_extra(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "torchao.float8", None)  # import torchao.float8 fails
    args = ["bench", "mlp-b64", "--small", "--no-memory", "--repeats", "1", "--steps", "1",
            "--min-round-ms", "0", "--modes"]  # fmt: skip
    assert cli.main([*args, "float32,O2-fp8-rowwise"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("mixprec bench: error: --modes O2-fp8-rowwise: float8 policies")
    assert "pip install 'mixprec[float8]'" in err and len(err.splitlines()) == 1
    assert cli.main([*args, "O2-bf16"]) == 0  # the other modes do not need torchao
    built: list[str] = []
    monkeypatch.setattr(bench, "build_step", lambda mode, *a, **k: built.append(mode))
    with pytest.raises(ImportError, match=r"pip install 'mixprec\[float8\]'"):
        bench.run("mlp-b64", ["float32", "O2-fp8+compile"], memory=False, small=True)
    assert built == []  # refused before any work


def test_notes_say_what_the_figures_do_not_measure(monkeypatch):
    slow = Hardware("cpu", False, False, "CPU without AVX512-BF16 or AMX")
    monkeypatch.setattr(bench, "probe_hardware", lambda: slow)
    notes = bench.notes(["float32", "O2-bf16", "O2-fp8+compile"], "cpu")
    assert len(notes) == 2
    assert notes[0].startswith("CPU without AVX512-BF16 or AMX: bfloat16 matmuls are emulated")
    assert notes[1].startswith("float8 on CPU is emulated")
    assert bench.notes(["float32", "O1-fp16"], "cpu") == [
        "CPU without AMX-FP16: float16 matmuls are emulated here, very slowly"
    ]
    fast = Hardware("cpu", True, False, "CPU with amx_bf16")
    monkeypatch.setattr(bench, "probe_hardware", lambda: fast)
    assert bench.notes(["float32", "O2-bf16", "auto"], "cpu") == []
    only = bench.notes(["O2-fp8"], "cpu")  # fast bfloat16, but float8 is still emulated
    assert len(only) == 1 and only[0].startswith("float8 on CPU is emulated")
    # On CUDA: eager float8 is slow by design (torchao fuses its casts under compile).
    assert "fast under torch.compile only" in bench.notes(["O2-fp8", "O2-fp8+compile"], "cuda")[0]
    assert bench.notes(["O2-bf16+compile", "O2-fp8+compile"], "cuda") == []


def test_lm_d2048_is_a_gpu_workload_not_run_by_default():
    assert "lm-d2048" in bench.WORKLOADS and "lm-d2048" not in bench.DEFAULT_WORKLOADS
    full, small = bench.get_workload("lm-d2048"), bench.get_workload("lm-d2048", small=True)
    for work, layers, tokens in ((full, 8, 8 * 1024), (small, 1, 2 * 64)):
        model = bench._on_meta(work.make_model)  # the structure, without 0.4B weights
        assert model.embed.embedding_dim == 2048 and len(model.blocks) == layers
        assert model.blocks[0].n_heads == 16  # head dim 128
        assert work.tokens == tokens and work.flops == bench.lm_flops(
            model, tokens, tokens // work.samples
        )
        assert work.float8 == mp.Float8Options(min_features=2048)
    assert 22e12 < full.flops < 23e12  # model TFLOPs a step: sized for a GPU


def result(mode: str, speedup: float) -> bench.ModeResult:
    return bench.ModeResult(mode, "O2", 1.0, 1.0, speedup, 1.0, None)


def test_chart_lists_each_mode_once_in_a_colour_of_its_own():
    """Issue 15: float32 was a bar and the baseline line (two legend entries), and the
    eleventh mode took the first one's colour (matplotlib's cycle has ten)."""
    modes = bench.with_compiled(list(bench.ALL_MODES))  # all 32: the most a chart can have
    all_results = {w: [result(m, 1.0 if m == "float32" else 1.5 + i / 10)
                       for i, m in enumerate(modes)]
                   for w in ("mlp-b64", "lm-d512")}  # fmt: skip
    fig = bench.chart(all_results, "CPU, torch 2")
    ax = fig.axes[0]
    labels = [text.get_text() for text in ax.get_legend().get_texts()]
    assert len(labels) == len(set(labels)) == len(modes)
    assert sorted(lb for lb in labels if lb.startswith("float32")) == [
        "float32 (baseline, 1.0)", "float32+compile", "float32-checked",
        "float32-checked+compile"]  # fmt: skip
    colours = [tuple(c.patches[0].get_facecolor()) for c in ax.containers]
    assert len(colours) == len(set(colours)) == len(modes) - 1  # float32 is the line
    for container in ax.containers:  # a mode keeps its colour in every workload
        assert len({tuple(p.get_facecolor()) for p in container.patches}) == 1
    assert ax.get_title().startswith("mixprec bench") and "CPU, torch 2" in ax.get_title()
    assert ax.get_xlabel() == "workload" and "speedup vs float32" in ax.get_ylabel()
    # A mode and its compiled twin: one hue, dark and light; alone, the dark shade.
    pair = bench.mode_colours(["O2-bf16", "O2-bf16+compile"])
    assert pair["O2-bf16"] != pair["O2-bf16+compile"]
    assert bench.mode_colours(["O2-bf16+compile"])["O2-bf16+compile"] == pair["O2-bf16"]


def test_plot_writes_the_chart(tmp_path):
    path = tmp_path / "b.png"
    bench.plot({"lm-d512": [result("float32", 1.0), result("O2-fp8", 0.1)]}, str(path))
    assert path.read_bytes()[:4] == b"\x89PNG"


def test_rounds_alternate_direction_and_the_speedup_pairs_them(monkeypatch):
    calls: list[str] = []

    def step_of(name: str):
        def step() -> torch.Tensor:
            calls.append(name)
            return torch.zeros(())

        return step

    built = {m: step_of(m) for m in ("float32", "O1-bf16", "O2-bf16")}
    bench._time_modes(built, repeats=2, steps=1, warmup=2, dev=torch.device("cpu"),
                      min_round_ms=0)  # fmt: skip
    warm = ["float32"] * 2 + ["O1-bf16"] * 2 + ["O2-bf16"] * 2
    assert calls == [*warm, "float32", "O1-bf16", "O2-bf16", "O2-bf16", "O1-bf16", "float32"]
    # Load late in the run (the mode's rounds 3-5, float32's 4-5): the medians of each
    # (1 ms, 10 ms) would say 0.1x; the median of the rounds' own ratios says 0.5x.
    times = {"float32": [1.0, 1.0, 1.0, 9.0, 9.0], "O2-bf16": [2.0, 2.0, 10.0, 10.0, 10.0]}
    last = {m: torch.tensor(1.0) for m in times}
    monkeypatch.setattr(bench, "build_step", lambda mode, *a, **k: step_of(mode))
    monkeypatch.setattr(
        bench, "_time_modes", lambda *a, **k: (times, last, dict.fromkeys(times, 1.0))
    )
    results = bench.run("mlp-b64", ["O2-bf16"], memory=False, small=True)
    assert [(r.mode, r.ms_per_step, r.speedup) for r in results] == [
        ("float32", 1.0, 1.0),
        ("O2-bf16", 10.0, 0.5),
    ]


def test_float32_checked_is_an_opt_in_baseline_that_trains_as_float32():
    # Float32 skipping non-finite steps by hand: what the check costs any loop.
    assert "float32-checked" not in bench.MODES and bench.check_mode("float32-checked+compile")
    results = bench.run("mlp-b64", ["float32-checked", "auto"], repeats=1, steps=2, warmup=2,
                        memory=False, small=True, min_round_ms=0)  # fmt: skip
    losses = {r.mode: r.final_loss for r in results}
    assert losses["float32-checked"] == losses["float32"]
    if not mp.Policy("auto").is_mixed:  # float32 here: mixprec's step is the same SGD
        assert losses["auto"] == losses["float32"]


@pytest.mark.parametrize("mode", ["float32", "float32-checked"])
def test_float32_checked_skips_a_step_whose_gradients_are_not_finite(mode):
    made: list[torch.nn.Module] = []

    def make_model() -> torch.nn.Module:
        made.append(torch.nn.Linear(8, 3))
        return made[-1]

    x, y = torch.randn(4, 8), torch.tensor([0, 1, 2, 0])
    nan_loss = lambda out, target: F.cross_entropy(out, target) * float("nan")  # noqa: E731
    step = bench.build_step(mode, bench.Workload("nan", make_model, (x, y), nan_loss, 4),
                            torch.device("cpu"))  # fmt: skip
    before = made[0].weight.detach().clone()
    step()
    if mode == "float32":  # the plain loop applies the NaN update
        assert made[0].weight.isnan().all()
    else:
        assert torch.equal(made[0].weight, before)
