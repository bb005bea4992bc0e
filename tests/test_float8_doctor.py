"""The float8 doctor (``mixprec.doctor.float8``): the cast arithmetic on hand-made tensors,
the casts of each torchao recipe, a layer whose input has outliers named (and keeping it in
bfloat16 closing the loss gap to bfloat16), the report's forms, and bad arguments.

CPU float8 matmuls are emulated, so the models are small, with dims that are multiples of 16
and ``min_features=16`` (torchao's size thresholds would convert none of these layers).
"""

from __future__ import annotations

import json
import math

import pytest

pytest.importorskip("torchao")

import torch
import torch.nn.functional as F
from torch import nn

import mixprec as mp
from mixprec.doctor.float8 import (
    FLOAT8_GRAD_ERROR_LIMIT,
    FLOAT8_OUTPUT_ERROR_LIMIT,
    FLOAT8_UNDERFLOW_LIMIT,
    Float8Report,
    cast_stats,
    diagnose_float8,
    recipe_casts,
)
from mixprec.float8 import Float8Options

SMALL = Float8Options(min_features=16)
E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
RECIPES = {
    "mixed_float8": "tensorwise",
    "mixed_float8_rowwise": "rowwise",
    "mixed_float8_rowwise_with_gw_hp": "rowwise_with_gw_hp",
}


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """These matmuls are tiny: a second thread only adds thread-pool synchronisation, which
    on a shared 2-core machine made the training test 25x slower (CPU time 5.1 s against
    0.19 s for 40 bfloat16 steps, identical results)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


# -- one cast, by hand -------------------------------------------------------------------------


def test_tensorwise_scale_flush_and_subnormals_by_hand():
    x = torch.tensor([2.0, -1.0, 1.03, -1.04, 0.5, 0.0, 1e-6, 3e-6, 5e-6])
    s = cast_stats(x, E4M3)
    # amax 2: scale = 448 / 2, exact in float32.
    assert (s.amax, s.scale, s.scale_max) == (2.0, 224.0, 224.0)
    # E4M3's smallest subnormal is 2**-9 and its smallest normal 2**-6; below 2**-10 rounds
    # to 0. Scaled: 1e-6 -> 2.2e-4 and 3e-6 -> 6.7e-4 flush; 5e-6 -> 1.1e-3 is subnormal.
    # Of the 8 non-zero values (the 0 does not count):
    assert (s.flushed, s.subnormal, s.underflow) == (2 / 8, 1 / 8, 3 / 8)
    # The dynamic scale maps amax onto max: nothing clips.
    assert s.saturated == 0.0 and s.nonfinite == 0

    # E5M2: scale 57344 / 2; its smallest normal is 2**-14, so 1e-6 * 28672 = 0.029 is normal.
    s = cast_stats(x, E5M2)
    assert (s.scale, s.flushed, s.subnormal) == (28672.0, 0.0, 0.0)


def test_a_given_scale_saturates_past_max_plus_half_an_ulp():
    x = torch.tensor([2.0, -1.0, 1.03, -1.04, 0.5, 0.0, 1e-6, 3e-6, 5e-6])
    s = cast_stats(x, E4M3, scale=448.0)
    # E4M3's max is 448 and the next step would be 480: up to 464 rounds to max, beyond it is
    # clipped. Scaled: 2 -> 896 and -1.04 -> -465.9 clip; 1.03 -> 461.4 and -1 -> -448 do not.
    assert s.saturated == 2 / 9  # of the 9 finite values
    # 1e-6 -> 4.5e-4 flushes; 3e-6 -> 1.3e-3 and 5e-6 -> 2.2e-3 are subnormal.
    assert (s.flushed, s.subnormal) == (1 / 8, 2 / 8)
    assert (s.scale, s.scale_max) == (448.0, 448.0)


def test_rowwise_scales_are_per_row_and_rounded_down_to_powers_of_two():
    t = torch.tensor([[4.0, 2e-6], [0.5, 2e-6]])
    s = cast_stats(t, E4M3, axis=-1, round_scales_to_power_of_2=True)
    # Row scales 448 / 4 = 112 -> 64 and 448 / 0.5 = 896 -> 512 (rounded down).
    assert (s.amax, s.scale, s.scale_max) == (4.0, 64.0, 512.0)
    # Row 0: 2e-6 * 64 = 1.3e-4 flushes; row 1: 2e-6 * 512 = 1.02e-3 rounds up to 2**-9.
    assert (s.flushed, s.subnormal) == (1 / 4, 1 / 4)
    # One scale (112) for both rows: the row with the small amax loses its small value too.
    assert cast_stats(t, E4M3).flushed == 2 / 4


def test_a_nonfinite_value_zeroes_the_scale():
    s = cast_stats(torch.tensor([1.0, 0.5, math.inf]), E4M3)
    # torchao: scale = 448 / inf = 0, so every finite value flushes.
    assert (s.amax, s.scale, s.nonfinite, s.flushed) == (math.inf, 0.0, 1, 1.0)


def test_cast_stats_wants_a_float8_dtype():
    with pytest.raises(ValueError, match=r"float8_dtype=torch.bfloat16 is not a float8 dtype; "):
        cast_stats(torch.ones(4), torch.bfloat16)


@pytest.mark.parametrize(
    ("recipe", "expected"),
    [
        ("tensorwise", [("input", "output", E4M3, None), ("weight", "output", E4M3, None),
                        ("grad_output", "grad_input", E5M2, None),
                        ("weight", "grad_input", E4M3, None),
                        ("input", "grad_weight", E4M3, None),
                        ("grad_output", "grad_weight", E5M2, None)]),
        ("rowwise", [("input", "output", E4M3, -1), ("weight", "output", E4M3, 0),
                     ("grad_output", "grad_input", E4M3, -1),
                     ("weight", "grad_input", E4M3, -1),
                     ("input", "grad_weight", E4M3, 0),
                     ("grad_output", "grad_weight", E4M3, 0)]),
        # The weight gradient's matmul takes input and output gradient in high precision.
        ("rowwise_with_gw_hp", [("input", "output", E4M3, -1), ("weight", "output", E4M3, 0),
                                ("grad_output", "grad_input", E4M3, -1),
                                ("weight", "grad_input", E4M3, None)]),
    ],
)  # fmt: skip
def test_recipe_casts_follow_torchaos_configs(recipe, expected):
    casts = recipe_casts(recipe)
    assert [c[:4] for c in casts] == expected
    # The rowwise recipes round scales down to powers of two; tensorwise does not.
    assert {c[4] for c in casts} == {recipe != "tensorwise"}


def test_recipe_casts_names_the_valid_recipes():
    with pytest.raises(ValueError, match=r"recipe='blockwise' is not a float8 recipe; valid: "
                       r"tensorwise, rowwise, rowwise_with_gw_hp"):  # fmt: skip
        recipe_casts("blockwise")


# -- a layer float8 hurts -------------------------------------------------------------------------


class Sensors(nn.Module):
    """Tabular regression: 32 features in, LayerNorm after the first layer."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(32, 64)
        self.norm = nn.LayerNorm(64)
        self.fc1 = nn.Linear(64, 64)
        self.fc2 = nn.Linear(64, 64)
        self.head = nn.Linear(64, 16)  # the output head: kept bfloat16

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.gelu(self.norm(self.embed(x)))
        h = F.gelu(self.fc2(F.gelu(self.fc1(h))))
        return self.head(h)


