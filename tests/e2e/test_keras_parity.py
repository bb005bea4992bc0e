"""Keras 3 parity: Policy(None), scale_loss, and Keras 3's loss-scale schedule by its names."""

from __future__ import annotations

import math
import random

import pytest
import torch
from torch import nn

import mixprec as mp


def _opt(**kwargs: object) -> mp.LossScaleOptimizer:
    return mp.LossScaleOptimizer(torch.optim.SGD([nn.Parameter(torch.ones(3))], lr=0.1), **kwargs)


# -- Policy(None) ---------------------------------------------------------------------------


def test_policy_none_follows_the_global_policy() -> None:
    assert mp.Policy(None) == mp.Policy("float32")
    with mp.policy_scope("mixed_bfloat16"):
        assert mp.Policy(None) == mp.Policy("mixed_bfloat16")
        assert mp.Policy() == mp.Policy("mixed_bfloat16")
    # Read at construction, as Keras 3 does: a later global change does not alter it.
    with mp.policy_scope("mixed_float16"):
        kept = mp.Policy(None)
    assert kept == mp.Policy("mixed_float16")
    assert mp.Policy(None) == mp.Policy("float32")


def test_policy_dtype_keywords_do_not_follow_the_global_policy() -> None:
    with mp.policy_scope("mixed_bfloat16"):
        p = mp.Policy(compute_dtype="float16")
    assert (p.param_dtype, p.compute_dtype, p.output_dtype) == (
        torch.float32,
        torch.float16,
        torch.float32,
    )


# -- scale_loss -----------------------------------------------------------------------------


def test_scale_loss_is_a_pure_read() -> None:
    opt = _opt(initial_scale=1024.0)
    loss = torch.tensor(0.5)
    assert opt.scale_loss(loss).item() == 512.0
    # Not a micro-batch: step() still asks for a backward.
    with pytest.raises(mp.MisuseError, match="without a new backward"):
        opt.step()
    assert opt.loss_scaler.get_scale() == 1024.0


def test_scale_loss_with_autograd_grad_and_apply_gradients_trains_as_float32() -> None:
    torch.manual_seed(0)
    x, y = torch.randn(16, 4), torch.randn(16, 1)
    ref = nn.Linear(4, 1)
    lin = nn.Linear(4, 1)
    lin.load_state_dict(ref.state_dict())
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    opt = mp.LossScaleOptimizer(torch.optim.SGD(lin.parameters(), lr=0.1), initial_scale=2.0**10)
    for _ in range(5):
        ref_opt.zero_grad()
        nn.functional.mse_loss(ref(x), y).backward()
        ref_opt.step()
        params = list(lin.parameters())
        grads = torch.autograd.grad(opt.scale_loss(nn.functional.mse_loss(lin(x), y)), params)
        result = opt.apply_gradients(zip(opt.get_unscaled_gradients(grads), params, strict=True))
        assert result.applied
    for a, b in zip(ref.parameters(), lin.parameters(), strict=True):
        # A power-of-two scale is exact in float32: the updates are the same bits.
        torch.testing.assert_close(a, b, rtol=0, atol=0)


# -- Keras 3's LossScaleOptimizer schedule --------------------------------------------------


def _keras3_schedule(overflows: list[bool], initial: float, growth_steps: int) -> list[float]:
    """Keras 3.x ``LossScaleOptimizer`` (keras/src/optimizers/loss_scale_optimizer.py):
    a finite step applies, then doubles the scale when ``step_counter`` reached
    ``dynamic_growth_steps - 1`` (resetting it) or else increments it; a non-finite step
    resets the counter and halves the scale. No floor, no ceiling."""
    scale, counter, scales = initial, 0, []
    for overflow in overflows:
        if overflow:
            counter, scale = 0, scale * 0.5
        elif counter == growth_steps - 1:
            counter, scale = 0, scale * 2.0
        else:
            counter += 1
        scales.append(scale)
    return scales


def test_keras_names_give_keras3_defaults() -> None:
    opt = _opt(initial_scale=None, dynamic_growth_steps=2000)
    cfg = opt.loss_scaler.config
    assert opt.loss_scaler.get_scale() == 2.0**15
    assert (cfg.growth_factor, cfg.backoff_factor, cfg.growth_interval) == (2.0, 0.5, 2000)
    assert (cfg.hysteresis, cfg.max_scale) == (1, None)


@pytest.mark.parametrize("seed", range(5))
def test_keras_names_follow_keras3_schedule(seed: int) -> None:
    rng = random.Random(seed)
    growth = rng.choice([1, 2, 3, 7])
    # Growth past mixprec's default ceiling of 2**24, random runs of clean steps and bursts
    # of overflows, then overflows down below mixprec's default floor of 1 (but not to
    # float32's smallest normal, where mixprec stops and Keras 3 goes on halving).
    overflows = [False] * (growth * 12)
    for _ in range(40):
        overflows += [False] * rng.randint(0, 2 * growth) + [True] * rng.randint(0, 2)
    last = _keras3_schedule(overflows, 2.0**15, growth)[-1]
    overflows += [True] * (max(0, math.ceil(math.log2(last))) + 3)
    opt = _opt(initial_scale=2.0**15, dynamic_growth_steps=growth)
    ours = []
    for overflow in overflows:
        opt.loss_scaler.update(overflow)
        ours.append(opt.loss_scaler.get_scale())
    assert ours == _keras3_schedule(overflows, 2.0**15, growth)
    assert min(ours) < 1.0 and max(ours) > 2.0**24  # the cases where defaults differ


def test_keras_names_refuse_a_loss_scaler_too() -> None:
    with pytest.raises(TypeError, match="loss_scaler= or Keras' initial_scale="):
        _opt(loss_scaler=mp.StaticLossScaler(8.0), initial_scale=8.0)


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"initial_scale": -1.0}, mp.ArgumentError, r"initial_scale=-1.0 is invalid"),
        ({"initial_scale": "big"}, TypeError, r"initial_scale must be a number, got str"),
        ({"dynamic_growth_steps": 0}, mp.ArgumentError, r"dynamic_growth_steps=0 is invalid"),
        ({"dynamic_growth_steps": 2.5}, TypeError, r"dynamic_growth_steps must be an int"),
    ],
)
def test_keras_names_bad_values_name_the_keras_argument(
    kwargs: dict[str, object], error: type[Exception], match: str
) -> None:
    with pytest.raises(error, match=match):
        _opt(**kwargs)
