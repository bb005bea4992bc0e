"""mixed_float8: the policy, which Linear layers torchao converts and why, training at O1/O2,
torch.compile, checkpoints, and the loss against mixed_bfloat16.

CPU float8 matmuls are emulated (torch's CPU ``_scaled_mm``), so the models here are small,
with dims that are multiples of 16 and ``min_features=16`` in place of torchao's H100 size
thresholds, under which nothing this small would be converted.
"""

from __future__ import annotations

import functools
import re
import subprocess
import sys
import time
import warnings

import pytest

pytest.importorskip("torchao")

import torch
from torch import nn

import mixprec as mp
from mixprec._hardware import Hardware
from mixprec.data import synthetic_tokens
from mixprec.float8 import Float8Options, _pays_off, float8_choice, is_float8
from mixprec.levels import applied
from mixprec.models import CausalLM, lm_loss
from mixprec.scaling import NoOpLossScaler

SMALL = Float8Options(min_features=16)
E4M3 = "float8_e4m3fn"


def lm(seed: int = 0, d: int = 32, vocab: int = 32, seq: int = 16) -> CausalLM:
    torch.manual_seed(seed)
    return CausalLM(vocab=vocab, d_model=d, n_layers=1, n_heads=2, max_len=seq)


def tokens(n: int = 8, seq: int = 16, vocab: int = 32, seed: int = 0) -> torch.Tensor:
    return synthetic_tokens(n=n, seq_len=seq, vocab=vocab, seed=seed)


def converted(model: nn.Module) -> set[str]:
    return {n for n, m in model.named_modules() if is_float8(m)}


# -- policy ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("name", "recipe"),
    [
        ("mixed_float8", "tensorwise"),
        ("mixed_float8_rowwise", "rowwise"),
        ("mixed_float8_rowwise_with_gw_hp", "rowwise_with_gw_hp"),
    ],
)
def test_float8_policies_are_mixed_bfloat16_plus_a_recipe(name, recipe):
    p = mp.Policy(name)
    assert (p.param_dtype, p.compute_dtype, p.output_dtype) == (
        torch.float32,
        torch.bfloat16,
        torch.float32,
    )
    assert p.float8_recipe == recipe
    assert p.name == name
    assert str(p) == f"params=float32,compute=bfloat16,output=float32,float8={recipe}"
    assert mp.Policy(str(p)) == p and hash(mp.Policy(str(p))) == hash(p)
    # Same dtypes, different matmuls: never equal to mixed_bfloat16, nor to each other.
    assert p != mp.Policy("mixed_bfloat16")
    assert mp.Policy("mixed_bfloat16").float8_recipe is None
    # Per-tensor (or per-row) float8 scales put gradients in range: no loss scaling.
    assert p.loss_scaling == "none" and p.is_mixed


def test_float8_recipes_differ_and_the_grammar_takes_aliases():
    assert mp.Policy("mixed_float8") != mp.Policy("mixed_float8_rowwise")
    assert mp.Policy("params=fp32,compute=bf16,output=fp32,float8=RowWise") == mp.Policy(
        "mixed_float8_rowwise"
    )
    with mp.policy_scope("mixed_float8_rowwise"):
        assert mp.Policy().float8_recipe == "rowwise"


@pytest.mark.parametrize(
    ("text", "match"),
    [
        ("compute=bfloat16,float8=blockwise", r"float8='blockwise' is not a float8 recipe; "
         r"valid: tensorwise, rowwise, rowwise_with_gw_hp"),
        ("params=float32,compute=float16,output=float32,float8=tensorwise",
         r"float8=tensorwise needs compute=bfloat16, got compute=float16"),
        ("float8=tensorwise", r"needs compute=bfloat16, got compute=float32"),
        ("compute=bfloat16,float8=rowwise,float8=rowwise", r"'float8' is given twice"),
        ("mixed_float8_rowise", r"closest: 'mixed_float8_rowwise'"),
    ],
)  # fmt: skip
def test_bad_float8_policies_say_what_is_valid(text, match):
    with pytest.raises(ValueError, match=match):
        mp.Policy(text)


def test_auto_never_picks_float8_even_on_a_float8_gpu(monkeypatch):
    h100 = Hardware("cuda", True, True, "CUDA NVIDIA H100 (sm_90)")
    monkeypatch.setattr("mixprec.policy.probe_hardware", lambda: h100)
    p = mp.Policy("auto")
    assert p == mp.Policy("mixed_bfloat16") and p.float8_recipe is None


