"""Optimizers by the names Keras users write, with Keras' default hyper-parameters."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import mixprec as mp
from mixprec.train.optimizers import OPTIMIZERS, get_optimizer


@pytest.mark.parametrize(
    ("name", "kind", "settings"),
    [
        ("adam", torch.optim.Adam, {"lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-7}),
        ("adamw", torch.optim.AdamW, {"lr": 1e-3, "eps": 1e-7, "weight_decay": 0.004}),
        ("sgd", torch.optim.SGD, {"lr": 0.01, "momentum": 0, "nesterov": False}),
        ("rmsprop", torch.optim.RMSprop, {"lr": 1e-3, "alpha": 0.9, "eps": 1e-7, "momentum": 0}),
        (
            "adagrad",
            torch.optim.Adagrad,
            {"lr": 1e-3, "initial_accumulator_value": 0.1, "eps": 1e-7},
        ),
    ],
)
def test_keras_defaults(name, kind, settings):
    params = list(nn.Linear(2, 2).parameters())
    for spelling in (name, name.upper(), f" {name.capitalize()} "):
        opt = get_optimizer(spelling, params)
        assert type(opt) is kind
        assert {k: opt.defaults[k] for k in settings} == settings
        assert opt.param_groups[0]["params"] == params


def test_an_unknown_name_lists_the_valid_ones():
    with pytest.raises(mp.ArgumentError) as err:
        get_optimizer("nadam", [])
    assert str(err.value).startswith(
        "optimizer='nadam' is not a known optimizer; valid: adam, adamw, sgd, rmsprop, "
        "adagrad (with Keras' defaults) or a torch.optim.Optimizer"
    )
    assert list(OPTIMIZERS) == ["adam", "adamw", "sgd", "rmsprop", "adagrad"]
