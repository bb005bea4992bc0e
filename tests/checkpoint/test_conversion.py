"""Dtype conversion on load and convert: out-of-range values under each on_range, NaN and
inf refused by name (buffers exempt), dtypes that do not convert meaningfully."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import mixprec as mp
from tests.checkpoint._helpers import trained
from tests.conftest import make_mlp


@pytest.mark.parametrize("sign", [1.0, -1.0])
def test_out_of_range_values_error_clamp_ignore(tmp_path, sign):
    big = make_mlp()
    with torch.no_grad():
        big[0].weight[0, 0] = sign * 1e6  # beyond float16's 65504
    path = mp.save_checkpoint(tmp_path / "big.safetensors", big)
    target = lambda: mp.auto_mixed_precision(make_mlp(), "mixed_float16", "O2")  # noqa: E731
    with pytest.raises(mp.CheckpointError, match=r"tensor '0.weight' has max \|value\| 1e\+06"):
        mp.load_checkpoint(path, target())
    clamped = target()
    report = mp.load_checkpoint(path, clamped, on_range="clamp")
    assert report.out_of_range == [("0.weight", 1e6, "float16", "clamp")]
    assert clamped[0].weight[0, 0].item() == sign * 65504.0
    ignored = target()
    mp.load_checkpoint(path, ignored, on_range="ignore")
    assert ignored[0].weight[0, 0].item() == sign * float("inf")
    with pytest.raises(ValueError, match="on_range='wrap' is invalid"):
        mp.load_checkpoint(path, target(), on_range="wrap")  # type: ignore[arg-type]


@pytest.mark.parametrize("sign", [1.0, -1.0])
def test_bfloat16_values_past_float16_clamp_to_its_max_not_to_inf(tmp_path, sign):
    """float16's max, 65504, is no bfloat16 value: clamped in bfloat16 it would round to
    65536, which is inf in float16."""
    source = make_mlp().to(torch.bfloat16)
    with torch.no_grad():
        source[0].weight[0, 0] = sign * 1e6
    path = mp.save_checkpoint(tmp_path / "bf16.safetensors", source)
    target = make_mlp().to(torch.float16)
    report = mp.load_checkpoint(path, target, on_range="clamp")
    assert [(name, how) for name, _, _, how in report.out_of_range] == [("0.weight", "clamp")]
    assert target[0].weight[0, 0].item() == sign * 65504.0
    assert torch.isfinite(target[0].weight).all()


def _with_bad_values():
    model = make_mlp()
    with torch.no_grad():
        model[0].weight[0, :3] = torch.tensor([float("nan"), float("inf"), 1.0])
        model[5].bias[1] = float("-inf")
    return model


@pytest.mark.parametrize("on_range", ["error", "clamp"])
@pytest.mark.parametrize("level", ["O0", "O2"])
def test_non_finite_weights_are_refused_by_name(tmp_path, on_range, level):
    path = mp.save_checkpoint(tmp_path / "nan.safetensors", _with_bad_values())
    target = mp.auto_mixed_precision(make_mlp(seed=1), "mixed_float16", level)
    before = {k: v.clone() for k, v in target.state_dict().items()}
    # Loaded, they would make every step skip; 'clamp' has no finite value for a NaN.
    with pytest.raises(
        mp.CheckpointError,
        match=r"non-finite values in 2 tensor\(s\): '0.weight' \(1 NaN, 1 inf\), "
        r"'5.bias' \(0 NaN, 1 inf\).*on_range='ignore' loads them",
    ):
        mp.load_checkpoint(path, target, on_range=on_range)
    assert all(torch.equal(before[k], v) for k, v in target.state_dict().items())


def test_non_finite_values_load_under_ignore_and_in_optimizer_state_are_refused(tmp_path):
    path = mp.save_checkpoint(tmp_path / "nan.safetensors", _with_bad_values())
    model = make_mlp(seed=1)
    report = mp.load_checkpoint(path, model, on_range="ignore")
    assert report.non_finite == [("0.weight", 1, 1), ("5.bias", 0, 1)]
    assert "0.weight: 1 NaN, 1 inf (loaded as they are)" in str(report)
    assert model[0].weight[0, 0].isnan() and model[5].bias[1] == float("-inf")
    with pytest.raises(mp.CheckpointError, match=r"non-finite values in 2 tensor"):
        mp.convert_checkpoint(path, tmp_path / "out.safetensors", "bfloat16")

    model, opt = trained("mixed_bfloat16", "O2")
    with torch.no_grad():
        opt.optimizer.state[opt.optimizer.param_groups[0]["params"][0]]["exp_avg"][0, 0] = torch.nan
    path = mp.save_checkpoint(tmp_path / "opt.safetensors", model, opt)
    fresh = mp.auto_mixed_precision(make_mlp(), "mixed_bfloat16", "O2")
    fresh_opt = mp.LossScaleOptimizer(torch.optim.Adam(fresh.parameters(), lr=1e-2, eps=1e-4))
    with pytest.raises(
        mp.CheckpointError, match=r"'optim/optimizers/0/state/0/exp_avg' \(1 NaN, 0 inf\)"
    ):
        mp.load_checkpoint(path, fresh, fresh_opt)
    mp.load_checkpoint(path, make_mlp())  # the weights alone are finite


@pytest.mark.parametrize(
    ("dtype", "reason"),
    [
        (torch.complex64, "the imaginary parts would be dropped"),
        (torch.uint64, "quantized or foreign data"),
        (torch.bool, "booleans are flags"),
        (torch.int32, "quantized or foreign data"),
        (torch.float8_e4m3fn, "only with the scales stored beside them"),
    ],
)
def test_dtypes_that_do_not_convert_are_refused(tmp_path, dtype, reason):
    from safetensors.torch import save_file

    state = make_mlp().state_dict()
    state["3.weight"] = torch.ones(state["3.weight"].shape, dtype=dtype)
    save_file(state, tmp_path / "odd.safetensors")
    target = mp.auto_mixed_precision(make_mlp(seed=1), "mixed_bfloat16", "O2")
    before = {k: v.clone() for k, v in target.state_dict().items()}
    # Refused, not copied into the float32 LayerNorm weight with no `converted` entry (float8:
    # not converted without its scales; into bfloat16, no NotImplementedError).
    name = str(dtype).removeprefix("torch.")
    with pytest.raises(
        mp.CheckpointError,
        match=rf"tensor '3.weight' is {name} in the checkpoint; it does not convert to "
        rf"float32 \(.*{reason}",
    ):
        mp.load_checkpoint(tmp_path / "odd.safetensors", target)
    assert all(torch.equal(before[k], v) for k, v in target.state_dict().items())
    if dtype == torch.float8_e4m3fn:  # listed by inspect; refused by convert too
        tensors, _ = mp.read_checkpoint(tmp_path / "odd.safetensors")
        assert tensors["model/3.weight"].dtype == torch.float8_e4m3fn
        with pytest.raises(mp.CheckpointError, match="does not convert to float16 .float8"):
            mp.convert_checkpoint(tmp_path / "odd.safetensors", tmp_path / "o.st", "float16")


class _Masked(nn.Module):
    """A causal mask buffer of -inf, as attention models register."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.register_buffer("mask", torch.full((4, 4), float("-inf")).triu(1))

    def forward(self, x):
        return (self.lin(x) @ (self.mask.exp())).sum(-1)


