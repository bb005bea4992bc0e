"""The doctor's advice: underflowing gradients get the loss scale that fixes them, with the
scaler that applies it."""

from __future__ import annotations

import copy
import math

import torch

import mixprec as mp
from mixprec.doctor.headroom import percent
from tests.doctor.cases import CE, batch, healthy, saturated_head


def test_underflowing_gradients_get_the_loss_scale_that_fixes_them():
    x, y = batch()
    tiny = lambda out, target: CE(out, target) * 1e-9  # noqa: E731 - gradients ~1e-12
    report = mp.diagnose(healthy(), x, y, tiny, policy="mixed_float16")
    assert report.culprits(), "underflow must be flagged"
    assert any("flush to zero" in r for m in report.culprits() for r in m.reasons)
    scale = report.suggested_loss_scale
    low, high = report.loss_scale_range
    assert low <= scale <= high and scale == 2.0 ** round(torch.tensor(scale).log2().item())
    # A power of two written as one (:g rounded 2**49 to 5.6295e+14, no power of two).
    written = f"2**{int(math.log2(scale))}" if scale >= 2**16 else f"{scale:g}"
    assert any(f"StaticLossScaler({written})" in a for a in report.advice), report.advice
    # The "at the edge" line's suggestion is written the same way (it was "5.49756e+11",
    # no power of two copied, and refused as an init_scale above the default max_scale).
    edge = [a for a in report.advice if a.startswith("at the edge")]
    assert edge and f"(suggested: {written}, with max_scale raised past its default" in edge[0]

    reference = healthy()
    tiny(reference(x), y).backward()
    errors = {}
    for name, scaler in (("default", mp.DynamicLossScaler()),
                         ("suggested", mp.StaticLossScaler(scale))):  # fmt: skip
        model = mp.auto_mixed_precision(healthy(), "mixed_float16", "O2")
        opt = mp.LossScaleOptimizer(torch.optim.SGD(model.parameters(), 0.1), loss_scaler=scaler)
        opt.backward(tiny(model(x), y))
        opt.unscale_()
        errors[name] = max(
            float((m.grad - p.grad).norm() / p.grad.norm())
            for m, p in zip(opt.master_params(), reference.parameters(), strict=True)
        )
    assert errors["default"] > 0.3  # most of the gradient is lost at 2**16
    assert errors["suggested"] < 0.05  # float16 rounding only


def test_no_loss_scale_fits_is_said_alone_and_flushed_gradients_are_not_at_the_edge():
    """The advice read "use a loss scale in [5.71e+28, 2.47e+03], e.g. StaticLossScaler(2048)"
    (an empty range, with an example) before "no single float16 loss scale fits"; and it put
    '2' and '3' "at the edge" where their small gradients x 2048 sat over 100x below
    float16's smallest subnormal: flushed already."""
    model, x, y = saturated_head()
    reference, outputs = copy.deepcopy(model), {}
    for i in (2, 3):
        reference[i].register_forward_hook(lambda m, a, out, i=i: outputs.update({i: out}))
    loss = CE(reference(x), y)
    taken = dict(zip(outputs, torch.autograd.grad(loss, list(outputs.values())), strict=True))
    report = mp.diagnose(model, x, y, CE, policy="mixed_float16", check_steps=0)
    low, high = report.loss_scale_range
    assert low > high and report.loss_scale_reached == 2048 and report.at_edge == []
    assert report.advice[1:] == [
        "past the edge: at loss scale 2048 some small gradients of '2', '3' fall below "
        "float16's smallest subnormal (5.96e-08) and flush to zero",
        "no single float16 loss scale fits both the smallest and the largest gradients: use "
        "bfloat16, or keep the layers with the largest gradients in float32",
    ]
    by_name = {m.name: m for m in report.modules}
    assert by_name["2"].reasons == [
        "small gradients (2.13e-13) x loss scale 2048 = 4.36e-10, 137x below float16's "
        "smallest subnormal (5.96e-08): 7.54% of its gradients flush to zero at that scale"
    ]
    assert by_name["3"].reasons[-1] == (
        "small gradients (2.33e-13) x loss scale 2048 = 4.78e-10, 125x below float16's "
        "smallest subnormal (5.96e-08): 6.25% of its gradients flush to zero at that scale"
    )
    # The shares are those of the float32 gradients that float16 at 2048 makes zero.
    for i, said in ((2, "7.54%"), (3, "6.25%")):
        grad = taken[i][taken[i] != 0]
        assert percent(float(((grad * 2048).half() == 0).float().mean())) == said


class _Loop(torch.nn.Module):
    """One Linear applied three times (a shared or recurrent block): its outputs reach 85,
    3.4e3, then 1.4e5, past float16's 65504, in the third call only."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.inp = torch.nn.Linear(16, 32)
        self.cell = torch.nn.Linear(32, 32, bias=False)
        self.head = torch.nn.Linear(32, 4)
        with torch.no_grad():
            self.cell.weight.copy_(torch.eye(32) * 40)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        for _ in range(3):
            h = self.cell(h)
        return self.head(h)


def test_a_module_called_several_times_is_named_for_its_overflowing_call():
    # Only its first call was looked at: the report named 'head' (the next layer) as where
    # the gradient first became inf, and showed 'cell' at 85 with no flag.
    x, y = batch()
    report = mp.diagnose(_Loop(), x, y, CE, policy="mixed_float16", check_steps=0)
    cell = next(m for m in report.modules if m.name == "cell")
    assert cell.max_output > 65504 and cell.nonfinite_output > 0
    assert any("output becomes inf/NaN here first" in r for r in cell.reasons), cell.reasons
    assert "cell" in report.recommended_keep_float32


def test_bfloat16_is_not_advised_where_float32_overflows_too():
    x, y = batch()
    model = healthy()
    with torch.no_grad():
        for p in list(model.parameters())[2:]:
            p.mul_(1e20)  # past float32's range in the forward
    report = mp.diagnose(model, x, y, CE, policy="mixed_float16", level="O1", check_steps=0)
    assert not math.isfinite(report.loss_float32) and not report.bfloat16_would_help
    assert "overflows in float32" in report.advice[0]
    assert not any("avoids the overflow" in a for a in report.advice)


class _SharedAfterBlowUp(torch.nn.Module):
    """A shared Linear called before and after a x1e5 layer: its second call receives the
    inf the big layer made, and is not where the overflow starts."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.shared, self.big = torch.nn.Linear(16, 16), torch.nn.Linear(16, 16)
        self.head = torch.nn.Linear(16, 4)
        with torch.no_grad():
            self.big.weight.mul_(1e5)  # outputs ~1.5e5, past 65504

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.shared(self.big(self.shared(x))))


def test_a_shared_module_fed_an_upstream_inf_is_not_named_its_origin():
    # Its outputs counted over every call but its inputs over the first alone: it looked
    # like a non-finite output from finite input, and was named before the real origin.
    x, y = batch()
    report = mp.diagnose(_SharedAfterBlowUp(), x, y, CE, policy="mixed_float16", check_steps=0)
    named = {m.name: m.overflow_origin for m in report.modules}
    assert named["big"] and not named["shared"]
    big = next(m for m in report.modules if m.name == "big")
    assert any("output becomes inf/NaN here first" in r for r in big.reasons)