# -- which layers -----------------------------------------------------------------------------


class Mixed(nn.Module):
    """One Linear of each kind the rules tell apart."""

    def __init__(self) -> None:
        super().__init__()
        self.big = nn.Linear(32, 64)
        self.odd = nn.Linear(64, 40)  # 40 is not a multiple of 16
        self.tiny = nn.Linear(40, 16)  # in_features 40: not aligned either
        self.small = nn.Linear(16, 16)  # aligned but below min_features=32
        self.mid = nn.Linear(16, 32)  # aligned, small side 16 < 32
        self.attn = nn.MultiheadAttention(32, 2, batch_first=True)
        self.keep = nn.Linear(32, 32)
        self.head = nn.Linear(32, 32)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.tiny(self.odd(self.big(x)))
        h = torch.cat([self.mid(self.small(h)), h], dim=-1)[..., :32]
        h = self.attn(h, h, h, need_weights=False)[0]
        return self.head(self.keep(h))


@pytest.mark.float8  # runs float8 matmuls on the CPU
def test_only_eligible_linears_are_converted_and_describe_says_why():
    model = mp.auto_mixed_precision(
        Mixed(), "mixed_float8", keep_bfloat16=["keep"], float8=Float8Options(min_features=32)
    )
    assert converted(model) == {"big"}
    assert applied(model).float8 == ("big",)
    reasons = {r.name: r.note for r in mp.module_dtypes(model)}
    assert "not multiples of 16" in reasons["odd"] and "not multiples of 16" in reasons["tiny"]
    assert "min_features=32" in reasons["small"] and "min_features=32" in reasons["mid"]
    assert "MultiheadAttention" in reasons["attn.out_proj"]
    assert reasons["keep"] == "kept bfloat16 (keep_bfloat16)"
    assert "output head" in reasons["head"]
    assert reasons["big"] == "float8 tensorwise, 32->64"
    rows = {r.name: r for r in mp.module_dtypes(model)}
    assert (rows["big"].compute, rows["big"].storage) == (E4M3, "float32")
    # Not converted: what mixed_bfloat16 at O2 makes them.
    assert (rows["head"].compute, rows["head"].storage) == ("bfloat16", "bfloat16")
    text = mp.describe(model)
    assert "policy mixed_float8, level O2; float8 (tensorwise) in 1 of 8 Linear layers" in text
    assert E4M3 in text
    out = model(torch.randn(2, 5, 32))
    assert out.dtype == torch.float32 and torch.isfinite(out).all()


def test_keep_entries_by_type_and_name_and_the_head_option():
    model = mp.auto_mixed_precision(
        lm(), "mixed_float8", keep_float32=["blocks.0.out"], float8=SMALL
    )
    assert converted(model) == {"blocks.0.qkv", "blocks.0.mlp.0", "blocks.0.mlp.2"}
    assert float8_choice(model.blocks[0].out).reason.startswith(
        "in a keep_float32 or to_float region"
    )
    assert model.blocks[0].out.weight.dtype == torch.float32

    model = mp.auto_mixed_precision(
        lm(), "mixed_float8", keep_bfloat16=[nn.Sequential], float8=Float8Options(16, False)
    )
    assert converted(model) == {"blocks.0.qkv", "blocks.0.out", "head"}


def test_torchaos_size_thresholds_by_default():
    # torchao's H100 auto-filter: tensorwise pays from in > 4096 or out > 1024.
    assert not _pays_off("tensorwise", 4096, 1024)
    assert _pays_off("tensorwise", 4096, 1040) and _pays_off("tensorwise", 4112, 16)
    assert not _pays_off("rowwise", 2048, 4096) and _pays_off("rowwise", 2064, 4096)
    assert not _pays_off("rowwise_with_gw_hp", 1024, 8192)
    model = mp.auto_mixed_precision(lm(), "mixed_float8")
    assert converted(model) == set()
    assert "below torchao's tensorwise size threshold" in float8_choice(model.blocks[0].qkv).reason


def test_module_filter_fn_replaces_the_size_rule():
    options = Float8Options(module_filter_fn=lambda module, fqn: fqn.endswith("qkv"))
    model = mp.auto_mixed_precision(lm(), "mixed_float8", float8=options)
    assert converted(model) == {"blocks.0.qkv"}
    assert float8_choice(model.blocks[0].out).reason == "module_filter_fn returned False"