def test_non_finite_buffers_load_and_export_as_saved(tmp_path):
    # A -inf mask buffer is normal: the non-finite check covers parameters and optimizer
    # state only.
    model = _Masked()
    path = mp.save_checkpoint(tmp_path / "m.safetensors", model)
    again = _Masked()
    nn.init.zeros_(again.lin.weight)
    report = mp.load_checkpoint(path, again)
    assert report.non_finite == [] and torch.equal(again.lin.weight, model.lin.weight)
    mp.export_weights(model, tmp_path / "w.safetensors", "bfloat16")
    with torch.no_grad():
        model.lin.weight[0, 0] = float("nan")  # a parameter still is refused
    bad = mp.save_checkpoint(tmp_path / "bad.safetensors", model)
    with pytest.raises(mp.CheckpointError, match=r"'lin.weight' \(1 NaN, 0 inf\)"):
        mp.load_checkpoint(bad, _Masked())


def test_clamp_saturates_a_buffers_finite_values_and_keeps_its_infinities(tmp_path):
    """A causal mask's -inf is meant: clamping it to -65504 would let masked positions
    through. Only the finite value past float16's range is saturated."""
    source = make_mlp()
    source.register_buffer("mask", torch.tensor([0.0, float("-inf"), 1e6, float("inf")]))
    path = mp.save_checkpoint(tmp_path / "mask.safetensors", source)
    target = make_mlp()
    target.register_buffer("mask", torch.zeros(4, dtype=torch.float16))
    report = mp.load_checkpoint(path, target, on_range="clamp")
    assert report.out_of_range == [("mask", 1e6, "float16", "clamp")]
    assert target.mask.tolist() == [0.0, float("-inf"), 65504.0, float("inf")]


