"""What a float16 scaled backward reaches outside the LossScaleOptimizer's parameters (an
input's gradient, a latent stepped by another optimizer, a module backward hook) is
multiplied by the loss scale: said once, at the first scaled loss. Before, a raw
gradient-ascent input came back 65536 times float32's and a latent under plain SGD moved
3130 times too far, unsaid."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import mixprec as mp


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 4))


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return torch.randn(8, 16, generator=g), torch.randint(0, 4, (8,), generator=g)


@pytest.mark.parametrize("level", ["O1", "O2"])
def test_an_inputs_gradient_is_said_scaled_and_the_advice_recovers_float32s(level):
    x, y = _batch()
    control_x = x.clone().requires_grad_(True)
    F.cross_entropy(_net()(control_x), y).backward()
    model = mp.auto_mixed_precision(_net(), "mixed_float16", level)
    opt = mp.LossScaleOptimizer(torch.optim.SGD(model.parameters(), 0.1))
    x.requires_grad_(True)
    said = r"1 tensor\(s\) outside this LossScaleOptimizer get gradients from its scaled"
    with pytest.warns(UserWarning, match=said + r" backward \(shapes \(8, 16\).*65536") as seen:
        opt.backward(F.cross_entropy(model(x).float(), y))
    assert __file__ in [w.filename for w in seen]
    scale = opt.loss_scaler.get_scale()
    assert x.grad.norm() / control_x.grad.norm() == pytest.approx(scale, rel=1e-2)
    torch.testing.assert_close(x.grad / scale, control_x.grad, rtol=2e-2, atol=1e-5)


def test_a_latent_stepped_beside_the_wrapper_is_said_and_one_wrapper_trains_it_as_float32():
    def run(kind: str) -> torch.Tensor:
        torch.manual_seed(3)
        z = torch.zeros(8, 16, requires_grad=True)
        model = (
            _net() if kind == "float32" else mp.auto_mixed_precision(_net(), "mixed_float16", "O2")
        )
        inner, optz = torch.optim.SGD(model.parameters(), 0.2), torch.optim.SGD([z], 0.5)
        if kind == "float32":
            opt = inner
        else:
            opt = mp.LossScaleOptimizer(inner if kind == "beside" else [inner, optz])
        x, y = _batch()
        for _ in range(5):
            loss = F.cross_entropy(model(x + z).float(), y)
            opt.backward(loss) if kind != "float32" else loss.backward()
            opt.step()
            if kind != "joined":
                optz.step()
                optz.zero_grad()
            opt.zero_grad()
        return z.detach()

    control = run("float32")
    with pytest.warns(
        UserWarning, match=r"shapes \(8, 16\).*mp\.LossScaleOptimizer\(\[opt, other\]\)"
    ):
        beside = run("beside")
    assert (beside - control).norm() > 100 * control.norm()  # moved by the scale
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        joined = run("joined")
    torch.testing.assert_close(joined, control, rtol=1e-2, atol=1e-4)


def test_a_module_backward_hook_is_said_to_see_the_scale():
    model = mp.auto_mixed_precision(_net(), "mixed_float16", "O2")
    seen_norms: list[float] = []
    model[2].register_full_backward_hook(lambda m, gi, go: seen_norms.append(float(go[0].norm())))
    opt = mp.LossScaleOptimizer(torch.optim.SGD(model.parameters(), 0.1))
    x, y = _batch()
    with pytest.warns(UserWarning, match=r"module backward hooks \(register_full_backward_hook\)"):
        opt.backward(F.cross_entropy(model(x).float(), y))
    assert seen_norms and seen_norms[0] > 1000  # scaled, as said


def test_nothing_is_said_without_a_scale_or_outside_tensors():
    x, y = _batch()
    cases = [
        ("mixed_bfloat16", True),  # scale 1: the input's gradient is float32's
        ("mixed_float16", False),  # every leaf is the optimizer's own
    ]
    for policy, input_grad in cases:
        model = mp.auto_mixed_precision(_net(), policy, "O2")
        opt = mp.LossScaleOptimizer(torch.optim.SGD(model.parameters(), 0.1))
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            opt.backward(F.cross_entropy(model(x.clone().requires_grad_(input_grad)).float(), y))
    # A GAN: the generator's backward reaches the prepared discriminator, whose own
    # optimizer and checks handle its parameters.
    gen = mp.auto_mixed_precision(_net(), "mixed_float16", "O2")
    torch.manual_seed(1)
    disc = mp.auto_mixed_precision(nn.Linear(4, 1), "mixed_float16", "O2")
    g_opt = mp.LossScaleOptimizer(torch.optim.SGD(gen.parameters(), 0.1))
    mp.LossScaleOptimizer(torch.optim.SGD(disc.parameters(), 0.1))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        g_opt.backward(disc(gen(x)).float().mean())


def test_nothing_is_said_where_no_grad_is_written():
    """Keras' loop (``torch.autograd.grad`` over the scaled loss) and ``backward(inputs=
    ...)`` write no ``.grad`` into the input: said before, though nothing was scaled there."""
    x, y = _batch()
    model = mp.auto_mixed_precision(_net(), "mixed_float16", "O2")
    opt = mp.LossScaleOptimizer(torch.optim.SGD(model.parameters(), 0.1))
    params = list(model.parameters())
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        xg = x.clone().requires_grad_(True)
        scaled = opt.get_scaled_loss(F.cross_entropy(model(xg).float(), y))
        grads = torch.autograd.grad(scaled, params)
        assert xg.grad is None and all(g is not None for g in grads)
        opt.zero_grad()
        xg = x.clone().requires_grad_(True)
        opt.backward(F.cross_entropy(model(xg).float(), y), inputs=params)
        assert xg.grad is None
