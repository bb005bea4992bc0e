"""Warnings from the Trainer point at the user's line, however deep in mixprec they rise."""

from __future__ import annotations

import warnings

import torch
from torch import nn

import mixprec as mp
from mixprec.train.warn import warn
from tests.conftest import make_mlp


def _located(record: list[warnings.WarningMessage], text: str) -> list[str]:
    return [w.filename for w in record if text in str(w.message)]


def test_warn_called_from_here_points_here():
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        warn("from the test")
    assert _located(record, "from the test") == [__file__]


def test_fit_train_and_the_constructor_warn_at_the_callers_line():
    torch.manual_seed(0)
    x, y = torch.randn(16, 8), torch.randint(0, 3, (16,))
    batches = [(x[:8], y[:8]), (x[:0], y[:0]), (x[8:], y[8:])]
    model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 3))
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        trainer = mp.Trainer(model, "cross_entropy", torch.optim.SGD(model[1].parameters(), 0.1))
        trainer.fit(batches, epochs=1, verbose=0)  # Keras style
        trainer.train(1, batches)  # MindSpore style: fit one frame deeper
    assert _located(record, "these will not train") == [__file__]
    assert _located(record, "is empty: skipped") == [__file__, __file__]


def test_a_loss_scale_warning_points_at_fit():
    class Overflowing(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.net = make_mlp()

        def forward(self, x):
            return self.net(x) * float("inf")

    model = Overflowing()
    trainer = mp.Trainer(model, "cross_entropy", torch.optim.SGD(model.parameters(), lr=0.1),
                         "mixed_float16", device="cpu")  # fmt: skip
    x, y = torch.randn(48, 32), torch.randint(0, 10, (48,))
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        trainer.fit(x, y, batch_size=4, epochs=1, verbose=0)
    health = [w for w in record if "skipped" in str(w.message)]
    assert health and {w.filename for w in health} == {__file__}, [str(w.message) for w in record]
