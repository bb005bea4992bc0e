"""The doctor's check of its own float16 plan over the next optimizer steps
(``mixprec.doctor.verify``): what the first steps push over is kept, the user's optimizer
is the one stepped, the model and the random numbers are left as they were, and a plan no
keep list saves says so."""

from __future__ import annotations

import pytest
import torch

import mixprec as mp
from mixprec.doctor.verify import build_optimizer
from mixprec.levels import applied
from tests.doctor.cases import CE, batch, follow, gained, healthy, issue_batch, wide_batch


def test_the_check_alone_keeps_what_the_first_steps_push_over(one_thread):
    """Issue 31's draw: the block's output is beyond float16's max, the ReLU after it hands
    the float16 Linear '4' inputs of 6.45e4. Without headroom, the step-0 plan leaves '4' in
    float16, and after one Adam step its inputs pass 65504: 1 of 30 steps apply (the issue's
    figure). The check finds '4' at the second step and keeps it: 30 of 30."""
    x, y = issue_batch(1)
    step0 = mp.diagnose(gained(1e5), x, y, CE, headroom=1, check_steps=0)
    assert step0.check is None and "4" not in step0.recommended_keep_float32
    assert follow(step0, gained(1e5), x, y) == (1, False)

    report = mp.diagnose(gained(1e5), x, y, CE, headroom=1)
    check = report.check
    assert check is not None and check.passed and check.rounds == 2
    assert check.added == ["4"] and report.recommended_keep_float32[-1] == "4"
    assert check.findings == ["'4' inf/NaN in the forward at step 2: kept"]
    assert check.optimizer == "Adam(lr=0.001)" and check.steps == 10 == check.applied
    four = next(m for m in report.modules if m.name == "4")
    assert any("the plan's check" in r for r in four.reasons) and four in report.culprits()
    assert any("found '4' overflowing after the weights moved" in a for a in report.advice)
    assert "(after 2 rounds: '4' inf/NaN in the forward at step 2: kept)" in str(report)
    assert follow(report, gained(1e5), x, y) == (30, True)


def test_the_check_steps_the_users_optimizer(one_thread):
    x, y = batch()
    report = mp.diagnose(healthy(), x, y, CE)
    assert report.check is not None and report.check.optimizer == "Adam(lr=0.001)"
    assert report.check.passed and report.advice == []
    other = torch.nn.Linear(2, 2)
    for optimizer, said in (
        (torch.optim.SGD(other.parameters(), lr=0.05, momentum=0.9), "SGD(lr=0.05)"),
        (lambda params: torch.optim.AdamW(params, lr=3e-4), "AdamW(lr=0.0003)"),
    ):
        report = mp.diagnose(healthy(), x, y, CE, optimizer=optimizer)
        assert report.check is not None and report.check.optimizer == said
    # An optimizer is rebuilt over the copy's parameters with its class and hyperparameters
    # (those its constructor takes: AdamW's defaults hold one it does not).
    params = list(healthy().parameters())
    sgd = build_optimizer(torch.optim.SGD(other.parameters(), lr=0.05, momentum=0.9), params)
    assert type(sgd) is torch.optim.SGD and sgd.param_groups[0]["params"] == params
    assert sgd.param_groups[0]["momentum"] == 0.9 and sgd.param_groups[0]["lr"] == 0.05
    adamw = build_optimizer(torch.optim.AdamW(other.parameters(), weight_decay=0.3), params)
    assert type(adamw) is torch.optim.AdamW and adamw.param_groups[0]["weight_decay"] == 0.3


def test_bad_optimizers_are_refused(one_thread):
    x, y = batch()
    other = torch.nn.Linear(2, 2)
    wrapped = mp.LossScaleOptimizer(torch.optim.SGD(other.parameters(), lr=0.1))
    with pytest.raises(ValueError, match="takes the optimizer a LossScaleOptimizer wraps"):
        mp.diagnose(healthy(), x, y, CE, optimizer=wrapped)
    with pytest.raises(TypeError, match="must return a torch.optim.Optimizer, got NoneType"):
        mp.diagnose(healthy(), x, y, CE, optimizer=lambda params: None)  # type: ignore[arg-type,return-value]


