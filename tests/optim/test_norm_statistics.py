"""A skipped step whose forward had made BatchNorm's running statistics inf/NaN
(``mixprec.optim.norm_statistics``): they are reset and named, not left to turn every
evaluation output NaN."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

import mixprec as mp


def _cnn() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8), nn.ReLU(), nn.Flatten(), nn.Linear(8 * 6 * 6, 4)
    )


def _step(model, opt, x, y, loss_gain=1.0):
    opt.zero_grad()
    opt.backward(nn.functional.cross_entropy(model(x), y) * loss_gain)
    return opt.step()


def test_statistics_an_overflowing_forward_poisoned_are_reset_and_named():
    """One outlier sample (x 3e4) overflowed the float16 convolution: the step was skipped,
    but running_var had taken inf, and evaluation gave NaN for every input (accuracy 0.30
    where float32 reached 1.00), saying nothing."""
    model = mp.auto_mixed_precision(_cnn(), "mixed_float16", "O2")
    opt = mp.LossScaleOptimizer(torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9))
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(64, 3, 8, 8, generator=g), torch.randint(0, 4, (64,), generator=g)
    for _ in range(3):
        assert _step(model, opt, x, y).applied
    outlier = x.clone()
    outlier[0] *= 3e4
    with pytest.warns(
        UserWarning, match=r"running statistics of 1 normalisation layer\(s\) inf/NaN \(1\)"
    ):
        result = _step(model, opt, outlier, y)
    assert not result.applied
    bn = model[1]
    assert torch.isfinite(bn.running_var).all() and torch.isfinite(bn.running_mean).all()
    assert bn.num_batches_tracked.item() == 0  # reset: they build up again
    for _ in range(20):
        _step(model, opt, x, y)
    model.eval()
    with torch.no_grad():
        out = model(x)
    assert torch.isfinite(out).all()


def test_a_step_skipped_in_the_backward_alone_leaves_the_statistics():
    """Gradients past float16 with a finite forward: nothing to reset, nothing said."""
    model = mp.auto_mixed_precision(_cnn(), "mixed_float16", "O2")
    opt = mp.LossScaleOptimizer(torch.optim.SGD(model.parameters(), lr=0.05))
    x, y = torch.randn(16, 3, 8, 8), torch.randint(0, 4, (16,))
    assert _step(model, opt, x, y).applied
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert not _step(model, opt, x, y, loss_gain=1e30).applied
    assert model[1].num_batches_tracked.item() == 2  # both forwards counted, none reset


def test_every_model_behind_the_optimizer_is_looked_at():
    """Two prepared encoders, one optimizer, one loss: an out-of-range batch for the
    second encoder skipped the step, and only the first encoder's statistics were looked
    at, so the second's stayed NaN and every evaluation of it was NaN, unsaid."""
    encoders = []
    for seed in (0, 1):
        torch.manual_seed(seed)
        net = nn.Sequential(nn.Linear(8, 8), nn.BatchNorm1d(8), nn.Linear(8, 4))
        encoders.append(mp.auto_mixed_precision(net, "mixed_float16", "O2"))
    a, b = encoders
    opt = mp.LossScaleOptimizer(torch.optim.AdamW([*a.parameters(), *b.parameters()], lr=1e-3))
    g = torch.Generator().manual_seed(1)
    xa, xb = torch.randn(16, 8, generator=g), torch.randn(16, 8, generator=g)
    opt.backward((a(xa) - b(xb)).pow(2).mean())
    assert opt.step().applied
    opt.zero_grad()
    with pytest.warns(UserWarning, match=r"of 1 normalisation layer\(s\) inf/NaN \(1\)"):
        opt.backward((a(xa) - b(xb * 1e5)).pow(2).mean())
        assert not opt.step().applied
    assert torch.isfinite(b[1].running_var).all() and torch.isfinite(b[1].running_mean).all()
    b.eval()
    with torch.no_grad():
        assert torch.isfinite(b(xb)).all()
