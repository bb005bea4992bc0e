"""The doctor's advice: underflowing gradients get the loss scale that fixes them, with the
scaler that applies it."""

from __future__ import annotations

import torch

import mixprec as mp
from tests.doctor.cases import CE, batch, healthy


def test_underflowing_gradients_get_the_loss_scale_that_fixes_them():
    x, y = batch()
    tiny = lambda out, target: CE(out, target) * 1e-9  # noqa: E731 - gradients ~1e-12
    report = mp.diagnose(healthy(), x, y, tiny, policy="mixed_float16")
    assert report.culprits(), "underflow must be flagged"
    assert any("flush to zero" in r for m in report.culprits() for r in m.reasons)
    scale = report.suggested_loss_scale
    low, high = report.loss_scale_range
    assert low <= scale <= high and scale == 2.0 ** round(torch.tensor(scale).log2().item())
    assert any(f"StaticLossScaler({scale:g})" in a for a in report.advice)

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
