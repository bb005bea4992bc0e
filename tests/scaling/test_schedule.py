"""The dynamic schedule: exact scale trajectories (powers of two multiply exactly in float32,
so equality is exact), hysteresis, bounds, a property test over random overflow sequences,
and the arithmetic of torch and MindSpore checked against torch's kernel and a
transcription of MindSpore's update rule."""

from __future__ import annotations

import math
import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import mixprec as mp
from mixprec.scaling.schedule import DynamicConfig, ScalerState, next_state, to_float32
from tests.scaling._helpers import run


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


def test_pure_next_state_does_not_mutate():
    state = ScalerState(scale=8.0)
    config = DynamicConfig(growth_interval=1, max_scale=None)
    after = next_state(state, False, config)
    assert state.scale == 8.0 and after.scale == 16.0 and after.steps == 1
