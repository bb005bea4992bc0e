"""Loss scalers: exact scale trajectories (powers of two multiply exactly in float32, so
equality is exact), hysteresis, bounds, the MindSpore and TensorFlow 1 constructors checked
against transcriptions of those systems' update rules, and unscaling."""

from __future__ import annotations

import math
import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import mixprec as mp
from mixprec.scaling import DynamicConfig, ScalerState, next_state, to_float32, unscale_grads_


def run(scaler: mp.LossScaler, overflows: list[bool]) -> list[float]:
    scales = []
    for found in overflows:
        scaler.update(found)
        scales.append(scaler.get_scale())
    return scales


def test_dynamic_defaults():
    s = mp.DynamicLossScaler()
    c = s.config
    assert s.get_scale() == 2.0**16
    assert (c.growth_factor, c.backoff_factor, c.growth_interval) == (2.0, 0.5, 2000)
    assert (c.hysteresis, c.min_scale, c.max_scale) == (1, 1.0, 2.0**24)


def test_exact_trajectory_with_injected_overflows():
    s = mp.DynamicLossScaler(init_scale=2.0**10, growth_interval=3)
    seq = [False, False, False, True, False, True, True, False, False, False, False]
    assert run(s, seq) == [
        2.0**10, 2.0**10, 2.0**11,  # three clean steps grow
        2.0**10,  # overflow backs off and resets the growth tracker
        2.0**10, 2.0**9, 2.0**8,
        2.0**8, 2.0**8, 2.0**9, 2.0**9,
    ]  # fmt: skip
    st_ = s.state
    assert (st_.steps, st_.skipped_steps, st_.consecutive_skips) == (11, 3, 0)
    assert st_.last_overflow_step == 6


def test_hysteresis_waits_for_n_overflows():
    s = mp.DynamicLossScaler(init_scale=2.0**10, growth_interval=100, hysteresis=3)
    assert run(s, [True, True]) == [2.0**10, 2.0**10]
    assert s.state.hysteresis_left == 1
    assert run(s, [True]) == [2.0**9]  # third overflow backs off...
    assert s.state.hysteresis_left == 3  # ...and refills the hysteresis
    # A finite step in between does not refill it (as in TF1's decr_every_n_nan_or_inf).
    assert run(s, [True, False, True, False, True]) == [2.0**9] * 4 + [2.0**8]


def test_bounds_are_never_crossed():
    s = mp.DynamicLossScaler(init_scale=4.0, min_scale=1.0, max_scale=16.0, growth_interval=1)
    assert run(s, [True] * 5) == [2.0, 1.0, 1.0, 1.0, 1.0]
    assert run(s, [False] * 6) == [2.0, 4.0, 8.0, 16.0, 16.0, 16.0]
    # A non-power-of-two growth is clamped to the maximum, not skipped.
    s = mp.DynamicLossScaler(init_scale=10.0, growth_factor=3.0, max_scale=20.0, growth_interval=1)
    assert run(s, [False]) == [20.0]


def test_unbounded_scale_stays_finite():
    s = mp.DynamicLossScaler(init_scale=2.0**126, max_scale=None, growth_interval=1)
    assert run(s, [False] * 3) == [2.0**127, 2.0**127, 2.0**127]  # 2**128 is inf in float32


@settings(max_examples=200, deadline=None)
@given(
    overflows=st.lists(st.booleans(), max_size=300),
    growth=st.sampled_from([1.5, 2.0, 3.0, 10.0]),
    backoff=st.sampled_from([0.1, 0.5, 0.9]),
    interval=st.integers(1, 5),
    hysteresis=st.integers(1, 4),
    bounded=st.booleans(),
)
def test_scale_always_finite_positive_and_in_bounds(
    overflows, growth, backoff, interval, hysteresis, bounded
):
    s = mp.DynamicLossScaler(
        init_scale=2.0**16,
        growth_factor=growth,
        backoff_factor=backoff,
        growth_interval=interval,
        hysteresis=hysteresis,
        min_scale=1.0 if bounded else None,
        max_scale=2.0**24 if bounded else None,
    )
    for found in overflows:
        s.update(found)
        scale = s.get_scale()
        assert math.isfinite(scale) and scale > 0
        assert to_float32(scale) == scale
        if bounded:
            assert 1.0 <= scale <= 2.0**24
    assert s.state.steps == len(overflows)
    assert s.state.skipped_steps == sum(overflows)


