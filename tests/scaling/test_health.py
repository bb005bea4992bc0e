"""``ScalerHealth`` (``mixprec.scaling.health``): the warnings it gives once per kind, the run
stuck at the scaler's floor, its settings; and the Trainer that watches a run with it, tracing
a step to name the module an overflow starts in."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch

import mixprec as mp
from mixprec.scaling import ScalerState
from mixprec.scaling.health import ScalerHealth, scale_floor
from mixprec.trace import Overflow
from tests.doctor.cases import batch, gained, healthy, overflowing, single_thread, wide_batch


@pytest.fixture
def one_thread():
    """Emulated 16-bit backward on this machine's 2 shared cores: two threads contend."""
    with single_thread():
        yield


def test_scaler_health_warns_once_per_kind():
    health = ScalerHealth(max_consecutive_skips=3, window=10, max_skip_rate=0.3)
    state = ScalerState(scale=2.0**10)
    assert health.observe(state, False) is None
    low = ScalerState(scale=0.25, consecutive_skips=1)
    message = health.observe(low, True, culprit="2 (Scale) forward")
    assert "fell to 0.25 < 1" in message and "mixed_bfloat16" in message and "2 (Scale)" in message
    assert health.observe(low, True) is None  # once
    streak = ScalerState(scale=4.0, consecutive_skips=3)
    assert "3 steps in a row were skipped" in health.observe(streak, True)
    health = ScalerHealth(max_consecutive_skips=100, window=10, max_skip_rate=0.3)
    for i in range(9):
        assert health.observe(state, i % 2 == 0) is None
    assert "of the last 10 steps were skipped" in health.observe(state, True)


def test_a_skip_rate_at_the_scale_floor_is_not_blamed_on_the_scalers_probing():
    """Every 4th batch overflowing at the floor (scale 1) was told "lower growth_factor or
    raise growth_interval", which changed nothing (22 of 200 skipped with either): at the
    floor no skip is a probe. It now points at the layers and bfloat16."""
    health = ScalerHealth(max_consecutive_skips=100, window=8, max_skip_rate=0.2)
    floor = ScalerState(scale=1.0)
    said = [health.observe(floor, i % 4 == 3, floor=1.0) for i in range(16)]
    message = next(m for m in said if m)
    assert "with the loss scale at its floor (1)" in message
    assert "These are not probes of the range" in message and "growth_factor" not in message
    assert "mp.diagnose(model, x, y, loss_fn)" in message and "mixed_bfloat16" in message


def test_trainer_traces_and_warns(recwarn):
    x, y = batch()
    model = overflowing()
    trainer = mp.Trainer(model, "cross_entropy", torch.optim.SGD(model.parameters(), lr=0.05),
                         policy="mixed_float16", device="cpu", trace_overflow=True)  # fmt: skip
    events = []

    class Spy(mp.Callback):
        def on_train_batch_end(self, step, logs):
            events.append(logs["overflow"])

    with pytest.warns(UserWarning, match=r"steps in a row were skipped.*came from 2 \(Scale\)"):
        trainer.fit(x.repeat(4, 1), y.repeat(4), batch_size=16, epochs=1, verbose=0,
                    callbacks=[Spy()])  # fmt: skip
    assert events[0].startswith("2 (Scale) forward")