@pytest.mark.parametrize("target", [torch.float16, torch.bfloat16])
def test_values_a_narrower_dtype_flushes_to_zero_are_counted_by_tensor(tmp_path, target):
    """float16's smallest subnormal is 6e-8, bfloat16's 9e-41: below, a value becomes 0."""
    source = make_mlp()
    with torch.no_grad():
        source[0].weight[0, :3] = torch.tensor([1e-9, -2e-42, 0.0])
        source[5].bias[0] = 3e-8  # rounds up to float16's subnormal 6e-8: kept
    path = mp.save_checkpoint(tmp_path / "tiny.safetensors", source)
    model = make_mlp().to(target)
    report = mp.load_checkpoint(path, model)
    lost = {torch.float16: 2, torch.bfloat16: 1}[target]
    assert report.underflow == [("0.weight", lost, str(target).removeprefix("torch."))]
    word = "values" if lost > 1 else "value"
    assert f"  0.weight: {lost} non-zero {word} below " in str(report)
    assert model[5].bias[0].item() != 0.0
    out = tmp_path / "out.safetensors"
    converted = mp.convert_checkpoint(path, out, target)
    assert converted.underflow == report.underflow
    assert mp.load_checkpoint(path, make_mlp()).underflow == []  # float32 holds them all


def test_optimizer_state_cast_to_16_bit_parameters_goes_through_on_range(tmp_path):
    # O3 keeps no masters: torch cast Adam's float32 moments to float16 as it loaded them,
    # a second moment of 9e4 to inf (its weight then never moved) and 1e-10 to 0, unlisted.
    def model(level: str) -> nn.Module:
        torch.manual_seed(0)
        return mp.auto_mixed_precision(nn.Sequential(nn.Linear(4, 4)), "mixed_float16", level)

    source = model("O2")
    opt = mp.LossScaleOptimizer(torch.optim.Adam(source.parameters(), lr=1e-3))
    opt.backward(source(torch.randn(8, 4)).float().mean())
    assert opt.step().applied
    with torch.no_grad():
        for state in opt.optimizers[0].state.values():
            state["exp_avg_sq"].view(-1)[:2] = torch.tensor([9e4, 1e-10])
    path = mp.save_checkpoint(tmp_path / "o2.safetensors", source, opt)

    def load(**kwargs):
        target = model("O3")
        inner = torch.optim.Adam(target.parameters(), lr=1e-3)
        report = mp.load_checkpoint(path, target, mp.LossScaleOptimizer(inner), **kwargs)
        return report, inner.state[target[0].weight]["exp_avg_sq"].view(-1)

    name = "optim/optimizers/0/state/0/exp_avg_sq"
    with pytest.raises(mp.CheckpointError, match=rf"tensor '{name}' has max \|value\| 90000"):
        load()
    report, moment = load(on_range="clamp")
    assert moment.dtype == torch.float16 and moment[0].item() == 65504.0
    assert (name, 9e4, "float16", "clamp") in report.out_of_range
    assert (name, 1, "float16") in report.underflow and moment[1].item() == 0.0
    assert (name, "float32", "float16") in report.converted


@pytest.mark.parametrize("built", ["after", "before"])
def test_clamped_weights_leave_the_other_float32_digits_to_the_masters(tmp_path, built):
    # The unclamped values were kept on the weight; they do not round to it, so masters
    # built later started from every value's float16 rounding, not the one clamped.
    source = make_mlp()
    with torch.no_grad():
        source[0].weight[0, 0] = 1e5  # beyond float16's 65504
    path = mp.save_checkpoint(tmp_path / "big.safetensors", source)
    expected = source[0].weight.detach().clone()
    expected[0, 0] = 65504.0
    model = mp.auto_mixed_precision(make_mlp(), "mixed_float16", "O2")
    opt = None if built == "after" else mp.LossScaleOptimizer(torch.optim.SGD(model.parameters()))
    mp.load_checkpoint(path, model, on_range="clamp")  # optimizer=None: weights alone
    opt = opt or mp.LossScaleOptimizer(torch.optim.SGD(model.parameters()))
    opt.state_dict()  # a built optimizer's masters follow the load here
    assert torch.equal(dict(opt.master_weights())[model[0].weight], expected)
