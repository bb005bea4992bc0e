"""A learning-rate schedule that moved over a skipped step (``mixprec.optim.lr_watch``):
said once, at the caller's step; a schedule stepped on applied steps alone is not."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F

import mixprec as mp


def _run(conditional: bool) -> tuple[list[float], list[warnings.WarningMessage]]:
    """A warmup over float16 steps whose first 3 overflow; the learning rates applied."""
    torch.manual_seed(0)
    model = mp.auto_mixed_precision(torch.nn.Linear(4, 4), "mixed_float16", "O2")
    opt = mp.LossScaleOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 10))
    applied_at = []
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        for i in range(6):
            gain = 1e6 if i < 3 else 1.0  # past float16 at the first steps' scale
            opt.zero_grad()
            opt.backward(F.mse_loss(model(torch.randn(2, 4)) * gain, torch.zeros(2, 4)))
            lr = opt.param_groups[0]["lr"]
            result = opt.step()
            if result:
                applied_at.append(lr)
            if result or not conditional:
                sched.step()
    return applied_at, [w for w in seen if "learning rate changed" in str(w.message)]


def test_a_scheduler_stepped_over_skipped_steps_is_said_once_at_the_callers_line():
    """The first applied update ran at the warmup's 4th value (float32: its 1st), unsaid:
    torch's GradScaler leaves torch's own warning, the wrapper left none."""
    applied_at, said = _run(conditional=False)
    assert applied_at[0] == pytest.approx(0.04)
    assert len(said) == 1 and said[0].filename == __file__
    assert "0.01 -> 0.02" in str(said[0].message)
    assert "if opt.step(): scheduler.step()" in str(said[0].message)


def test_a_scheduler_stepped_on_applied_steps_alone_is_not_said():
    applied_at, said = _run(conditional=True)
    assert applied_at[0] == pytest.approx(0.01) and not said


def test_a_group_added_after_a_skip_is_no_change_to_say():
    """An unfreezing (add_param_group) right after a skipped step: the next step raised
    StopIteration from the comparison of the two lists of rates."""
    model = mp.auto_mixed_precision(torch.nn.Linear(4, 4), "mixed_float16", "O2")
    head = torch.nn.Linear(4, 1)
    opt = mp.LossScaleOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    opt.backward(F.mse_loss(model(torch.randn(2, 4)) * 1e6, torch.zeros(2, 4)))
    assert not opt.step().applied
    opt.add_param_group({"params": list(head.parameters()), "lr": 0.1})
    opt.zero_grad()
    opt.backward(head(model(torch.randn(2, 4))).sum())
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert opt.step().applied


@pytest.mark.parametrize("kind", ["StepLR", "ReduceLROnPlateau"])
def test_a_scheduler_stepped_per_epoch_over_an_epochs_skipped_last_step_is_not_said(kind):
    """torch's per-epoch idiom, the epoch's last step skipped (an outlier batch): the rate
    moves at the epoch's end, as it should, and was said with advice that would have
    dropped the epoch's decay."""
    torch.manual_seed(0)
    model = mp.auto_mixed_precision(torch.nn.Linear(4, 4), "mixed_float16", "O2")
    opt = mp.LossScaleOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    if kind == "StepLR":
        sched: object = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    else:
        sched = torch.optim.lr_scheduler.ReduceLROnPlateau(opt, patience=0, factor=0.5)
    skipped = 0
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        for _epoch in range(3):
            for i in range(4):
                gain = 1e6 if i == 3 else 1.0  # the epoch's last batch overflows float16
                opt.zero_grad()
                opt.backward(F.mse_loss(model(torch.randn(2, 4)) * gain, torch.zeros(2, 4)))
                skipped += not opt.step()
            sched.step(1.0) if kind != "StepLR" else sched.step()  # type: ignore[attr-defined]
    assert skipped == 3 and opt.param_groups[0]["lr"] < 0.1  # skips, and the rate moved
    assert not [w for w in seen if "learning rate changed" in str(w.message)]


def test_a_scheduler_stepped_over_skipped_accumulation_groups_is_said():
    """accumulation_steps=2, step() after each backward: the accumulating step() between two
    skipped groups reset the run of skips, and the warning could not come."""
    torch.manual_seed(0)
    model = mp.auto_mixed_precision(torch.nn.Linear(4, 4), "mixed_float16", "O2")
    opt = mp.LossScaleOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), accumulation_steps=2)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 20))
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        for i in range(24):
            gain = 1e6 if i < 8 else 1.0  # the first 4 groups overflow
            opt.zero_grad()
            opt.backward(F.mse_loss(model(torch.randn(2, 4)) * gain, torch.zeros(2, 4)))
            if not opt.step().accumulating:
                sched.step()  # once a group, over skipped ones too
    said = [w for w in seen if "learning rate changed" in str(w.message)]
    assert len(said) == 1 and "0.005 -> 0.01 -> 0.015" in str(said[0].message)