def test_matches_torch_update_kernel():
    """hysteresis=1 is torch's rule: compare against torch._amp_update_scale_ itself."""
    rng = random.Random(0)
    seq = [rng.random() < 0.2 for _ in range(400)]
    for growth, backoff in [(2.0, 0.5), (1.7, 0.3)]:
        scale = torch.full((), 2.0**12)
        tracker = torch.zeros((), dtype=torch.int32)
        ours = mp.DynamicLossScaler(2.0**12, growth, backoff, 5, min_scale=None, max_scale=None)
        for found in seq:
            torch._amp_update_scale_(
                scale, tracker, torch.full((), float(found)), growth, backoff, 5
            )
            ours.update(found)
            assert ours.get_scale() == scale.item()
            assert ours.state.growth_tracker == tracker.item()


def mindspore_reference(scale: float, factor: float, window: int, finite_seq: list[bool]):
    """MindSpore's DynamicLossScaler.adjust, transcribed: the scale and the factor are float32
    tensors, so products and quotients are float32 operations (exact in double, then
    rounded once)."""
    factor = to_float32(factor)
    counter, out = 0, []
    for finite in finite_seq:
        if finite:
            grown = to_float32(scale * factor)
            if counter == window - 1 and math.isfinite(grown):
                scale = grown
        else:
            scale = max(1.0, to_float32(scale / factor))
        counter = ((counter + 1) % window) * int(finite)
        out.append(scale)
    return out


@pytest.mark.parametrize(("factor", "window"), [(2, 50), (3, 4), (1.7, 3)])
def test_mindspore_names_reproduce_mindspore(factor, window):
    rng = random.Random(1)
    finite_seq = [rng.random() > 0.15 for _ in range(600)]
    ours = mp.DynamicLossScaler(scale_value=2**10, scale_factor=factor, scale_window=window)
    assert ours.config.min_scale == 1.0 and ours.config.max_scale is None
    scales = []
    for finite in finite_seq:
        ours.adjust(finite)  # MindSpore's flag: True means the gradients are finite
        scales.append(ours.get_scale())
    assert scales == mindspore_reference(2.0**10, factor, window, finite_seq)
    assert len(set(scales)) > 3


def tf1_reference(init, incr_n, decr_n, incr_ratio, decr_ratio, finite_seq):
    """tf.contrib.mixed_precision.ExponentialUpdateLossScaleManager, transcribed. Its
    loss_scale variable and the ratio constants are float32: every product is a float32
    multiplication (exact in double, then rounded once)."""
    incr_ratio, decr_ratio = to_float32(incr_ratio), to_float32(decr_ratio)
    scale, good, bad, out = init, 0, 0, []
    for finite in finite_seq:
        if finite:
            if good + 1 >= incr_n:
                grown = to_float32(scale * incr_ratio)
                scale = grown if math.isfinite(grown) else scale
                good = bad = 0
            else:
                good += 1
        elif bad + 1 >= decr_n:
            scale = max(1.0, to_float32(scale * decr_ratio))
            good = bad = 0
        else:
            bad += 1
            good = 0
        out.append(scale)
    return out


@pytest.mark.parametrize("decr_ratio", [0.5, 0.8])
def test_tf1_manager_reproduces_tf1(decr_ratio):
    rng = random.Random(2)
    finite_seq = [rng.random() > 0.3 for _ in range(3000)]
    ours = mp.ExponentialUpdateLossScaleManager(
        init_loss_scale=2**32, incr_every_n_steps=1000, decr_every_n_nan_or_inf=2,
        decr_ratio=decr_ratio,
    )  # fmt: skip
    scales = []
    for finite in finite_seq:
        ours.update(not finite)
        scales.append(ours.get_scale())
    assert scales == tf1_reference(2.0**32, 1000, 2, 2.0, decr_ratio, finite_seq)
    assert len(set(scales)) > 20
    # Short sequences with growth: incr_every_n_steps=3.
    finite_seq = [rng.random() > 0.3 for _ in range(500)]
    ours = mp.ExponentialUpdateLossScaleManager(8.0, 3, 2, 2.0, decr_ratio)
    scales = [ours.update(not f) or ours.get_scale() for f in finite_seq]
    assert scales == tf1_reference(8.0, 3, 2, 2.0, decr_ratio, finite_seq)