class _Filter:
    def __call__(self, module: nn.Module, fqn: str, *, strict: bool = False) -> bool:
        return True


def _module_only(module):
    return True


@pytest.mark.parametrize(
    ("fn", "shown", "why"),
    [
        (_module_only, "_module_only(module)", "too many positional arguments"),
        (lambda: True, "<lambda>()", "too many positional arguments"),
        (lambda m, f, depth: True, "<lambda>(m, f, depth)", "missing a required argument: 'depth'"),
        (lambda *, module, fqn: True, "<lambda>(*, module, fqn)", "too many positional arguments"),
        (len, "len(obj, /)", "too many positional arguments"),
    ],
)  # fmt: skip
def test_module_filter_fn_of_the_wrong_signature_is_refused_when_given(fn, shown, why):
    """torchao calls it as fn(module, fqn) for every Linear, deep inside the conversion:
    checked in Float8Options, in one line naming the callable and its signature."""
    with pytest.raises(ValueError, match="^" + re.escape(
        f"Float8Options(module_filter_fn={shown}): torchao calls it as fn(module, fqn) -> "
        f"bool, which this signature cannot take ({why}); give a callable of two positional "
        "arguments, e.g. lambda module, fqn: ..."
    ) + "$"):  # fmt: skip
        Float8Options(module_filter_fn=fn)


@pytest.mark.parametrize(
    "fn", [lambda module, fqn: True, lambda *args: True, lambda m, f, extra=1: True, _Filter(),
           functools.partial(lambda flag, m, f: flag, True)],
)  # fmt: skip
def test_module_filter_fn_that_takes_two_positional_arguments_is_accepted(fn):
    model = mp.auto_mixed_precision(lm(), "mixed_float8", float8=Float8Options(module_filter_fn=fn))
    assert converted(model)  # every filter above says True


def test_bad_float8_arguments():
    with pytest.raises(
        ValueError, match=r"only, at O1-O3; policy 'mixed_bfloat16' at O2 converts no layer"
    ):
        mp.auto_mixed_precision(lm(), "mixed_bfloat16", keep_bfloat16=["head"])
    with pytest.raises(ValueError, match=r"keep_bfloat16 entry 'haed' matches no module name"):
        mp.auto_mixed_precision(lm(), "mixed_float8", keep_bfloat16=["haed"])
    with pytest.raises(TypeError, match=r"float8 must be a Float8Options or None, got dict"):
        mp.auto_mixed_precision(lm(), "mixed_float8", float8={"min_features": 16})
    with pytest.raises(ValueError, match=r"min_features=0 is invalid; use an int >= 1"):
        Float8Options(min_features=0)


def test_o0_converts_nothing_and_parameters_keep_their_identity():
    model = lm()
    params = list(model.parameters())
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    mp.auto_mixed_precision(model, "mixed_float8", level="O2", float8=SMALL)
    assert len(converted(model)) == 4
    # torchao swaps the modules but keeps the Parameter objects: optimizers stay valid.
    assert [id(p) for p in model.parameters()] == [id(p) for p in params]
    assert opt.param_groups[0]["params"][0] is params[0]
    assert converted(mp.auto_mixed_precision(lm(), "mixed_float8", level="O0")) == set()


# -- numerics and training ----------------------------------------------------------------------


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm())


@pytest.mark.float8  # runs float8 matmuls on the CPU
def test_one_step_against_float32_and_bfloat16_controls():
    """float8 really runs, and its error against float32 is bounded.

    E4M3 keeps 3 mantissa bits (relative rounding up to 2**-4 per element) against bfloat16's
    8. Measured on this model (CPU, init seeds 0-3, tensorwise): relative error of the logits
    0.056-0.068 (bfloat16: 0.0065-0.0077), of the qkv weight gradient 0.086-0.106 (bfloat16:
    0.007). Bounds: about 2x the worst float8 figure, and float8 at least 3x bfloat16's error
    (a float8 layer that silently ran in bfloat16 would fail that)."""
    x = tokens()

    def run(policy: str | None) -> tuple[torch.Tensor, torch.Tensor]:
        model = lm()
        if policy is not None:
            mp.auto_mixed_precision(model, policy, float8=SMALL if "8" in policy else None)
        out = model(x)
        lm_loss(out, x).backward()
        return out.detach(), model.blocks[0].qkv.weight.grad.float()

    out32, grad32 = run(None)
    out16, grad16 = run("mixed_bfloat16")
    out8, grad8 = run("mixed_float8")
    assert 3 * _rel(out16, out32) < _rel(out8, out32) < 0.13
    assert 3 * _rel(grad16, grad32) < _rel(grad8, grad32) < 0.2


