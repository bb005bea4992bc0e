"""Warnings point at the user's line, however deep in mixprec they rise: the Trainer's own
(``train.warn``) and those of the modules it calls (``levels``), through ``mixprec._warn``."""

from __future__ import annotations

import sys
import warnings

import torch
from torch import nn

import mixprec as mp
from mixprec._warn import caller_stacklevel, warn_at_caller
from mixprec.train.warn import warn
from tests.conftest import make_mlp


def _located(record: list[warnings.WarningMessage], text: str) -> list[str]:
    return [w.filename for w in record if text in str(w.message)]


def _next_line() -> int:
    """The line after the caller's."""
    return sys._getframe(1).f_lineno + 1


def test_train_warn_is_the_shared_warn_at_caller():
    assert warn is warn_at_caller


def test_caller_stacklevel_names_the_caller_itself_outside_mixprec():
    assert caller_stacklevel() == 1  # this frame is already outside mixprec
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        line = _next_line()
        warnings.warn("located", UserWarning, stacklevel=caller_stacklevel())
    assert [(w.filename, w.lineno) for w in record] == [(__file__, line)]


def test_a_levels_warning_points_at_the_users_line_directly_and_through_the_trainer():
    """The upcast note of a bfloat16 model, raised in ``levels`` two to four mixprec frames
    below the user's call (``auto_mixed_precision``, ``build_train_step``, ``Trainer``)."""
    lines = []
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        lines.append(_next_line())
        mp.auto_mixed_precision(make_mlp().to(torch.bfloat16), "mixed_bfloat16", "O2")
        lines.append(_next_line())
        mp.build_train_step(make_mlp().to(torch.bfloat16), "sgd", "mse", "mixed_bfloat16", "O2")
        lines.append(_next_line())
        mp.Trainer(make_mlp().to(torch.bfloat16), "mse", "sgd", "mixed_bfloat16", "O2")
    notes = [w for w in record if "were bfloat16; upcast to float32" in str(w.message)]
    assert [(w.filename, w.lineno) for w in notes] == [(__file__, n) for n in lines]


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


def test_the_float32_policy_level_warning_points_at_the_users_line_through_the_trainer():
    # "level=O2 with the float32 policy changes nothing" pointed into train/step.py when
    # build_train_step or Trainer raised it (a fixed stacklevel).
    lines = []
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        lines.append(_next_line())
        mp.auto_mixed_precision(make_mlp(), "float32", "O2")
        lines.append(_next_line())
        mp.build_train_step(make_mlp(), "sgd", "mse", "float32", "O2")
        lines.append(_next_line())
        mp.Trainer(make_mlp(), "mse", "sgd", "float32", "O2")
    said = [w for w in record if "with the float32 policy" in str(w.message)]
    assert [(w.filename, w.lineno) for w in said] == [(__file__, n) for n in lines]
