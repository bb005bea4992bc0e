"""The benchmark's modes: each mode's training step (hand-written loops, mixprec's levels,
float8, compiled), the mode names and what they need."""

from __future__ import annotations

import math
import sys

import pytest
import torch
import torch.nn.functional as F

import mixprec as mp
from mixprec import bench, cli
from mixprec.bench import modes as bench_modes
from mixprec.bench import runner
from tests.bench.test_workloads import tiny_workload


def loss_input_dtype(mode: str, outputs_16bit: bool) -> torch.dtype:
    """The dtype of what ``mode``'s step hands the loss, on the small batch-64 MLP."""
    seen: list[torch.dtype] = []
    work = bench.get_workload("mlp-b64", small=True)
    loss_fn = work.loss_fn

    def spy(out, y):
        seen.append(out.dtype)
        return loss_fn(out, y)

    work = bench.Workload(work.name, work.make_model, work.batch, spy, work.samples)
    bench.build_step(mode, work, torch.device("cpu"), outputs_16bit=outputs_16bit)()
    return seen[0]


def test_outputs_16bit_reach_the_loss_in_bfloat16(monkeypatch):
    seen = [loss_input_dtype(mode, flag) for flag in (False, True)
            for mode in ("O2-bf16", "torch-autocast-bf16")]  # fmt: skip
    assert seen == [torch.float32, torch.float32, torch.bfloat16, torch.bfloat16]


def test_build_step_rejects_unknown_mode():
    with pytest.raises(ValueError, match="unknown mode 'fast'"):
        bench.build_step("fast", bench.get_workload("mlp-b64", small=True), torch.device("cpu"))


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


# float8 modes (issue 16 item 7). CPU float8 matmuls are emulated and slow: the tiny LM
# (--small: one block at d=64), one step timed, and at most one compiled float8 graph.


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


@pytest.mark.float8  # runs float8 matmuls on the CPU
def test_one_compiled_float8_mode_runs_and_trains_as_eager(monkeypatch):
    """The bench's wiring of O2-fp8+compile: the compiled forward and loss, the layers
    converted, compile time apart. AOTAutograd's graphs run eagerly (``aot_eager``) to keep
    this test near a second; inductor's code for torchao's float8 is test_float8's."""
    pytest.importorskip("torchao")
    monkeypatch.setattr(
        bench_modes,
        "compile_step",
        lambda fn, options, model: torch.compile(fn, backend="aot_eager"),
    )
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(32, 16, generator=g), torch.randint(0, 4, (32,), generator=g)
    work = bench.Workload(
        "tiny-fp8", lambda: torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(),
                                                torch.nn.Linear(32, 16), torch.nn.ReLU(),
                                                torch.nn.Linear(16, 4)),
        (x, y), F.cross_entropy, 32, float8=mp.Float8Options(min_features=16),
    )  # fmt: skip
    monkeypatch.setattr(runner, "get_workload", lambda spec, small=False, batch=None: work)
    results = bench.run("tiny-fp8", ["O2-fp8", "O2-fp8+compile"], repeats=1, steps=1,
                        warmup=2, memory=False, min_round_ms=0, explain=False)  # fmt: skip
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
    monkeypatch.setattr(runner, "build_step", lambda mode, *a, **k: built.append(mode))
    with pytest.raises(ImportError, match=r"pip install 'mixprec\[float8\]'"):
        bench.run("mlp-b64", ["float32", "O2-fp8+compile"], memory=False, small=True)
    assert built == []  # refused before any work


def test_with_compiled_adds_each_compiled_mode_once():
    """Issue 32 item 10: ``--modes O2-bf16,O2-bf16+compile --compile`` ran the compiled
    mode twice, in two rows."""
    assert bench.with_compiled(["O2-bf16", "O2-bf16+compile", "auto"]) == [
        "O2-bf16", "O2-bf16+compile", "auto", "auto+compile"]  # fmt: skip