def test_tracing_off_installs_nothing():
    model = mp.auto_mixed_precision(healthy(), "mixed_float16", "O2")
    hooks_before = sum(len(m._forward_hooks) for m in model.modules())
    mp.LossScaleOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    assert sum(len(m._forward_hooks) for m in model.modules()) == hooks_before
    mp.LossScaleOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), trace_overflow=model)
    assert sum(len(m._forward_hooks) for m in model.modules()) > hooks_before
    plain = healthy()
    with pytest.raises(ValueError, match="pass the model"):
        mp.LossScaleOptimizer(torch.optim.SGD(plain.parameters(), lr=0.1), trace_overflow=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        copy.deepcopy(model)


def test_scaler_health_stuck_at_the_floor_warns_once_with_module_and_remedy():
    floor = scale_floor(mp.DynamicLossScaler())
    assert floor == 1.0 and scale_floor(mp.DynamicLossScaler(min_scale=None)) == 2.0**-126
    assert scale_floor(mp.StaticLossScaler(8.0)) is None  # a fixed scale has no back-off
    culprit = Overflow("1", "ReLU", "backward", "float16", 785, -6.5e4, 6.5e4)
    health = ScalerHealth(floor_skips=3)
    at_floor = ScalerState(scale=1.0, consecutive_skips=5)
    assert health.observe(ScalerState(scale=2.0), True, culprit, floor) is None  # backing off
    assert health.observe(at_floor, True, culprit, floor) is None
    assert health.observe(at_floor, False, None, floor) is None  # an applied step resets
    assert health.observe(at_floor, True, culprit, floor, loss=7.0e3) is None
    assert health.observe(at_floor, True, culprit, floor) is None
    message = health.observe(at_floor, True, culprit, floor, loss=5.7e12)
    assert message.startswith("training is stuck: the loss scale is at its floor (1)")
    assert "came from 1 (ReLU) backward" in message and "keep '1' in float32" in message
    assert "mixed_bfloat16" in message and "keep_float32=" in message
    assert "lower the learning rate (loss 7000 at the first step, now 5.7e+12)" in message
    streak = ScalerState(scale=1.0, consecutive_skips=500)
    assert all(health.observe(streak, True, culprit, floor) is None for _ in range(120))

    # No module known: the first stuck step asks for a trace; the next one warns anyway.
    health = ScalerHealth(floor_skips=2)
    assert health.observe(at_floor, True, None, floor) is None and not health.needs_trace
    assert health.observe(at_floor, True, None, floor) is None and health.needs_trace
    message = health.observe(at_floor, True, None, floor)
    assert "stuck" in message and "trace_overflow=True" in message and not health.needs_trace


def test_trainer_stuck_at_the_floor_traces_one_step_and_warns_once(one_thread, recwarn):
    # The gain-1e8 model with only the forward's keep list overflows at loss scale 1: from
    # init_scale 4, skips at 4, 2, then at the floor; tracing is off, so the Trainer traces
    # one step itself to name the module.
    x, y = wide_batch()
    model = mp.auto_mixed_precision(gained(1e8), "mixed_float16", "O2",
                                    keep_float32=["2.0", "2.1", "3", "4"])  # fmt: skip
    hooks = sum(len(m._forward_hooks) for m in model.modules())
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    scaler = mp.DynamicLossScaler(init_scale=4.0)
    trainer = mp.Trainer(model, "cross_entropy", opt, loss_scaler=scaler, device="cpu")
    history = trainer.fit(x.repeat(3, 1), y.repeat(3), batch_size=16, epochs=1, verbose=0)
    assert history.history["skipped_steps"] == [12]  # 12 steps, none applied
    health = [str(w.message) for w in recwarn.list if issubclass(w.category, UserWarning)]
    stuck = [m for m in health if "training is stuck" in m]
    assert len(stuck) == 1, health
    assert "came from 1 (ReLU) backward" in stuck[0] and "keep '1' in float32" in stuck[0]
    assert "at the first step, now" in stuck[0]  # the loss, for telling divergence apart
    assert not any("steps in a row" in m for m in health)  # said once, by the stuck warning
    assert sum(len(m._forward_hooks) for m in model.modules()) == hooks  # tracer removed


def test_the_stuck_tracer_is_removed_when_a_step_raises(one_thread):
    # Review: the tracer installed for the next step leaked its hooks when that step raised
    # (here the scaler's own stop after too many skips in a row).
    x, y = wide_batch()
    model = mp.auto_mixed_precision(gained(1e8), "mixed_float16", "O2",
                                    keep_float32=["2.0", "2.1", "3", "4"])  # fmt: skip
    hooks = sum(len(m._forward_hooks) for m in model.modules())
    scaler = mp.DynamicLossScaler(init_scale=4.0, max_consecutive_skips=5)
    trainer = mp.Trainer(model, "cross_entropy", torch.optim.Adam(model.parameters(), 1e-3),
                         loss_scaler=scaler, device="cpu")  # fmt: skip
    limit = r"^6 overflowing steps in a row \(more than max_consecutive_skips=5\)"
    with pytest.raises(RuntimeError, match=limit), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(x.repeat(3, 1), y.repeat(3), batch_size=16, epochs=1, verbose=0)
    assert sum(len(m._forward_hooks) for m in model.modules()) == hooks


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"floor_skips": 0}, r"ScalerHealth\(floor_skips=0\) is invalid; use an int >= 1"),
        ({"window": -1}, r"ScalerHealth\(window=-1\) is invalid"),
        ({"max_consecutive_skips": 2.5}, r"max_consecutive_skips=2.5\) is invalid"),
        ({"max_skip_rate": 1.5}, r"max_skip_rate=1.5\) is invalid; use a fraction in \[0, 1\]"),
    ],
)
def test_scaler_health_refuses_bad_settings(kwargs, match):
    with pytest.raises(ValueError, match=match):
        ScalerHealth(**kwargs)


def _feed(health: ScalerHealth, scaler, flags: str, culprit=None) -> list[str]:
    """Step ``scaler`` by ``flags`` ("0" a skipped step, "1" an applied one) and observe each
    as the optimizer does; the warnings said."""
    said = []
    for flag in flags:
        skipped = flag == "0"
        scaler.update(skipped)
        said.append(health.observe(scaler.state, skipped, culprit, scale_floor(scaler)))
    return [m for m in said if m]


_TF1 = dict(init_loss_scale=2**32, incr_every_n_steps=1000, decr_every_n_nan_or_inf=2,
            decr_ratio=0.5)  # fmt: skip


def _streak(skips: int, scale: str) -> str:
    return (
        f"{skips} steps in a row were skipped for inf/NaN gradients (scale now {scale}). If "
        "the scale is already low, values overflow even unscaled (in the forward pass, or in a "
        "backward through a large gain): run mp.diagnose(model, x, y, loss_fn) to find the "
        "layers, then keep them in float32 or use bfloat16."
    )