@pytest.mark.parametrize(
    "recipe",
    [
        "mixed_float8",
        pytest.param("mixed_float8_rowwise_with_gw_hp", marks=pytest.mark.float8_rowwise),
    ],
)
@pytest.mark.parametrize("level", ["O1", "O2"])
@pytest.mark.float8  # runs float8 matmuls on the CPU
def test_levels_train_with_float32_float8_weights(level, recipe):
    model = mp.auto_mixed_precision(lm(), recipe, level=level, float8=SMALL)
    opt = mp.LossScaleOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-2))
    # Converted layers keep float32 weights at O1 and O2 (no master copy needed); the head
    # and embeddings are bfloat16 at O2, with float32 masters in the optimizer.
    assert model.blocks[0].qkv.weight.dtype == torch.float32
    assert model.head.weight.dtype == (torch.bfloat16 if level == "O2" else torch.float32)
    assert isinstance(opt.loss_scaler, NoOpLossScaler)
    x = tokens(n=8)
    losses = []
    for _ in range(4):
        opt.zero_grad()
        loss = lm_loss(model(x), x)
        opt.backward(loss)
        assert opt.step().applied
        losses.append(loss.item())
    assert losses[-1] < losses[0]


@pytest.mark.float8  # runs float8 matmuls on the CPU
def test_train_step_with_accumulation_and_clipping():
    model = mp.auto_mixed_precision(lm(), "mixed_float8", float8=SMALL)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    step = mp.build_train_step(model, opt, lm_loss, accumulation_steps=2, max_grad_norm=0.5)
    x = tokens(n=16)
    results = [step(x[i : i + 4], x[i : i + 4])[1] for i in range(0, 16, 4)]
    assert [r.accumulating for r in results] == [True, False, True, False]
    assert all(r.applied for r in results[1::2])
    assert all(r.grad_norm is not None and r.grad_norm > 0 for r in results[1::2])


@pytest.mark.float8  # runs float8 matmuls on the CPU
def test_trainer_takes_a_prepared_float8_model():
    model = mp.auto_mixed_precision(lm(), "mixed_float8", float8=SMALL)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    trainer = mp.Trainer(model, lm_loss, opt, metrics=(), device="cpu")
    x = tokens(n=16)
    history = trainer.fit(x, x, batch_size=8, epochs=2, verbose=0)
    assert len(history.history["loss"]) == 2
    assert converted(model) == {"blocks.0.qkv", "blocks.0.out", "blocks.0.mlp.0", "blocks.0.mlp.2"}


def test_without_torchao_the_error_says_how_to_install(monkeypatch):
    def missing(name: str) -> None:
        raise ImportError(f"No module named {name!r}")

    monkeypatch.setattr("mixprec.float8.importlib.import_module", missing)
    with pytest.raises(ImportError, match=r"pip install 'mixprec\[float8\]'"):
        mp.auto_mixed_precision(lm(), "mixed_float8")


@pytest.mark.parametrize("level", ["O1", "O2"])
@pytest.mark.float8  # runs float8 matmuls on the CPU
def test_compiles_whole_graph(level):
    model = mp.auto_mixed_precision(lm(), "mixed_float8", level=level, float8=SMALL)
    explained = torch._dynamo.explain(model)(tokens(n=2))
    assert explained.graph_break_count == 0, [str(r.reason)[:200] for r in explained.break_reasons]


# -- checkpoints ---------------------------------------------------------------------------------


def _train(model: nn.Module, opt: mp.LossScaleOptimizer, batches: list[torch.Tensor]) -> None:
    for x in batches:
        opt.zero_grad()
        opt.backward(lm_loss(model(x), x))
        opt.step()