def test_float32_tf32_turns_tf32_on_around_its_own_steps_only():
    # The bench runs with TF32 off (a true float32 baseline); float32-tf32 turns it on for
    # its own steps, which interleave with the other modes' rounds, and back off after.
    seen: list[tuple[bool, bool]] = []

    def flags():
        matmul, conv = torch.backends.cuda.matmul, torch.backends.cudnn.conv
        if hasattr(matmul, "fp32_precision") and hasattr(conv, "fp32_precision"):  # 2.9+
            return (matmul.fp32_precision == "tf32", conv.fp32_precision == "tf32")
        return (matmul.allow_tf32, torch.backends.cudnn.allow_tf32)

    def loss_fn(out, target):
        seen.append(flags())
        return F.cross_entropy(out, target)

    x, y = torch.randn(4, 8), torch.tensor([0, 1, 2, 0])
    work = bench.Workload("tf32", lambda: torch.nn.Linear(8, 3), (x, y), loss_fn, 4)
    assert "float32-tf32" not in bench.MODES and bench.check_mode("float32-tf32+compile")
    with bench_modes.tf32(False):
        losses = {}
        for mode in ("float32-tf32", "float32"):
            step = bench.build_step(mode, work, torch.device("cpu"))
            losses[mode] = [step().item() for _ in range(2)]
            assert flags() == (False, False)
    assert seen == [(True, True)] * 2 + [(False, False)] * 2
    assert losses["float32-tf32"] == losses["float32"]  # TF32 changes nothing on a CPU


def test_tf32_works_after_torchs_newer_precision_api_was_used():
    # Once fp32_precision is set, torch refuses reads of the older allow_tf32 flags.
    matmul = torch.backends.cuda.matmul
    if not hasattr(matmul, "fp32_precision"):
        pytest.skip(f"torch {torch.__version__} has no fp32_precision API")
    saved = matmul.fp32_precision
    matmul.fp32_precision = "ieee"
    try:
        with bench_modes.tf32(True):
            assert matmul.fp32_precision == "tf32"
        assert matmul.fp32_precision == "ieee"
    finally:
        matmul.fp32_precision = saved


def test_auto_follows_outputs_16bit_as_the_other_modes_do():
    """Under --outputs-16bit the headline auto row measured float32 outputs while its
    autocast peer handed the loss bfloat16 ones."""
    auto = mp.Policy("auto")
    expected = auto.compute_dtype if auto.is_mixed else torch.float32
    assert loss_input_dtype("auto", outputs_16bit=True) == expected


def test_cuda_timing_and_memory_name_the_device_measured(monkeypatch):
    """On cuda:1 they synchronised and read the current device, cuda:0."""
    from mixprec.bench import memory

    calls: list[tuple[str, object]] = []
    names = ("synchronize", "reset_peak_memory_stats", "memory_allocated", "max_memory_allocated")
    for name in names:

        def record(device=None, name=name):
            calls.append((name, device))
            return 0

        monkeypatch.setattr(torch.cuda, name, record)
    device = torch.device("cuda:1")
    bench_modes._sync(device)
    memory.PeakMemory(device).mb()
    assert calls == [("synchronize", device), ("reset_peak_memory_stats", device),
                     ("memory_allocated", device), ("max_memory_allocated", device)]  # fmt: skip


@pytest.mark.parametrize(
    ("name", "bf16"),
    [("NVIDIA H100 80GB HBM3", 989.4), ("NVIDIA H100 PCIe", 756.0), ("NVIDIA L40S", 362.1),
     ("NVIDIA L40", 181.0), ("NVIDIA L4", 121.0), ("NVIDIA H200", 989.4),
     ("NVIDIA GH200 480GB", 989.4),
     ("NVIDIA GeForce RTX 4090", None)],
)  # fmt: skip
def test_mfu_peaks_match_whole_words_of_the_gpus_name(monkeypatch, name, bf16):
    """ "L4" matched inside "L40S" and read a third of its peak: MFU about 3x too high."""
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: name)
    assert runner.peak_tflops(torch.device("cuda"), "bfloat16") == bf16