def test_pure_next_state_does_not_mutate():
    state = ScalerState(scale=8.0)
    config = DynamicConfig(growth_interval=1, max_scale=None)
    after = next_state(state, False, config)
    assert state.scale == 8.0 and after.scale == 16.0 and after.steps == 1


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
        ({"init_scale": 1e39, "max_scale": None}, r"init_scale=1e\+39 is beyond float32's range"),
        ({"arithmetic": "numpy"}, r"arithmetic='numpy' is invalid; valid: 'torch', 'tf1'"),
        ({"min_scale": 8.0, "max_scale": 4.0, "init_scale": 4.0}, r"min_scale=8.0 is larger"),
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


def test_unscale_grads_dense_sparse_and_mixed_dtypes():
    dense32 = torch.tensor([4.0, -8.0])
    dense_bf16 = torch.tensor([2.0, 6.0], dtype=torch.bfloat16)
    sparse = torch.sparse_coo_tensor([[0, 2]], torch.tensor([8.0, 16.0]), (4,)).coalesce()
    found = unscale_grads_([dense32, None, dense_bf16, sparse], 0.5)
    assert found.item() == 0.0 and found.dim() == 0
    assert dense32.tolist() == [2.0, -4.0]
    assert dense_bf16.tolist() == [1.0, 3.0]
    assert sparse.to_dense().tolist() == [4.0, 0.0, 8.0, 0.0]
    bad = torch.sparse_coo_tensor([[1]], torch.tensor([float("nan")]), (4,)).coalesce()
    assert unscale_grads_([dense32, bad], 1.0).item() == 1.0
    assert unscale_grads_([], 1.0).item() == 0.0


def test_all_finite():
    good = [torch.ones(3), torch.ones(2, dtype=torch.float16), None, torch.zeros(0)]
    assert bool(mp.all_finite(good))
    assert not bool(mp.all_finite([*good, torch.tensor([1.0, float("inf")])]))
    assert not bool(mp.all_finite([torch.tensor([float("nan")], dtype=torch.bfloat16)]))
    sparse = torch.sparse_coo_tensor([[0]], torch.tensor([float("inf")]), (3,))
    assert not bool(mp.all_finite([sparse]))
    assert mp.all_finite([torch.tensor([1, 2])]).dtype == torch.bool  # integers are finite


def test_unscale_widens_16_bit_values():
    s = mp.DynamicLossScaler()  # 2**16
    grad = torch.tensor([2.0**-10], dtype=torch.float16)
    (out,) = s.unscale([grad])
    assert out.dtype == torch.float32 and out.item() == 2.0**-26  # would be 0 in float16


@pytest.mark.parametrize(
    ("args", "after_one_overflow"),
    # MindSpore 2.10.0 (CPU), DynamicLossScaleManager(*args).get_update_cell() driven through
    # TrainOneStepWithLossScaleCell with one overflowing step: the scale it holds then.
    [((10, 3, 5), 3.3333334922790527), ((7, 1.5, 5), 4.6666669845581055)],
)
def test_mindspore_manager_backs_off_by_the_float32_reciprocal(args, after_one_overflow):
    manager = mp.DynamicLossScaleManager(*args)
    manager.update(True)
    assert manager.get_scale() == after_one_overflow  # bit for bit
    # amp.DynamicLossScaler divides instead, and lands one float32 step away.
    init, factor, window = args
    scaler = mp.DynamicLossScaler(scale_value=init, scale_factor=factor, scale_window=window)
    scaler.update(True)
    assert scaler.get_scale() != after_one_overflow
    assert scaler.get_scale() == pytest.approx(after_one_overflow, rel=2**-22)


def test_mindspore_manager_defaults_growth_and_floor():
    manager = mp.DynamicLossScaleManager()
    assert manager.get_scale() == 2.0**24 and manager.config.growth_interval == 2000
    small = mp.DynamicLossScaleManager(4, 2, 2)
    for _ in range(5):
        small.update(True)
    assert small.get_scale() == 1.0  # never below 1, as max(scale * ratio, 1)
    small.update(False)
    small.update(False)
    assert small.get_scale() == 2.0  # scale_window clean steps: times scale_factor


