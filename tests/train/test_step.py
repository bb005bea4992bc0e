"""build_train_step and TrainStep: MindSpore's build_train_network in a custom loop."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import mixprec as mp
from tests.conftest import classification_data, make_mlp


def test_build_train_step_custom_loop():
    model = make_mlp()
    step = mp.build_train_step(
        model, torch.optim.SGD(model.parameters(), lr=0.1), nn.CrossEntropyLoss(),
        policy="mixed_float16", level="O2",
    )  # fmt: skip
    assert isinstance(step.optimizer.loss_scaler, mp.DynamicLossScaler)
    x, y = classification_data(n=64)
    losses = []
    for _ in range(20):
        loss, result = step(x, y)
        assert isinstance(result, mp.StepResult) and result.applied
        losses.append(loss.item())
    assert losses[-1] < losses[0]
    with pytest.raises(ValueError, match=r"already prepared with policy mixed_float16, level O2"):
        mp.build_train_step(model, torch.optim.SGD(model.parameters(), 0.1), "cross_entropy",
                            policy="mixed_bfloat16")  # fmt: skip
    again = mp.build_train_step(model, step.optimizer, "cross_entropy")  # reuse: fine
    assert again.optimizer is step.optimizer
