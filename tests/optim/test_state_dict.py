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
