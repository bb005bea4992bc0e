"""16-bit weights stepped in place that stopped moving (``mixprec.optim.stall``): said once
when fewer than a tenth of their values moved over ``WINDOW`` applied steps; not for
weights that move, nor for weights behind float32 masters."""

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
    return [w for w in seen if "applied steps: most updates are below" in str(w.message)]


def test_o3_weights_that_no_update_moves_are_said():
    """SGD at lr 1e-4 on bfloat16 weights: no weight moved in 2000 steps (float32 trained),
    every step applied, nothing said."""
    said = _train("O3", lambda p: torch.optim.SGD(p, lr=1e-4))
    assert len(said) == 1 and said[0].filename == __file__
    message = str(said[0].message)
    assert message.startswith("0.0% of the values of the 4 bfloat16 weights")
    assert "mp.CompensatedAdamW" in message


def test_adam_at_a_small_rate_that_moves_few_elements_is_said():
    """Adam at lr 3e-5: 2.7% of the elements moved (tiny ones), the weights went 0.023
    where float32's went 0.153. A watch of norms, which those few kept changing, was
    quiet (this case was once asserted quiet, as a 16-bit norm had missed moved ones)."""
    assert len(_train("O3", lambda p: torch.optim.Adam(p, lr=3e-5))) == 1


def test_a_fine_tuning_where_few_elements_move_is_said():
    """AdamW at lr 1e-5 on bfloat16 weights: 4.3% of the elements moved (a few near-zero
    biases), which kept every weight's norm changing, so the watch of norms said nothing
    while the loss stalled at 2.31 (float32: 2.09)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.LayerNorm(256),
                                torch.nn.GELU(), torch.nn.Linear(256, 10))  # fmt: skip
    model = mp.auto_mixed_precision(model, "bfloat16", "O3")
    opt = mp.LossScaleOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-5))
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(128, 64, generator=g), torch.randint(0, 10, (128,), generator=g)
    with pytest.warns(UserWarning, match=r"^\d+\.\d% of the values of the 6 bfloat16 weights"):
        for _ in range(START + WINDOW):
            opt.zero_grad()
            opt.backward(F.cross_entropy(model(x).float(), y))
            opt.step()


@pytest.mark.parametrize(
    ("level", "make_opt"),
    [
        ("O3", lambda p: mp.CompensatedAdamW(p, lr=1e-4)),  # compensated: they move
        ("O3", lambda p: torch.optim.SGD(p, lr=0.1)),  # large enough to move
        ("O2", lambda p: torch.optim.SGD(p, lr=1e-4)),  # float32 masters: not watched
    ],
)
def test_weights_that_move_or_have_masters_are_not_said(level, make_opt):
    assert not _train(level, make_opt)


def test_embedding_rows_no_batch_touches_are_not_taken_for_a_stall():
    """An O3 table of 20000 rows, a few touched a batch: the untouched rows (which do not
    move in float32 either) made 7% of the sampled values move, said as a stall while
    every touched row moved. Values whose gradient was 0 at the first look are left out."""
    torch.manual_seed(0)
    emb, head = torch.nn.Embedding(20000, 8), torch.nn.Linear(8, 4)
    model = mp.auto_mixed_precision(torch.nn.Sequential(emb, head), "bfloat16", "O3")
    opt = mp.LossScaleOptimizer(mp.CompensatedAdamW(model.parameters(), lr=1e-2))
    g = torch.Generator().manual_seed(1)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for _ in range(START + WINDOW):
            ids = torch.randint(0, 20000, (64,), generator=g)
            opt.zero_grad()
            opt.backward(F.cross_entropy(model(ids).float(), ids % 4))
            opt.step()