@pytest.mark.float8_rowwise
def test_checkpoint_holds_float32_weights_and_the_recipe(tmp_path):
    model = mp.auto_mixed_precision(lm(), "mixed_float8_rowwise", float8=SMALL)
    opt = mp.LossScaleOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-2))
    _train(model, opt, [tokens(seed=s) for s in range(2)])
    path = mp.save_checkpoint(tmp_path / "f8.safetensors", model, opt)
    _, header = mp.read_checkpoint(path)
    assert header["policy"].endswith(",float8=rowwise")
    assert header["float8"] == {
        "recipe": "rowwise",
        "converted": ["blocks.0.qkv", "blocks.0.out", "blocks.0.mlp.0", "blocks.0.mlp.2"],
    }
    masters = dict(opt.master_weights())

    # Into a plain float32 model: every weight float32, the head's its float32 master.
    plain = lm(seed=1)
    report = mp.load_checkpoint(path, plain)
    assert report.converted == [] and report.metadata["float8"]["recipe"] == "rowwise"
    assert torch.equal(plain.head.weight, masters[model.head.weight])
    assert torch.equal(plain.blocks[0].qkv.weight, model.blocks[0].qkv.weight)

    # Into a mixed_bfloat16 model, and from there back into a float8 one.
    bf16 = mp.auto_mixed_precision(lm(seed=1), "mixed_bfloat16")
    mp.load_checkpoint(path, bf16)
    assert bf16.blocks[0].qkv.weight.dtype == torch.bfloat16
    mp.save_checkpoint(tmp_path / "bf16.safetensors", bf16)
    back = mp.auto_mixed_precision(lm(seed=1), "mixed_float8", float8=SMALL)
    report = mp.load_checkpoint(tmp_path / "bf16.safetensors", back)
    # The bfloat16 model's weights still round from the float32 values it loaded: its save
    # writes those, and the float8 model gets them back whole.
    assert not [name for name, *_ in report.converted if name == "blocks.0.qkv.weight"]
    assert torch.equal(back.blocks[0].qkv.weight, model.blocks[0].qkv.weight)


@pytest.mark.float8  # runs float8 matmuls on the CPU
def test_resume_is_bitwise(tmp_path):
    batches = [tokens(seed=s) for s in range(4)]

    def fresh() -> tuple[nn.Module, mp.LossScaleOptimizer]:
        model = mp.auto_mixed_precision(lm(), "mixed_float8", float8=SMALL)
        return model, mp.LossScaleOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-2))

    straight, opt = fresh()
    _train(straight, opt, batches)
    first, opt = fresh()
    _train(first, opt, batches[:2])
    mp.save_checkpoint(tmp_path / "mid.safetensors", first, opt)
    resumed, opt = fresh()
    mp.load_checkpoint(tmp_path / "mid.safetensors", resumed, opt)
    _train(resumed, opt, batches[2:])
    for (name, a), b in zip(
        straight.state_dict().items(), resumed.state_dict().values(), strict=True
    ):
        assert torch.equal(a, b), name


# -- accuracy ----------------------------------------------------------------------------------


@pytest.mark.float8  # runs float8 matmuls on the CPU
def test_lm_loss_within_tolerance_of_mixed_bfloat16():
    """A small causal LM on a Markov-chain token task, mixed_float8 (tensorwise) against
    mixed_bfloat16 from the same initialisation and batches.

    Measured on this CPU (AVX2, torch 2.13, torchao 0.18; init seeds 0-2, 60 steps): held-out
    loss 1.54-1.62 for both, float8 - bfloat16 = -0.0045, +0.0014, +0.0078 (at 80 steps:
    +0.0036, -0.0223, +0.0063; bfloat16 - float32 was 0.003-0.006). The bound is 3x the worst
    60-step gap. The loss must have fallen well below log(vocab) = 3.47, so the bound is about
    a model that learnt, not two that did not."""
    steps, batch, vocab = 60, 8, 32
    data = synthetic_tokens(n=steps * batch + 64, seq_len=16, vocab=vocab, seed=0)
    train, held = data[:-64], data[-64:]

    def held_out_loss(policy: str) -> float:
        model = lm()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        mp.auto_mixed_precision(model, policy, float8=SMALL if "8" in policy else None)
        step = mp.build_train_step(model, opt, lm_loss)
        for i in range(steps):
            b = train[i * batch : (i + 1) * batch]
            step(b, b)
        with torch.no_grad():
            return lm_loss(model(held), held).item()

    bf16, f8 = held_out_loss("mixed_bfloat16"), held_out_loss("mixed_float8")
    assert bf16 < 0.6 * torch.log(torch.tensor(float(vocab))).item()
    assert abs(f8 - bf16) < GAP_BOUND, (f8, bf16)