def test_the_check_leaves_the_model_and_the_random_numbers_as_they_were(one_thread):
    x, y = issue_batch(1)
    model = gained(1e5)
    weights = {k: v.clone() for k, v in model.state_dict().items()}
    torch.manual_seed(3)
    before = torch.get_rng_state()
    report = mp.diagnose(model, x, y, CE, headroom=1)
    assert report.check is not None and report.check.rounds == 2  # it trained copies
    assert torch.equal(torch.get_rng_state(), before)
    assert all(torch.equal(v, weights[k]) for k, v in model.state_dict().items())
    assert applied(model) is None


def test_a_plan_that_still_fails_its_check_says_so(one_thread):
    """SGD at lr 0.05 diverges on this model in any precision (tests/doctor/cases.py): the
    check keeps what overflows first, then runs out of 16-bit layers to blame and says
    that the plan still fails, with the remedies."""
    x, y = issue_batch(1)
    sgd = lambda params: torch.optim.SGD(params, lr=0.05)  # noqa: E731
    report = mp.diagnose(gained(1e5), x, y, CE, optimizer=sgd)
    check = report.check
    assert check is not None and not check.passed and check.optimizer == "SGD(lr=0.05)"
    assert check.added and check.applied < check.steps
    assert any(a.startswith("the plan still fails its check") for a in report.advice)
    assert not check.finite and "forward NOT finite after them" in str(report)
    assert check.findings[-1] == "steps skipped at loss scale 1 with no 16-bit layer to blame"


def test_the_check_lowers_the_start_where_its_steps_back_off(one_thread):
    """Issue 15's model at Adam lr 1e-2: on the batch, the scaler settles at 32 (11 skips);
    after the first step the gradients need one more halving. The check's first round
    backs off to 16, the second confirms it: the plan starts there (12 skips from 2**16),
    and training with that optimizer from 16 skips nothing, where 32 skipped step 2."""
    x, y = wide_batch()
    adam = lambda params: torch.optim.Adam(params, lr=1e-2)  # noqa: E731
    report = mp.diagnose(gained(1e5), x, y, CE, optimizer=adam)
    check = report.check
    assert check is not None and check.passed and check.rounds == 2 and check.added == []
    assert check.findings == ["the scaler backed off to 16: started there"]
    assert report.loss_scale_reached == 16.0 == check.scale and report.backoff_steps == 12
    assert any("DynamicLossScaler(init_scale=16)" in a for a in report.advice)
    skipped = {}
    for start in (32.0, 16.0):
        model = mp.auto_mixed_precision(
            gained(1e5), "mixed_float16", "O2", keep_float32=report.recommended_keep_float32
        )
        scaler = mp.DynamicLossScaler(init_scale=start)
        opt = mp.LossScaleOptimizer(adam(model.parameters()), loss_scaler=scaler)
        skipped[start] = []
        for step in range(1, 31):
            opt.zero_grad()
            opt.backward(CE(model(x), y))
            if not opt.step().applied:
                skipped[start].append(step)
    assert skipped == {32.0: [2], 16.0: []}


def test_no_check_without_steps_or_outside_float16(one_thread):
    x, y = batch()
    assert mp.diagnose(healthy(), x, y, CE, check_steps=0).check is None
    assert mp.diagnose(healthy(), x, y, CE, policy="mixed_bfloat16").check is None


def test_the_check_of_a_pure_float16_plan_steps_an_eps_float16_holds(one_thread):
    # At O3 the weights are float16 without masters, so the default Adam computes in
    # float16, where eps=1e-8 rounds to 0: its check trained NaN weights and raised
    # FloatingPointError on a healthy model. It builds Adam with eps=1e-4 there.
    x, y = batch()
    report = mp.diagnose(healthy(), x, y, CE, "mixed_float16", level="O3")
    assert report.check is not None and report.check.applied > 0
    adam = build_optimizer(None, [torch.zeros(2, dtype=torch.float16, requires_grad=True)])
    assert adam.defaults["eps"] == 1e-4
    assert build_optimizer(None, [torch.zeros(2, requires_grad=True)]).defaults["eps"] == 1e-8


def test_the_check_starts_from_a_loss_scale_past_2_to_the_24(one_thread):
    """The check's scaler capped its scale at 2**24 and refused to start above it: a
    loss_scale of 2**25 (the doctor's own advice for tiny losses) was an ArgumentError."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    x, y = torch.randn(32, 8), torch.randn(32, 4)

    def tiny(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.mse_loss(out, target) * 1e-14

    report = mp.diagnose(model, x, y, tiny, "mixed_float16", loss_scale=2.0**25)
    assert report.check is not None and report.check.applied > 0