def test_mindspore_manager_stops_on_the_1001st_overflow_in_a_row():
    """MindSpore's manager raises RuntimeError once more than 1000 steps in a row
    overflowed ('... has exceeded maximum threshold'); mixprec's says what to do."""
    manager = mp.DynamicLossScaleManager(2.0**8, 2, 10)
    for _ in range(1000):
        manager.update(True)
    manager.update(False)  # a finite step resets the count
    for _ in range(1000):
        manager.update(True)
    with pytest.raises(RuntimeError, match=r"1001 overflowing steps in a row .*bfloat16"):
        manager.update(True)
    assert manager.state.consecutive_skips == 1001 and manager.get_scale() == 1.0
    restored = mp.DynamicLossScaleManager()
    restored.load_state_dict(manager.state_dict())
    assert restored.config == manager.config
    # Elsewhere there is no limit unless asked for.
    plain = mp.DynamicLossScaler()
    for _ in range(1200):
        plain.update(True)


def test_adjust_returns_what_mindspore_returns():
    assert mp.DynamicLossScaler(scale_value=8, scale_factor=2, scale_window=5).adjust(True)
    assert mp.StaticLossScaler(scale_value=8).adjust(True) is False


@pytest.mark.parametrize(
    "make",
    [lambda: mp.DynamicLossScaleManager(8, 1, 5),
     lambda: mp.DynamicLossScaler(scale_value=8, scale_factor=1, scale_window=5)],
)  # fmt: skip
def test_scale_factor_one_points_to_the_static_scaler(make):
    with pytest.raises(ValueError, match=r"scale_factor=1 is invalid.*use StaticLossScaler"):
        make()


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
    """Issue 15 item 3: such a scale loaded, and then every step skipped, divided by zero
    or applied with a negative scale. Nothing changes when the load is refused."""
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
    """Issue 15 item 7: these raised OverflowError."""
    with pytest.raises(
        ValueError, match=r"(init_scale|scale|max_grad_norm)=an int of 401 digits is invalid"
    ):
        make()


BIG = torch.finfo(torch.float32).max


@pytest.mark.parametrize("on_host", [True, False], ids=["cpu-read", "kernel"])
@pytest.mark.parametrize(
    ("values", "finite"),
    [
        ([[1.0, -2.0], [3.0]], True),
        ([[1.0, float("nan")], [3.0]], False),
        ([[1.0], [float("-inf"), 2.0]], False),
        ([[float("inf"), float("-inf")]], False),  # sums to NaN: still non-finite
        ([[BIG, BIG], [BIG]], True),  # finite values whose sum overflows float32
        ([[-BIG, -BIG]], True),
        ([[], [5.0]], True),
    ],
)
def test_scale_one_checks_read_only_and_exact(monkeypatch, values, finite, on_host):
    # At scale 1 on CPU the check reads per-tensor sums (no multiply-by-1 write); a sum
    # that overflows is confirmed value by value, so finite values are never a false alarm.
    if not on_host:
        monkeypatch.setattr(mp.scaling, "checks_on_host", lambda tensors: False)
    grads = [torch.tensor(v, dtype=torch.float32) for v in values]
    before = [g.clone() for g in grads]
    found = unscale_grads_(grads, 1.0)
    assert found.dtype == torch.float32 and found.dim() == 0
    assert found.item() == (0.0 if finite else 1.0)
    assert bool(mp.all_finite(grads)) is finite
    halves = [g.to(torch.float16) for g in grads]  # BIG becomes inf here
    assert bool(mp.all_finite(halves)) is all(bool(h.isfinite().all()) for h in halves)
    for g, b in zip(grads, before, strict=True):
        assert torch.equal(g.nan_to_num(), b.nan_to_num())  # not written


def test_the_cpu_check_flag_is_float32_whatever_the_default_dtype():
    # Review: under torch.set_default_dtype(float64) the flag was float64, and GradScaler's
    # fused optimizer step refused it.
    before = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        found = unscale_grads_([torch.ones(3, dtype=torch.float32)], 1.0)
        assert found.dtype == torch.float32 and found.item() == 0.0
    finally:
        torch.set_default_dtype(before)