GAP_MEASURED = 0.0078
GAP_BOUND = 3 * GAP_MEASURED


def _float8_matmul_gflops() -> float:
    """This CPU's float8 matmul throughput on one thread, from one small product. Some CPUs
    run ``torch._scaled_mm`` through a reference kernel at ~0.06 GFLOP/s (2-core Intel Xeon
    with AMX-BF16, torch 2.13, 2026-11), where others emulate it a thousand times faster."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        a = torch.randn(64, 64).to(torch.float8_e4m3fn)
        b = torch.randn(64, 64).to(torch.float8_e4m3fn).t()
        one = torch.tensor(1.0)
        torch._scaled_mm(a, b, one, one, out_dtype=torch.bfloat16)
        start = time.perf_counter()
        torch._scaled_mm(a, b, one, one, out_dtype=torch.bfloat16)
        return 2 * 64**3 / (time.perf_counter() - start) / 1e9
    finally:
        torch.set_num_threads(threads)


@pytest.mark.float8  # runs float8 matmuls on the CPU
def test_main_job_digits_mlp_in_float8_within_a_point_of_float32():
    """Issue 16's accuracy target, on the main job's model, data and schedule (`mixprec
    train --policy mixed_float8`: 20 epochs of the digits MLP at width 512). Measured on seed
    0: float32 0.981, mixed_float8 0.978 (2 of 3 Linear layers in float8, head bfloat16).
    Its 2760 float8 products of 64x512x512 take ~25 minutes on a CPU whose float8 matmul is
    a reference kernel: there it is skipped, saying so (the other float8 tests use small
    layers and run everywhere)."""
    gflops = _float8_matmul_gflops()
    if gflops < 1.0:
        pytest.skip(
            f"float8 matmuls run at {gflops:.2f} GFLOP/s on this CPU (a reference kernel): "
            "20 epochs of float8 training would take ~25 minutes"
        )
    from mixprec.cli import run_training

    common = {"model": "mlp", "data": "digits", "epochs": 20, "seed": 0, "batch_size": 64,
              "lr": 1e-3, "save": None, "verbose": 0, "level": "auto"}  # fmt: skip
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # emulated float8 matmuls: two threads contend on 2 cores
    try:
        base = run_training({**common, "label": "baseline", "policy": "float32"})
        fp8 = run_training({**common, "label": "mixed", "policy": "mixed_float8"})
    finally:
        torch.set_num_threads(threads)
    assert fp8["float8_layers"] == "2 of 3" and base["float8_layers"] is None
    assert fp8["policy"] == "mixed_float8" and fp8["level"] == "O2"
    assert base["test_accuracy"] > 0.95
    assert abs(fp8["test_accuracy"] - base["test_accuracy"]) <= 0.01


@pytest.mark.parametrize("level", ["O1", "O2"])
@pytest.mark.float8  # runs float8 matmuls on the CPU
def test_float8_all_gather_weights_save_and_load(tmp_path, level):
    # Review: torchao's all-gather weight wrapper has no storage of its own; saving raised.
    options = Float8Options(min_features=16, fsdp_float8_all_gather=True)

    def prepared():
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 10))
        return mp.auto_mixed_precision(model, "mixed_float8", level, float8=options)

    model = prepared()
    assert type(model[0].weight).__name__ == "WeightWithDynamicFloat8CastTensor"
    opt = mp.LossScaleOptimizer(torch.optim.AdamW(model.parameters(), 1e-2))
    opt.backward(nn.functional.cross_entropy(model(torch.randn(8, 32)), torch.arange(8)))
    assert opt.step().applied
    path = mp.save_checkpoint(tmp_path / "c.safetensors", model, opt)
    again = prepared()
    opt2 = mp.LossScaleOptimizer(torch.optim.AdamW(again.parameters(), 1e-2))
    mp.load_checkpoint(path, again, opt2)
    for a, b in zip(model.state_dict().values(), again.state_dict().values(), strict=True):
        assert torch.equal(a, b)
    with pytest.raises(ValueError, match="fsdp_float8_all_gather=True\\) needs the tensorwise"):
        mp.auto_mixed_precision(nn.Sequential(nn.Linear(32, 64), nn.Linear(64, 10)),
                                "mixed_float8_rowwise", float8=options)  # fmt: skip


_IMPORT_TORCHAO = """
import warnings
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    from mixprec.float8 import torchao_float8
    torchao_float8()
