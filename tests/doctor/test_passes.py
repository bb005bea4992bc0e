"""The doctor's passes: the float16 recommendation is checked by backing the loss scale off
as ``DynamicLossScaler`` would on the batch, and the scale it reaches is the one training
reaches (issue 15 item 4); the error of the mixed pass against the float32 pass."""

from __future__ import annotations

import math

import pytest
import torch

import mixprec as mp
from mixprec.doctor.passes import error
from tests.doctor.cases import CE, gained, train_applied, wide_batch


def test_recommendation_accounts_for_the_backward_at_the_scale_training_reaches(one_thread):
    # Issue 15 item 4, gain 1e5: keeping the block and what follows it leaves the Linear and
    # ReLU before it in float16 with gradients up to ~1.5e3 (the weight gradient of '0'):
    # they fit float16 at loss scales <= 65504 / 1548, so the scaler settles at 32 after
    # 11 halvings from 2**16. The doctor runs that back-off on the batch and says so.
    x, y = wide_batch()
    report = mp.diagnose(gained(1e5), x, y, CE, policy="mixed_float16")
    assert report.recommended_keep_float32 == ["2.0", "2.1", "3", "4"]
    assert report.loss_scale_reached == 32.0 and report.backoff_steps == 11
    assert any(
        "skips the first 11 steps" in a and "DynamicLossScaler(init_scale=32)" in a
        for a in report.advice
    ), report.advice

    def prepared():
        return mp.auto_mixed_precision(gained(1e5), "mixed_float16", "O2",
                                       keep_float32=report.recommended_keep_float32)  # fmt: skip

    # The default scaler does exactly what was predicted: 11 skips, then steps apply (all
    # 19 after them in a 30-step run; 4 checked here, for time).
    flags, _ = train_applied(prepared(), x, y, steps=15)
    assert flags == [False] * 11 + [True] * 4
    # Started where the doctor says, all 30 apply and the loss goes where float32's goes.
    flags, losses = train_applied(
        prepared(), x, y, mp.DynamicLossScaler(init_scale=report.loss_scale_reached)
    )
    reference = gained(1e5)
    ref_opt = torch.optim.Adam(reference.parameters(), lr=1e-3)
    for _ in range(30):
        ref_opt.zero_grad()
        ref_loss = CE(reference(x), y)
        ref_loss.backward()
        ref_opt.step()
    assert all(flags)
    assert losses[0] > 1000 and losses[-1] < 0.01 and ref_loss.item() < 0.01


def test_error_is_zero_where_there_is_nothing_to_compare():
    x = torch.ones(3)
    assert error(None, x) == 0.0 and error(x, None) == 0.0  # a tensor one run lacks
    assert error(torch.ones(2), x) == 0.0  # another shape
    assert error(x * 1.5, x) == pytest.approx(0.5)
    # Otherwise it is the shared relative error: inf against an all-zero float32 reference.
    assert error(x, torch.zeros(3)) == math.inf
