"""16-bit weights stepped in place that stopped moving (``mixprec.optim.stall``): said once
when none moved over ``WINDOW`` applied steps; not for weights that move, however few."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F

import mixprec as mp
from mixprec.optim.stall import START, WINDOW


def _train(level: str, make_opt) -> list[warnings.WarningMessage]:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 16, generator=g)
    y = x[:, :4].argmax(-1)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
    model = mp.auto_mixed_precision(model, "mixed_bfloat16", level)
    opt = mp.LossScaleOptimizer(make_opt(model.parameters()))
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        for _ in range(START + WINDOW):
            opt.zero_grad()
            opt.backward(F.cross_entropy(model(x), y))
            assert opt.step().applied
    return [w for w in seen if "applied steps: each update is below" in str(w.message)]


def test_o3_weights_that_no_update_moves_are_said():
    """SGD at lr 1e-4 on bfloat16 weights: no weight moved in 2000 steps (float32 trained),
    every step applied, nothing said."""
    said = _train("O3", lambda p: torch.optim.SGD(p, lr=1e-4))
    assert len(said) == 1 and said[0].filename == __file__
    message = str(said[0].message)
    assert "none of the 4 bfloat16 weights" in message and "mp.CompensatedAdamW" in message


@pytest.mark.parametrize(
    ("level", "make_opt"),
    [
        ("O3", lambda p: mp.CompensatedAdamW(p, lr=1e-4)),  # compensated: they move
        # Adam at a small rate moves a few thousand elements, which a 16-bit norm missed.
        ("O3", lambda p: torch.optim.Adam(p, lr=3e-5)),
        ("O3", lambda p: torch.optim.SGD(p, lr=0.1)),  # large enough to move
        ("O2", lambda p: torch.optim.SGD(p, lr=1e-4)),  # float32 masters: not watched
    ],
)
def test_weights_that_move_or_have_masters_are_not_said(level, make_opt):
    assert not _train(level, make_opt)