BATCH, MISSING = 64, 99999.0


def sensors(seed: int = 0) -> Sensors:
    torch.manual_seed(seed)
    return Sensors()


def readings(n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Standardised features, targets from a fixed random teacher, and in column 0 of two
    rows per batch of 64 a missing reading coded 99999 (a sentinel, the classic outlier of
    tabular data). One scale for the whole input (tensorwise) is set by the sentinel:
    448 / 99999 puts every ordinary value below E4M3's smallest normal, most below its
    smallest subnormal. bfloat16 keeps its 8 exponent bits per value and does not care; nor,
    after the LayerNorm, do the layers downstream."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 32, generator=g)
    teacher = torch.Generator().manual_seed(1234)
    w1 = torch.randn(32, 64, generator=teacher) / 32**0.5
    w2 = torch.randn(64, 16, generator=teacher) / 8
    y = torch.tanh(x @ w1) @ w2
    for start in range(0, n, BATCH):
        x[start : start + 2, 0] = MISSING
    return x, y


@pytest.fixture(scope="module")
def tensorwise() -> Float8Report:
    x, y = readings(BATCH, seed=0)
    return diagnose_float8(sensors(), x, y, F.mse_loss, "mixed_float8", float8=SMALL)


def test_tensorwise_names_the_layer_behind_the_outliers(tensorwise):
    """Measured (init seeds 0-2): embed's input 17-18% flushed and 82-83% subnormal (99.6%
    underflow); fc1 and fc2 at most 0.03%; errors against bfloat16 on the healthy layers
    0.03-0.06. embed's output error is small (0.022-0.025): the sentinel rows dominate the
    norm, which is why underflow is measured per value."""
    report = tensorwise
    assert [r.name for r in report.layers] == ["embed", "fc1", "fc2"]
    assert report.recommended_keep_bfloat16 == ["embed"] and not report.healthy
    embed, fc1, fc2 = report.layers
    assert embed.shape == (64, 32) and embed.amax_input == pytest.approx(MISSING, rel=2**-8)
    # tensorwise: scale = 448 / amax, as torchao computes it (float64, then float32).
    assert embed.scale_input == pytest.approx(448 / embed.amax_input, rel=1e-6)
    assert embed.scale_weight == pytest.approx(448 / embed.amax_weight, rel=1e-6)
    assert embed.scale_grad_output == pytest.approx(57344 / embed.amax_grad_output, rel=1e-6)
    assert embed.flushed_input + embed.subnormal_input > 0.95
    assert embed.reasons == [
        f"input: {100 * embed.flushed_input:.0f}% flushes to 0, "
        f"{100 * embed.subnormal_input:.0f}% subnormal (float8_e4m3fn tensorwise, amax "
        f"{embed.amax_input:.3g}, scale {embed.scale_input:.3g})"
    ]
    assert embed.grad_input_error is None  # the model's input needs no gradient
    for layer in (fc1, fc2):
        assert not layer.hurts
        assert max(layer.flushed_input, layer.subnormal_input, layer.flushed_grad_output) < 0.01
        assert layer.output_error < FLOAT8_OUTPUT_ERROR_LIMIT / 2
        assert layer.grad_input_error < FLOAT8_GRAD_ERROR_LIMIT / 2
        assert layer.grad_weight_error < FLOAT8_GRAD_ERROR_LIMIT / 2
        # All casts: E4M3 input and weight, E5M2 output gradient, nothing clipped.
        assert {(c.operand, c.dtype) for c in layer.casts} == {
            ("input", "float8_e4m3fn"),
            ("weight", "float8_e4m3fn"),
            ("grad_output", "float8_e5m2"),
        }
        assert all(c.stats.saturated == 0 for c in layer.casts)
    # The sentinel sits in 2 rows of 64: per-row scales would confine the damage to them.
    assert any("'mixed_float8_rowwise' may keep them in float8" in a for a in report.advice)


@pytest.mark.parametrize("policy", ["mixed_float8_rowwise", "mixed_float8_rowwise_with_gw_hp"])
def test_rowwise_recipes_confine_the_outliers_to_their_rows(policy):
    """Measured: embed's underflow 3% per row (the two sentinel rows' values), under the 5%
    limit; training confirms it (40 steps, seeds 0-2: rowwise - bfloat16 = 0.0003-0.0008,
    against tensorwise's 0.005-0.006)."""
    x, y = readings(BATCH, seed=0)
    report = diagnose_float8(sensors(), x, y, F.mse_loss, policy, float8=SMALL)
    assert (report.recipe, report.level) == (RECIPES[policy], "O2")
    assert report.healthy and report.recommended_keep_bfloat16 == []
    embed = report.layers[0]
    assert 0.01 < embed.flushed_input + embed.subnormal_input < FLOAT8_UNDERFLOW_LIMIT
    # Per-row scales, rounded down to powers of two: the smallest is the sentinel rows'.
    amax = embed.amax_input
    assert embed.scale_input == 2.0 ** math.floor(math.log2(448 / amax))
    rows = next(c for c in embed.casts if (c.operand, c.gemm) == ("input", "output"))
    assert rows.granularity == "per row" and rows.stats.scale_max > 100 * rows.stats.scale
    # grad_output in E4M3 under both rowwise recipes.
    assert {c.dtype for c in embed.casts if c.operand == "grad_output"} == {"float8_e4m3fn"}
    for layer in report.layers:
        assert layer.output_error < FLOAT8_OUTPUT_ERROR_LIMIT / 2
        if policy == "mixed_float8_rowwise_with_gw_hp":
            # Its weight gradient is a bfloat16 matmul: exactly the reference's.
            assert layer.grad_weight_error == 0.0
        else:
            assert 0 < layer.grad_weight_error < FLOAT8_GRAD_ERROR_LIMIT / 2


def _held_out_loss(
    policy: str, keep_bfloat16: list[str] | None = None, steps: int = 40, seed: int = 0
) -> float:
    model = sensors(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    extra = {} if keep_bfloat16 is None else {"float8": SMALL, "keep_bfloat16": keep_bfloat16}
    mp.auto_mixed_precision(model, policy, **extra)
    step = mp.build_train_step(model, opt, F.mse_loss)
    x, y = readings(steps * BATCH, seed=1)
    for i in range(0, steps * BATCH, BATCH):
        step(x[i : i + BATCH], y[i : i + BATCH])
    held_x, held_y = readings(4 * BATCH, seed=2)
    with torch.no_grad():
        return F.mse_loss(model(held_x), held_y).item()


def test_keeping_the_recommended_layers_closes_the_loss_gap(tensorwise):
    """The issue's criterion: three runs from the same init on the same batches, 40 AdamW
    steps; held-out MSE.

    Measured (CPU, one thread, torch 2.13, torchao 0.18; init seeds 0, 1, 2): bfloat16
    0.1183, 0.1137, 0.1167; mixed_float8's gap to it +0.0060, +0.0051, +0.0063; with
    keep_bfloat16=['embed'] +0.0000, +0.0005, +0.0002: the gap shrinks 10x or more. Bounds:
    float8's gap at least 0.002 (a third of the smallest measured), and the fixed gap at most
    a third of float8's (a third of the worst measured factor, 10x)."""
    assert tensorwise.recommended_keep_bfloat16 == ["embed"]
    bf16 = _held_out_loss("mixed_bfloat16")
    f8 = _held_out_loss("mixed_float8", [])
    fixed = _held_out_loss("mixed_float8", tensorwise.recommended_keep_bfloat16)
    gap, fixed_gap = f8 - bf16, fixed - bf16
    assert gap > 0.002, (bf16, f8, fixed)
    assert abs(fixed_gap) < gap / 3, (bf16, f8, fixed)


# -- the report ---------------------------------------------------------------------------------


def test_report_text_and_json(tensorwise):
    text = str(tensorwise)
    lines = text.splitlines()
    assert (
        lines[0].startswith("float8 doctor: policy mixed_float8 (tensorwise), level O2: loss ")
        and "(bfloat16 " in lines[0]
    )
    assert lines[1].split()[:4] == ["layer", "shape", "amax", "in/w/go"]
    embed_line = next(line for line in lines if line.startswith("embed"))
    assert "64x32" in embed_line and "1e+05/" in embed_line and "input: 1" in embed_line
    assert (
        "- float8 hurts 1 of 3 float8 layers; keep them in bfloat16: auto_mixed_precision("
        "model, 'mixed_float8', float8=Float8Options(min_features=16), keep_bfloat16=['embed'])"
    ) in lines
    data = json.loads(tensorwise.to_json())
    assert data["recommended_keep_bfloat16"] == ["embed"]
    assert data["loss_gap"] == pytest.approx(tensorwise.loss_float8 - tensorwise.loss_bfloat16)
    embed = data["layers"][0]
    assert embed["name"] == "embed" and embed["shape"] == [64, 32]
    assert embed["grad_input_error"] is None
    first = embed["casts"][0]
    assert {k: first[k] for k in ("operand", "gemm", "dtype", "granularity")} == {
        "operand": "input",
        "gemm": "output",
        "dtype": "float8_e4m3fn",
        "granularity": "tensorwise",
    }
    stats = tensorwise.layers[0].casts[0].stats
    assert first["stats"]["amax"] == stats.amax and first["stats"]["flushed"] == stats.flushed
    assert set(first["stats"]) == {
        "amax", "scale", "scale_max", "saturated", "flushed", "subnormal", "nonfinite"
    }  # fmt: skip


class TwoWays(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(32, 32)
        self.b = nn.Linear(32, 32)  # never called
        self.head = nn.Linear(32, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(F.gelu(self.a(x)))


def test_a_healthy_model_at_o1_and_a_layer_the_batch_never_calls():
    torch.manual_seed(0)
    model = TwoWays()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    x, y = torch.randn(32, 32), torch.randn(32, 16)
    report = diagnose_float8(model, x, y, F.mse_loss, "mixed_float8", "O1", float8=SMALL)
    assert report.level == "O1" and report.healthy
    assert [r.name for r in report.layers] == ["a"] and report.not_run == ["b"]
    assert report.advice[0].startswith("healthy: float8 costs each of the 1 float8 layers")
    assert report.advice[1] == "not called by this batch, not diagnosed: b"
    # The model is copied, never touched.
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
    assert mp.module_dtypes(model)[0].compute == "float32"
    # keep_bfloat16 passes through: the kept layer is not float8, so not diagnosed.
    report = diagnose_float8(model, x, y, F.mse_loss, float8=SMALL, keep_bfloat16=["b"])
    assert report.not_run == [] and [r.name for r in report.layers] == ["a"]


def test_both_passes_draw_the_same_dropout_mask_and_the_rng_is_left_as_it_was():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 32), nn.Dropout(0.5), nn.Linear(32, 16))
    x, y = torch.randn(32, 32), torch.randn(32, 16)
    before = torch.get_rng_state()
    report = diagnose_float8(model, x, y, F.mse_loss, float8=SMALL)
    assert torch.equal(torch.get_rng_state(), before)
    # The same mask in both passes: the float8 loss is within float8's error of bfloat16's.
    assert report.loss_gap < 0.05, str(report)


def test_bad_arguments_say_what_is_valid():
    x, y = readings(BATCH, seed=0)
    with pytest.raises(ValueError, match=r"diagnose_float8\(policy='mixed_bfloat16'\) needs a "
                       r"float8 policy; valid: mixed_float8, mixed_float8_rowwise, "
                       r"mixed_float8_rowwise_with_gw_hp \(for other policies use "
                       r"mixprec.diagnose\)"):  # fmt: skip
        diagnose_float8(sensors(), x, y, F.mse_loss, "mixed_bfloat16")
    with pytest.raises(ValueError, match=r"float8='blockwise' is not a float8 recipe; valid: "
                       r"tensorwise, rowwise, rowwise_with_gw_hp"):  # fmt: skip
        diagnose_float8(sensors(), x, y, F.mse_loss, "compute=bfloat16,float8=blockwise")
    with pytest.raises(ValueError, match=r"'mixed_float8_blockwise' is not a known policy"):
        diagnose_float8(sensors(), x, y, F.mse_loss, "mixed_float8_blockwise")
    # torchao's H100 size thresholds convert none of these small layers.
    with pytest.raises(ValueError, match=(
        r"^diagnose_float8: policy 'mixed_float8' at level O2 converts no Linear layer of this "
        r"model to float8 \(4 considered: embed: below torchao's tensorwise size threshold .*; "
        r"and 1 more\)\. Pass float8=Float8Options\(min_features=\.\.\.\) to convert smaller "
        r"layers\.$"
    )):  # fmt: skip
        diagnose_float8(sensors(), x, y, F.mse_loss)
    with pytest.raises(ValueError, match=r"diagnose_float8\(level='o0'\): O0 runs everything "
                       r"in float32 and converts no layer to float8; valid: O1, O2, O3, "
                       r"auto \(O2\)$"):  # fmt: skip
        diagnose_float8(sensors(), x, y, F.mse_loss, level="o0", float8=SMALL)
    with pytest.raises(ValueError, match=r"level='O4' is not a known level; valid: O0, O1, O2, O3"):
        diagnose_float8(sensors(), x, y, F.mse_loss, level="O4", float8=SMALL)
    prepared = mp.auto_mixed_precision(sensors(), "mixed_float8", float8=SMALL)
    with pytest.raises(ValueError, match=r"needs the float32 model, before auto_mixed_precision"):
        diagnose_float8(prepared, x, y, F.mse_loss, float8=SMALL)
    with pytest.raises(TypeError, match=r"diagnose_float8\(model=...\) needs an nn.Module, got"):
        diagnose_float8(lambda t: t, x, y, F.mse_loss)  # type: ignore[arg-type]


def test_mp_diagnose_dispatches_float8_policies():
    x, y = readings(64, 0)
    report = mp.diagnose(sensors(), x, y, F.mse_loss, "mixed_float8_rowwise", float8=SMALL)
    assert isinstance(report, Float8Report) and report.recipe == "rowwise"
    assert {r.name for r in report.layers} == {"embed", "fc1", "fc2"}
    with pytest.raises(ValueError, match=r"loss_scale=8 does not apply to float8 policies"):
        mp.diagnose(sensors(), x, y, F.mse_loss, "mixed_float8", loss_scale=8, float8=SMALL)
    with pytest.raises(ValueError, match=r"keep_bfloat16 apply to float8 policies only"):
        mp.diagnose(sensors(), x, y, F.mse_loss, "mixed_float16", keep_bfloat16=["fc1"])


def test_cli_doctor_with_a_float8_policy(tmp_path, capsys):
    from mixprec import cli

    out = tmp_path / "r.json"
    argv = ["doctor", "--policy", "mixed_float8", "--batch-size", "32", "--json", str(out)]
    assert cli.main(argv) == 0
    text = capsys.readouterr().out
    assert "float8 doctor: policy mixed_float8 (tensorwise)" in text
    assert {row["name"] for row in json.loads(out.read_text())["layers"]} == {"1", "3"}
    assert cli.main(["doctor", "--policy", "mixed_float8", "--plot", str(tmp_path / "p.png")]) == 2
    assert "--plot: the float8 doctor's report is a table; use --json" in capsys.readouterr().err