for w in caught:
    print("WARNING:", w.category.__name__, w.message)
"""


def test_torchaos_harmless_import_noise_is_dropped():
    """torchao imported through mixprec: no "Failed to load ...so" lines, no pytree
    register_constant() deprecation, as a log line or as a Python warning."""
    done = subprocess.run(
        [sys.executable, "-c", _IMPORT_TORCHAO], capture_output=True, text=True, check=True
    )
    out = done.stdout + done.stderr
    assert "Failed to load" not in out
    assert "register_constant" not in out
    assert "is an Enum subclass" not in out


@pytest.fixture
def cpu_float8_kernel(monkeypatch):
    """``torch._scaled_mm`` refusing what a CPU's kernel refuses: ``"rowwise"`` scales
    (torch 2.11) or ``"all"`` (oneDNN limited to AVX2), with their errors' words."""
    from mixprec import float8

    real = torch._scaled_mm

    def refusing(what):
        def scaled_mm(a, b, scale_a=None, scale_b=None, **kwargs):
            if what == "all":
                raise RuntimeError("could not create a primitive descriptor for the matmul")
            if scale_a.numel() != 1 or scale_b.numel() != 1:
                raise RuntimeError("Now _scaled_mm only supports per-tensor scaling for CPU")
            return real(a, b, scale_a=scale_a, scale_b=scale_b, **kwargs)

        monkeypatch.setattr(torch, "_scaled_mm", scaled_mm)
        monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # a CPU-only machine
        float8.cpu_kernel_error.cache_clear()

    yield refusing
    float8.cpu_kernel_error.cache_clear()


@pytest.mark.float8  # runs float8 matmuls on the CPU
def test_a_recipe_this_cpu_cannot_run_is_said_when_preparing(cpu_float8_kernel):
    # Training would fail in torch's words ("INTERNAL ASSERT FAILED ... per-tensor scaling"):
    # preparing on CPU says so first, at the user's line, and what to do instead.
    cpu_float8_kernel("rowwise")
    with pytest.warns(UserWarning) as seen:
        mp.auto_mixed_precision(lm(), "mixed_float8_rowwise", float8=SMALL)
    assert len(seen) == 1 and seen[0].filename == __file__
    assert str(seen[0].message) == (
        "policy='mixed_float8_rowwise': float8 matmuls with rowwise scales cannot run on this "
        f"CPU with torch {torch.__version__} (torch._scaled_mm: Now _scaled_mm only supports "
        "per-tensor scaling for CPU), so training this model on the CPU will fail. Move it "
        "to a CUDA GPU with float8 matrix units (compute capability >= 8.9) before preparing "
        "it, or use 'mixed_float8' or 'mixed_bfloat16'."
    )
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # tensorwise runs here: nothing to say
        mp.auto_mixed_precision(lm(), "mixed_float8", float8=SMALL)


def test_nothing_is_said_where_the_model_may_be_bound_for_a_gpu(cpu_float8_kernel, monkeypatch):
    # Lightning prepares on the CPU and moves the model after; a machine with CUDA is no
    # place to tell its user that the CPU cannot train it.
    cpu_float8_kernel("rowwise")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        mp.auto_mixed_precision(lm(), "mixed_float8_rowwise", float8=SMALL)


def test_the_cpu_float8_probe_runs_on_the_cpu_in_float32_whatever_the_defaults(monkeypatch):
    from mixprec import float8

    seen = []
    real = torch._scaled_mm

    def scaled_mm(a, b, scale_a=None, scale_b=None, **kwargs):
        seen.append((a.device.type, scale_a.device.type, scale_a.dtype))
        return real(a, b, scale_a=scale_a, scale_b=scale_b, **kwargs)

    monkeypatch.setattr(torch, "_scaled_mm", scaled_mm)
    before = torch.get_default_dtype()
    try:
        torch.set_default_dtype(torch.float64)  # float64 scales are a ValueError in torch
        with torch.device("meta"):
            for rowwise in (False, True):
                float8.cpu_kernel_error.cache_clear()
                float8.cpu_kernel_error(rowwise)
    finally:
        torch.set_default_dtype(before)
        float8.cpu_kernel_error.cache_clear()
    assert seen == [("cpu", "cpu", torch.float32)] * 2


