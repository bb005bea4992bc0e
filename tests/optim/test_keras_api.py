"""Keras' methods: get_scaled_loss, get_unscaled_gradients, apply_gradients."""

from __future__ import annotations

import warnings

import pytest
import torch

import mixprec as mp
from tests.conftest import make_mlp
from tests.optim._helpers import loss_of, prepared


def test_keras_style_methods():
    model, opt = prepared("mixed_float16")
    params = list(model.parameters())
    scaled = opt.get_scaled_loss(loss_of(model))
    grads = torch.autograd.grad(scaled, params)
    unscaled = opt.get_unscaled_gradients(grads)
    scale = opt.loss_scaler.get_scale()
    assert torch.equal(unscaled[0], grads[0].float() * (1.0 / scale))  # float32: no flush
    before = [p.detach().clone() for p in params]
    result = opt.apply_gradients(zip(unscaled, params, strict=True))
    assert result.applied
    assert not any(torch.equal(a, b) for a, b in zip(before, params, strict=True))
    bad = [torch.full_like(g, float("nan")) for g in unscaled]
    assert not opt.apply_gradients(zip(bad, params, strict=True)).applied
    with pytest.raises(ValueError, match=r"variable 0 \(shape \(3,\), torch.float32\) is not a"):
        opt.apply_gradients([(torch.ones(3), torch.zeros(3))])
    with pytest.raises(ValueError, match=r"gradient 0 has shape \(2,\), its variable \(64, 32\)"):
        opt.apply_gradients([(torch.ones(2), params[0])])


def test_accumulation_misuse_and_keras_path_averages():
    model, opt = prepared("mixed_float16")
    opt = mp.LossScaleOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), accumulation_steps=2)
    opt.backward(loss_of(model))
    with pytest.raises(RuntimeError, match=r"unscale_\(\) called after 1 of 2 accumulation"):
        opt.unscale_()
    loss = loss_of(model)
    scaled = opt.get_scaled_loss(loss)
    assert scaled.item() == pytest.approx(loss.item() * opt.loss_scaler.get_scale() / 2)


def test_keras_unscaled_gradients_of_16_bit_weights_are_float32():
    """Unscaling float16 gradients in float16 would flush small values to zero."""
    model = mp.auto_mixed_precision(make_mlp(), "mixed_float16", "O2")
    opt = mp.LossScaleOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    params = list(model.parameters())
    grads = torch.autograd.grad(opt.get_scaled_loss(loss_of(model) * 1e-6), params)
    unscaled = opt.get_unscaled_gradients(grads)
    assert unscaled[0].dtype == torch.float32
    assert unscaled[0].abs().max() > 0
    assert opt.apply_gradients(zip(unscaled, params, strict=True)).applied


def test_unscaling_the_gradients_of_a_loss_never_scaled_warns_once():
    """A Keras loop that forgot get_scaled_loss: its gradients came out 65536 times too
    small under float16 (loss 1.48 after 100 steps where the right loop reached 0.001),
    saying nothing."""
    model = mp.auto_mixed_precision(make_mlp(), "mixed_float16", "O2")
    opt = mp.LossScaleOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    params = list(model.parameters())

    def step(scaled: bool) -> None:
        loss = loss_of(model)
        grads = torch.autograd.grad(opt.get_scaled_loss(loss) if scaled else loss, params)
        opt.apply_gradients(zip(opt.get_unscaled_gradients(grads), params, strict=True))

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        step(scaled=True)
    with pytest.warns(UserWarning, match=r"no loss was multiplied by it .* 65536 times too small"):
        step(scaled=False)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        step(scaled=False)  # said once
        bf16 = mp.auto_mixed_precision(make_mlp(), "mixed_bfloat16", "O2")
        plain = mp.LossScaleOptimizer(torch.optim.SGD(bf16.parameters(), lr=0.1))
        grads = torch.autograd.grad(loss_of(bf16), list(bf16.parameters()))
        plain.get_unscaled_gradients(grads)  # scale 1: nothing to divide, nothing to say


@pytest.mark.parametrize("level", ["O1", "O2"])
def test_applying_the_scaled_losss_gradients_unscaled_warns_once(level):
    """Keras 3's ``apply`` unscales; here ``apply_gradients`` takes them as given. The scaled
    loss's gradients, applied as they were, moved the weights by 489 where float32 moved
    them by 0.0075, unsaid."""
    model, opt = prepared("mixed_float16", level)
    params = list(model.parameters())
    grads = torch.autograd.grad(opt.get_scaled_loss(loss_of(model)), params)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the right path says nothing
        opt.apply_gradients(zip(opt.get_unscaled_gradients(grads), params, strict=True))
    grads = torch.autograd.grad(opt.get_scaled_loss(loss_of(model)), params)
    said = r"apply_gradients\(\) got gradients while a loss was multiplied by the loss scale "
    with pytest.warns(UserWarning, match=said + r"\(65536\) .*opt.get_unscaled_gradients"):
        opt.apply_gradients(zip(grads, params, strict=True))
    grads = torch.autograd.grad(opt.get_scaled_loss(loss_of(model)), params)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once
        opt.apply_gradients(zip(grads, params, strict=True))
