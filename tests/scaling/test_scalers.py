"""The stateful scalers: defaults, static and no-op scalers, scale and unscale, state_dict
round trips, and the checks of constructor arguments and of loaded state."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import mixprec as mp
from mixprec.scaling.schedule import to_float32
from tests.scaling._helpers import run


def test_dynamic_defaults():
    s = mp.DynamicLossScaler()
    c = s.config
    assert s.get_scale() == 2.0**16
    assert (c.growth_factor, c.backoff_factor, c.growth_interval) == (2.0, 0.5, 2000)
    assert (c.hysteresis, c.min_scale, c.max_scale) == (1, 1.0, 2.0**24)


def test_static_and_noop():
    s = mp.StaticLossScaler(128.0)
    assert run(s, [True, False, True]) == [128.0] * 3
    assert s.state.skipped_steps == 2
    assert mp.StaticLossScaler(scale_value=2.0**10).get_scale() == 1024.0
    n = mp.NoOpLossScaler()
    loss = torch.tensor(3.0)
    assert n.scale(loss) is loss and n.get_scale() == 1.0
    n.update(torch.tensor(1.0))
    assert n.state.skipped_steps == 1


def test_scale_unscale_out_of_place():
    s = mp.StaticLossScaler(1024.0)
    loss = torch.tensor(0.5)
    assert s.scale(loss).item() == 512.0
    assert s.unscale(s.scale(loss)).item() == 0.5
    grads = [torch.tensor([2048.0]), torch.tensor([1024.0])]
    assert [g.item() for g in s.unscale(grads)] == [2.0, 1.0]
    assert grads[0].item() == 2048.0  # unscale is out of place
    with pytest.raises(TypeError, match="needs a tensor or a list of tensors, got str"):
        s.scale("loss")


def test_state_dict_round_trip_and_type_check():
    s = mp.DynamicLossScaler(init_scale=2.0**8, growth_interval=2, hysteresis=2)
    run(s, [True, False, True, True])
    t = mp.DynamicLossScaler()
    t.load_state_dict(s.state_dict())
    assert t.state == s.state and t.config == s.config
    with pytest.raises(ValueError, match="state of a 'DynamicLossScaler' cannot load into"):
        mp.StaticLossScaler(2.0).load_state_dict(s.state_dict())
    bad = s.state_dict()
    del bad["steps"]
    with pytest.raises(ValueError, match="scaler state lacks steps"):
        t.load_state_dict(bad)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"growth_factor": 1.0}, r"growth_factor=1.0 is invalid; it must be > 1.0"),
        ({"growth_factor": 0.5}, r"growth_factor=0.5 is invalid"),
        ({"backoff_factor": 1.0}, r"backoff_factor=1.0 is invalid; .*\(0, 1\)"),
        ({"backoff_factor": 0.0}, r"backoff_factor=0.0 is invalid"),
        ({"backoff_factor": -0.5}, r"backoff_factor=-0.5 is invalid"),
        ({"growth_interval": -1}, r"growth_interval=-1 is invalid; it must be an int >= 1"),
        ({"growth_interval": 0}, r"growth_interval=0 is invalid"),
        ({"hysteresis": 0}, r"hysteresis=0 is invalid"),
        ({"init_scale": float("inf")}, r"init_scale=inf is invalid"),
        ({"init_scale": 0.0}, r"init_scale=0.0 is invalid"),
        ({"init_scale": 2.0**30}, r"init_scale=1073741824.0 is outside \[min_scale, max_scale\]"),
        ({"init_scale": 1e39, "max_scale": None}, r"init_scale=1e\+39 is invalid; float32 holds"),
        ({"arithmetic": "numpy"}, r"arithmetic='numpy' is invalid; valid: 'torch', 'tf1'"),
        ({"min_scale": 8.0, "max_scale": 4.0, "init_scale": 4.0}, r"min_scale=8.0 is larger"),
        # Below 2**-126, 1/scale overflows float32: the unscale failed mid-training.
        ({"min_scale": 2.0**-140, "init_scale": 1.0}, r"min_scale=7.17\d*e-43 is invalid; "),
        ({"max_scale": "65536"}, r"max_scale must be a number, got str"),  # was taken
    ],
)
def test_bad_dynamic_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        mp.DynamicLossScaler(**kwargs)


def test_bad_argument_types():
    with pytest.raises(TypeError, match="growth_interval must be an int, got float: 2.5"):
        mp.DynamicLossScaler(growth_interval=2.5)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="needs all of scale_value, scale_factor and scale_window"):
        mp.DynamicLossScaler(scale_value=8.0)
    with pytest.raises(ValueError, match="scale_factor=1 is invalid"):
        mp.DynamicLossScaler(scale_value=8.0, scale_factor=1, scale_window=5)
    with pytest.raises(TypeError, match="exactly one of scale= or scale_value="):
        mp.StaticLossScaler()
    with pytest.raises(ValueError, match="scale=-1.0 is invalid"):
        mp.StaticLossScaler(-1.0)
    with pytest.raises(ValueError, match="scale=0 is invalid"):
        mp.StaticLossScaler(0)


def test_scales_are_rounded_to_float32_like_a_float32_tensor():
    assert mp.DynamicLossScaler(init_scale=0.1, min_scale=None).get_scale() == to_float32(0.1)
    assert mp.StaticLossScaler(1000.3).get_scale() == torch.tensor(1000.3).item()


def test_unscale_widens_16_bit_values():
    s = mp.DynamicLossScaler()  # 2**16
    grad = torch.tensor([2.0**-10], dtype=torch.float16)
    (out,) = s.unscale([grad])
    assert out.dtype == torch.float32 and out.item() == 2.0**-26  # would be 0 in float16


def test_adjust_returns_what_mindspore_returns():
    assert mp.DynamicLossScaler(scale_value=8, scale_factor=2, scale_window=5).adjust(True)
    assert mp.StaticLossScaler(scale_value=8).adjust(True) is False


def test_state_dict_from_before_max_consecutive_skips_loads():
    saved = mp.DynamicLossScaler().state_dict()
    del saved["max_consecutive_skips"]
    scaler = mp.DynamicLossScaler()
    scaler.load_state_dict(saved)
    assert scaler.config.max_consecutive_skips is None


BAD_SCALES = [
    (float("nan"), ValueError, "'scale'=nan is invalid; it must be finite and > 0"),
    (float("inf"), ValueError, "'scale'=inf is invalid"),
    (0.0, ValueError, "'scale'=0.0 is invalid"),
    (-1024.0, ValueError, "'scale'=-1024.0 is invalid"),
    ("abc", TypeError, "'scale' must be a number, got str: 'abc'"),
    (1e300, ValueError, r"'scale'=1e\+300 is invalid; float32 holds scales in"),
    (1e-45, ValueError, r"'scale'=1e-45 is invalid; float32 holds"),
    (10**400, ValueError, "'scale'=an int of 401 digits is invalid"),
]


@pytest.mark.parametrize(
    "make",
    [mp.DynamicLossScaler, lambda: mp.StaticLossScaler(8.0), mp.NoOpLossScaler,
     mp.DynamicLossScaleManager],
)  # fmt: skip
@pytest.mark.parametrize(("scale", "error", "match"), BAD_SCALES)
def test_every_scaler_refuses_a_bad_scale_on_load(make, scale, error, match):
    """Such a scale, loaded, would make every step skip, divide by zero or apply with a
    negative scale. Nothing changes when the load is refused."""
    scaler = make()
    before = scaler.state_dict()
    bad = {**before, "scale": scale}
    with pytest.raises(error, match=match):
        scaler.load_state_dict(bad)
    assert scaler.state_dict() == before


@pytest.mark.parametrize(
    ("key", "value", "error", "match"),
    [
        ("growth_tracker", -1, ValueError, "'growth_tracker'=-1 is invalid"),
        ("steps", "7", TypeError, "'steps' must be an int, got str"),
        ("hysteresis_left", 0, ValueError, "'hysteresis_left'=0 is invalid"),
        ("last_overflow_step", 1.5, TypeError, "'last_overflow_step' must be an int"),
        ("growth_factor", "x", TypeError, "growth_factor must be a number, got str"),
        ("scale", 2.0**30, ValueError, r"'scale'=1073741824.0 is outside \[min_scale"),
    ],
)
def test_dynamic_scaler_state_values_are_checked_by_name(key, value, error, match):
    scaler = mp.DynamicLossScaler()
    with pytest.raises(error, match=match):
        scaler.load_state_dict({**scaler.state_dict(), key: value})


@pytest.mark.parametrize(("scale", "error", "match"), BAD_SCALES)
def test_grad_scaler_and_loss_scale_optimizer_refuse_a_bad_scale(scale, error, match):
    gs = mp.GradScaler("cpu")
    with pytest.raises(error, match=match):
        gs.load_state_dict({**gs.state_dict(), "scale": scale})
    assert gs.get_scale() == 65536.0
    with pytest.raises(ValueError, match="GradScaler state lacks _growth_tracker"):
        gs.load_state_dict({"scale": 2.0, "growth_factor": 2.0, "backoff_factor": 0.5,
                            "growth_interval": 10})  # fmt: skip
    param = nn.Parameter(torch.ones(2))
    opt = mp.LossScaleOptimizer(torch.optim.Adam([param], lr=0.1),
                                loss_scaler=mp.DynamicLossScaler())  # fmt: skip
    opt.backward(param.sum())
    opt.step()
    saved = opt.state_dict()
    fresh = mp.LossScaleOptimizer(torch.optim.Adam([nn.Parameter(torch.ones(2))], lr=0.1),
                                  loss_scaler=mp.DynamicLossScaler())  # fmt: skip
    bad = {**saved, "loss_scaler": {**saved["loss_scaler"], "scale": scale}}
    with pytest.raises(error, match=match):
        fresh.load_state_dict(bad)
    assert fresh.state_dict()["optimizers"][0]["state"] == {}  # all or nothing


@pytest.mark.parametrize(
    "make",
    [lambda: mp.DynamicLossScaler(init_scale=10**400), lambda: mp.StaticLossScaler(10**400),
     lambda: mp.GradScaler("cpu", 10**400),
     lambda: mp.LossScaleOptimizer(torch.optim.SGD([nn.Parameter(torch.ones(1))], lr=1.0),
                                   max_grad_norm=10**400)],
)  # fmt: skip
def test_numbers_beyond_float_are_refused_by_name(make):
    """An int beyond float's range is refused with the argument's name, not with
    OverflowError."""
    with pytest.raises(
        ValueError, match=r"(init_scale|scale|max_grad_norm)=an int of 401 digits is invalid"
    ):
        make()


def test_dynamic_loads_a_torch_grad_scaler_state():
    model = nn.Linear(2, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    theirs = torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=3)
    for i in range(6):  # one overflow, then five clean steps: one growth, tracker at 2
        opt.zero_grad()
        loss = model(torch.ones(1, 2)).sum() * (float("inf") if i == 0 else 1.0)
        theirs.scale(loss).backward()
        theirs.step(opt)
        theirs.update()
    state = theirs.state_dict()
    assert (state["scale"], state["_growth_tracker"]) == (2.0**10, 2)
    ours = mp.DynamicLossScaler()
    ours.load_state_dict(state)
    assert ours.get_scale() == theirs.get_scale() == 2.0**10
    assert ours.state.growth_tracker == 2
    assert (ours.config.growth_factor, ours.config.backoff_factor) == (2.0, 0.5)
    assert ours.config.growth_interval == 3
    assert run(ours, [False]) == [2.0**11]  # the third clean step grows, as torch's would


def test_static_refuses_a_torch_grad_scaler_state_and_says_where_it_loads():
    state = torch.amp.GradScaler("cpu").state_dict()
    with pytest.raises(mp.ArgumentError) as info:
        mp.StaticLossScaler(8.0).load_state_dict(state)
    assert str(info.value) == (
        "load_state_dict: a torch.amp.GradScaler state cannot load into StaticLossScaler; "
        "load it into DynamicLossScaler or mixprec.GradScaler"
    )


def test_dynamic_refuses_a_torch_grad_scaler_state_missing_a_key():
    state = torch.amp.GradScaler("cpu").state_dict()
    del state["growth_interval"]
    with pytest.raises(mp.ArgumentError) as info:
        mp.DynamicLossScaler().load_state_dict(state)
    assert str(info.value) == "load_state_dict: torch.amp.GradScaler state lacks growth_interval"


def test_noop_scaler_keeps_scale_one():
    """It never scales the loss, so another scale would divide every gradient by it."""
    from mixprec.scaling import NoOpLossScaler, StaticLossScaler

    scaler = NoOpLossScaler()
    state = StaticLossScaler(1024.0).state_dict() | {"type": "NoOpLossScaler"}
    with pytest.raises(ValueError, match=r"load_state_dict: scale=1024.0 is invalid; its scale"):
        scaler.load_state_dict(state)
    with pytest.raises(ValueError, match=r"set_scale=4096.0 is invalid"):
        scaler.set_scale(4096.0)
    assert scaler.get_scale() == 1.0
    scaler.load_state_dict(NoOpLossScaler().state_dict())


def test_a_scale_set_by_hand_stays_within_what_loads_again():
    # set_scale and GradScaler.update(new_scale) took 2**30 past max_scale=2**20, and
    # 2**-130; the state_dict then refused to load, into this scaler as into a new one.
    scaler = mp.DynamicLossScaler(max_scale=2.0**20)
    with pytest.raises(mp.ArgumentError, match=r"set_scale\(1073741824.0\) is outside"):
        scaler.set_scale(2.0**30)
    with pytest.raises(mp.ArgumentError, match=r"float32 holds scales in \[2\*\*-126"):
        scaler.set_scale(2.0**-130)
    grad_scaler = mp.GradScaler("cpu", init_scale=2.0**16, max_scale=2.0**20)
    grad_scaler.scale(torch.ones(()))  # started, as torch requires before update()
    with pytest.raises(mp.ArgumentError, match=r"is outside \[min_scale, max_scale\]"):
        grad_scaler.update(2.0**30)
    scaler.set_scale(2.0**19)
    mp.DynamicLossScaler(max_scale=2.0**20).load_state_dict(scaler.state_dict())


def test_a_grad_scaler_state_keeps_its_bounds_and_counters_in_a_dynamic_scaler():
    # It has torch's _growth_tracker and no "type": read as torch's, its hysteresis, bounds
    # and counters were dropped for the loading scaler's defaults.
    source = mp.GradScaler("cpu", init_scale=256.0, hysteresis=3, min_scale=4.0,
                           max_scale=2.0**20)  # fmt: skip
    state = source.state_dict()
    target = mp.DynamicLossScaler()
    target.load_state_dict(state)
    assert target.config.hysteresis == 3 and target.config.min_scale == 4.0
    assert target.config.max_scale == 2.0**20 and target.get_scale() == 256.0


def test_scaler_health_names_a_skip_rate_that_is_no_number():
    # A string failed as a bare TypeError from the comparison.
    with pytest.raises(mp.ArgumentError, match=r"max_skip_rate='0.5'\) is invalid; use a frac"):
        mp.ScalerHealth(max_skip_rate="0.5")


def test_the_protocol_refuses_a_bad_scale_factor_or_flag():
    """``LossScaler(nan)`` skipped every step, ``unscale_(factor=nan)`` made every gradient
    NaN and returned found_inf 0 (the step would apply them), and ``update("no")`` was read
    by truthiness. Each is refused by name; numbers (numpy's too) and bools stay flags."""
    for scale in (float("nan"), 0, -1024):
        with pytest.raises(mp.ArgumentError, match=r"scale=.* is invalid"):
            mp.LossScaler(scale)
    scaler = mp.DynamicLossScaler(init_scale=8.0)
    grads = [torch.ones(3)]
    for factor in (float("nan"), 0.0, float("inf")):
        with pytest.raises(mp.ArgumentError, match=r"unscale_: factor=.* is invalid"):
            scaler.unscale_(grads, factor=factor)
    assert torch.equal(grads[0], torch.ones(3))
    for method, name in ((scaler.update, "found_inf"), (scaler.adjust, "grads_finite")):
        for flag in ("no", None):
            with pytest.raises(mp.ArgumentError, match=rf"{name}=.* is invalid; use a bool"):
                method(flag)
    assert scaler.state.steps == 0
    import numpy

    # Flags all: numpy's bool and ints, and the protocol's own found_inf read with .item().
    found = scaler.unscale_([torch.ones(2)])
    for flag in (numpy.bool_(False), 1, numpy.int64(1), found.item()):
        scaler.update(flag)
    assert scaler.state.steps == 4 and scaler.state.skipped_steps == 2


def test_a_torch_state_whose_scale_grew_past_max_scale_says_how_to_load_it():
    """torch's scale has no bounds (2**26 after a long clean run); the load was refused
    with only "outside [min_scale, max_scale]"."""
    torch_state = torch.amp.GradScaler("cpu", init_scale=2.0**26).state_dict()
    with pytest.raises(ValueError, match=r"torch.amp.GradScaler state's 'scale'=67108864.0 is "
                       r"outside .*build this one with max_scale=None"):  # fmt: skip
        mp.DynamicLossScaler().load_state_dict(torch_state)
    unbounded = mp.DynamicLossScaler(max_scale=None)
    unbounded.load_state_dict(torch_state)
    assert unbounded.get_scale() == 2.0**26