def test_without_any_cpu_float8_kernel_only_bfloat16_is_suggested(cpu_float8_kernel):
    cpu_float8_kernel("all")
    with pytest.warns(UserWarning, match=r"or use 'mixed_bfloat16'\.$") as seen:
        mp.auto_mixed_precision(lm(), "mixed_float8", float8=SMALL)
    assert "primitive descriptor" in str(seen[0].message)
    assert "'mixed_float8' or" not in str(seen[0].message)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no layer converted: no float8 matmul to fail
        mp.auto_mixed_precision(lm(), "mixed_float8")  # torchao's thresholds: none here


def test_min_features_beside_a_module_filter_is_refused():
    """The filter replaces the size rule: min_features was ignored without a word."""
    with pytest.raises(ValueError, match=r"min_features=4096 and module_filter_fn are both"):
        Float8Options(min_features=4096, module_filter_fn=lambda m, fqn: True)


def test_float8_arguments_at_o0_are_refused():
    with pytest.raises(ValueError, match=r"'mixed_float8' at O0 converts no layer \(O0 computes"):
        mp.auto_mixed_precision(lm(), "mixed_float8", "O0", float8=SMALL)


def test_float8_options_that_convert_nothing_say_why():
    """With explicit options every layer may be refused (sizes not multiples of 16): said."""
    model = nn.Sequential(nn.Linear(20, 36), nn.ReLU(), nn.Linear(36, 10))
    with pytest.warns(UserWarning, match=r"float8= converted no Linear layer; '0': "):
        mp.auto_mixed_precision(model, "mixed_float8", float8=Float8Options(min_features=1))
    assert not converted(model)


def test_a_linear_shared_under_two_parents_stays_one_module():
    """torchao swaps it once under each parent: two Float8Linear modules over one weight,
    so a hook on one name missed the other and describe counted it twice."""

    class TwoParents(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            shared = nn.Linear(32, 32)
            self.a, self.b = nn.Sequential(shared), nn.Sequential(shared)
            self.head = nn.Linear(32, 16)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.head(self.b(self.a(x)))

    model = mp.auto_mixed_precision(TwoParents(), "mixed_float8", float8=SMALL)
    assert model.a[0] is model.b[0] and is_float8(model.a[0])
    assert mp.float8.layer_counts(model) == (1, 2)


def test_the_head_is_the_last_linear_outside_attention():
    """An attention block registered after the head: its out_proj (a Linear subclass, never
    converted) was taken for the head, and the real head went to float8."""

    class Pooled(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.proj, self.head = nn.Linear(64, 64), nn.Linear(64, 16)
            self.pool = nn.MultiheadAttention(64, 4, batch_first=True)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = self.proj(x)
            return self.head(self.pool(h, h, h)[0][:, 0])

    model = mp.auto_mixed_precision(Pooled(), "mixed_float8", float8=SMALL)
    assert float8_choice(model.head).reason.startswith("output head (the last Linear)")
    assert is_float8(model.proj) and not is_float8(model.head)

    class Head(nn.Linear):  # a subclass head is the head too (never converted itself)
        pass

    sub = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 64), Head(64, 16))
    mp.auto_mixed_precision(sub, "mixed_float8", float8=SMALL)
    assert is_float8(sub[2]) and not is_float8(sub[3])


def test_a_model_that_is_one_linear_is_refused_with_the_wrap():
    """torchao returns a new module for a root Linear: the model stayed plain bfloat16."""
    with pytest.raises(ValueError, match=r"itself an nn.Linear.*nn.Sequential\(linear\)"):
        mp.auto_mixed_precision(nn.Linear(64, 64), "mixed_float8", float8=SMALL)


def test_a_linear_shared_under_two_names_is_converted_at_both():
    """torchao swaps by name, once: the second name kept the bfloat16 Linear, so the same
    weights ran float8 at one call site and bfloat16 at the other."""

    class Shared(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.head = nn.Linear(32, 32), nn.Linear(32, 16)
            self.b = self.a

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.head(self.b(self.a(x)))

    model = mp.auto_mixed_precision(Shared(), "mixed_float8", float8=SMALL)
    assert model.a is model.b and type(model.a).__name__ == "Float8Linear"
    every_name = model.named_modules(remove_duplicate=False)
    assert {n for n, m in every_name if is_float8(m)} == {"a", "b"}
