"""LossScaleOptimizer's state: a round trip, and states that do not fit refused whole."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import mixprec as mp
from tests.optim._helpers import loss_of, prepared


def test_state_dict_round_trip():
    model, opt = prepared("mixed_float16")
    for _ in range(3):
        opt.zero_grad()
        opt.backward(loss_of(model))
        opt.step()
    state = copy.deepcopy(opt.state_dict())
    model2, opt2 = prepared("mixed_float16")
    # As with any optimizer: the model's own state (float32 norms here) comes from the model.
    model2.load_state_dict(model.state_dict())
    opt2.load_state_dict(state)
    for a, b in zip(model.parameters(), model2.parameters(), strict=True):
        assert torch.equal(a, b)
    assert opt2.loss_scaler.state == opt.loss_scaler.state
    for step_opt, step_model in ((opt, model), (opt2, model2)):
        step_opt.zero_grad()
        step_opt.backward(loss_of(step_model))
        step_opt.step()
    for a, b in zip(model.parameters(), model2.parameters(), strict=True):
        assert torch.equal(a, b)
    doubled = {**state, "optimizers": state["optimizers"] * 2}
    with pytest.raises(ValueError, match="state has 2 inner optimizers, this LossScale.* 1"):
        opt2.load_state_dict(doubled)
    with pytest.raises(ValueError, match="state has 3 master weights, this LossScale.* 6"):
        opt2.load_state_dict({**state, "master_weights": state["master_weights"][:3]})
    with pytest.raises(ValueError, match="missing master_weights"):
        opt2.load_state_dict({"optimizers": [], "loss_scaler": {}})


@pytest.mark.parametrize(
    ("change", "match"),
    [
        (lambda good: 5, r"a LossScaleOptimizer state is a dict \(from state_dict\(\)\), got int"),
        (lambda good: {**good, "optimizers": 5}, r"'optimizers' must be a list of dict, got int"),
        (
            lambda good: {**good, "master_weights": [1, 2]},
            r"'master_weights' must be a list of Tensor, got list of \['int'\]",
        ),
    ],
)
def test_load_state_dict_of_the_wrong_types_is_a_type_error(change, match) -> None:
    model = mp.auto_mixed_precision(nn.Sequential(nn.Linear(2, 2)), "mixed_bfloat16", "O2")
    opt = mp.LossScaleOptimizer(torch.optim.SGD(model.parameters(), 0.1))
    good = opt.state_dict()
    before = [m.clone() for _, m in opt.master_weights()]
    with pytest.raises(TypeError, match=match):
        opt.load_state_dict(change(good))
    assert all(torch.equal(a, m) for a, (_, m) in zip(before, opt.master_weights(), strict=True))


def _stepped_adam(policy: str):
    torch.manual_seed(0)
    model = mp.auto_mixed_precision(nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 3)), policy)
    opt = mp.LossScaleOptimizer(torch.optim.Adam(model.parameters()))
    opt.backward(model(torch.randn(6, 4)).float().square().mean())
    opt.step()
    return model, opt


@pytest.mark.parametrize("policy", ["mixed_float16", "float32"])
def test_a_moment_of_another_shape_is_refused_at_load_and_at_the_step(policy) -> None:
    """An Adam ``exp_avg`` of another shape (another model's state) was loaded, and the
    fused kernel wrote past its memory: the step said applied and the process died later
    ("corrupted double-linked list"). Refused at the load, naming it; and at the step when
    it reaches the inner optimizer another way, before any kernel runs."""
    model, opt = _stepped_adam(policy)
    bad = copy.deepcopy(opt.state_dict())
    bad["optimizers"][0]["state"][0]["exp_avg"] = torch.zeros(3)
    kept = opt.optimizers[0].state_dict()["state"][0]["exp_avg"].clone()
    with pytest.raises(
        ValueError,
        match=r"inner optimizer 0: the state of parameter 0 of Adam has 'exp_avg' of shape "
        r"\(3,\), its parameter \(8, 4\)",
    ):
        opt.load_state_dict(bad)
    assert torch.equal(opt.optimizers[0].state_dict()["state"][0]["exp_avg"], kept)
    opt.optimizers[0].load_state_dict(bad["optimizers"][0])  # torch's load takes it
    weights = [p.detach().clone() for p in model.parameters()]
    opt.zero_grad()
    opt.backward(model(torch.randn(6, 4)).float().square().mean())
    with pytest.raises(ValueError, match=r"step: the state of parameter 0 of Adam has 'exp_avg'"):
        opt.step()
    assert all(torch.equal(a, p) for a, p in zip(weights, model.parameters(), strict=True))


def test_a_bad_second_state_or_a_non_finite_master_loads_nothing() -> None:
    """A second inner optimizer's 'state' that is no dict raised torch's AttributeError
    with the first inner optimizer loaded already; NaN masters were loaded and made the
    weights NaN (load_checkpoint refuses both)."""
    model = mp.auto_mixed_precision(nn.Sequential(nn.Linear(2, 3), nn.Linear(3, 2)),
                                    "mixed_bfloat16", "O2")  # fmt: skip
    first, second = model[0].parameters(), model[1].parameters()
    opt = mp.LossScaleOptimizer([torch.optim.Adam(first), torch.optim.Adam(second)])
    opt.backward(model(torch.randn(4, 2)).float().sum())
    opt.step()
    good = copy.deepcopy(opt.state_dict())
    for _ in range(2):
        opt.zero_grad()
        opt.backward(model(torch.randn(4, 2)).float().sum())
        opt.step()
    steps = float(opt.optimizers[0].state_dict()["state"][0]["step"])
    bad = copy.deepcopy(good)
    bad["optimizers"][1]["state"] = 5
    with pytest.raises(ValueError, match=r"inner optimizer 1's 'state' must be a dict .* got int"):
        opt.load_state_dict(bad)
    assert float(opt.optimizers[0].state_dict()["state"][0]["step"]) == steps == 3.0
    nan = copy.deepcopy(good)
    nan["master_weights"][1][0] = float("nan")
    with pytest.raises(ValueError, match="master weight 1 holds inf/NaN values"):
        opt.load_state_dict(nan)
    assert all(torch.isfinite(p).all() for p in model.parameters())