def test_a_scale_settling_from_a_high_start_is_no_streak_and_no_skip_rate():
    # Review: TF1's manager from 2**32 (halved every 2nd overflow, as docs/migration.md maps
    # it) skipped its first 31 steps settling, then trained: warned of a 10-step streak at
    # 2**27, and at step 100 that 31 of the last 100 steps were skipped. MindSpore's
    # manager from 2**24: its first 12 skips warned too.
    assert _feed(ScalerHealth(), mp.ExponentialUpdateLossScaleManager(**_TF1), "0" * 31
                 + "1" * 70 + ("1" * 19 + "0") * 5) == []  # fmt: skip
    assert _feed(ScalerHealth(), mp.DynamicLossScaleManager(), "0" * 12 + "10" + "1" * 100) == []


def test_a_real_streak_or_skip_rate_still_warns():
    # Skips going on after a step was applied: the scale settled and overflows again.
    said = _feed(ScalerHealth(), mp.DynamicLossScaler(), "1" + "0" * 10)
    assert said == [_streak(10, "64")]
    # Settling, applied steps, then skips: only those after count.
    health, scaler = ScalerHealth(), mp.ExponentialUpdateLossScaleManager(**_TF1)
    assert _feed(health, scaler, "0" * 31 + "1" * 8 + "0" * 9) == []
    assert _feed(health, scaler, "0") == [_streak(10, "4096")]
    # A forward overflow traced: no scale causes it, so it is never settling.
    forward = Overflow("2", "Scale", "forward", "float16", 32, -1.0, 1.0)
    said = _feed(ScalerHealth(), mp.DynamicLossScaler(), "0" * 10, forward)
    came = f"64). The first non-finite values came from {forward}."
    assert said == [_streak(10, "64").replace("64).", came)]
    # A scaler resumed after applied steps (its counters say so): skips count at once.
    scaler = mp.DynamicLossScaler()
    _feed(ScalerHealth(), scaler, "1")
    assert _feed(ScalerHealth(), scaler, "0" * 10) == [_streak(10, "64")]
    # From the usual start (2**16) nothing settles: 10 in a row are said, then the floor
    # reached with every step skipped: stuck, said once.
    said = _feed(ScalerHealth(), mp.DynamicLossScaler(), "0" * 24)
    assert len(said) == 2 and said[0] == _streak(10, "64")
    # With hysteresis, the first skip at 2**16 spends it and lowers nothing: it counts too.
    assert _feed(ScalerHealth(), mp.DynamicLossScaler(hysteresis=2), "0" * 10) == [
        _streak(10, "2048")
    ]
    assert said[1].startswith("training is stuck: the loss scale is at its floor (1) and the "
                              "last 4 steps")  # fmt: skip
    # After settling, the skip rate counts the steps since: 25 of 100 skipped warn.
    # (Every 4th step skipped halves the scale to its floor, 1, where no skip is a probe.)
    said = _feed(ScalerHealth(), mp.DynamicLossScaleManager(), "0" * 8 + ("1" * 3 + "0") * 25)
    assert said == [
        "25 of the last 100 steps were skipped, with the loss scale at its floor (1). These "
        "are not probes of the range: some batches overflow float16 at any scale. Find the "
        "layers with mp.diagnose(model, x, y, loss_fn) on such a batch and keep them in "
        "float32, or use policy='mixed_bfloat16'."
    ]
    # Above the floor the skips may be the scaler's probes: the growth settings are named.
    health = ScalerHealth(max_consecutive_skips=100, window=8, max_skip_rate=0.2)
    probing = ScalerState(scale=2.0**12)
    said = [health.observe(probing, i % 4 == 3, floor=1.0) for i in range(16)]
    assert [m for m in said if m] == [
        "2 of the last 8 steps were skipped. Occasional skips are how dynamic loss scaling "
        "probes the range; this many waste training: lower growth_factor or raise "
        "growth_interval, or find the layer with mp.diagnose."
    ]


def test_a_loss_scale_optimizer_settling_from_tf1s_start_says_nothing(recwarn):
    # The review's reproducer: an O1 float16 MLP under TF1's manager from 2**32.
    torch.manual_seed(0)
    model = mp.auto_mixed_precision(
        torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4)),
        "mixed_float16", "O1",
    )  # fmt: skip
    opt = mp.LossScaleOptimizer(torch.optim.Adam(model.parameters(), 1e-3),
                                mp.ExponentialUpdateLossScaleManager(**_TF1))  # fmt: skip
    applied = []
    for _ in range(40):
        x, y = torch.randn(64, 16) * 4, torch.randint(0, 4, (64,))
        opt.zero_grad()
        opt.backward(torch.nn.functional.cross_entropy(model(x), y))
        applied.append(opt.step().applied)
    assert applied[:31] == [False] * 31 and all(applied[31:])  # settled, then trained
    assert not [w for w in recwarn.list if "skipped" in str(w.message)]
