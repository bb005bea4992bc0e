"""TensorFlow 1's and MindSpore's managers, checked against a transcription of TensorFlow 1's
update rule and against scales MindSpore itself produced."""

from __future__ import annotations

import math
import random

import pytest

import mixprec as mp
from mixprec.scaling.schedule import to_float32


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


@pytest.mark.parametrize(
    "make",
    [lambda: mp.DynamicLossScaleManager(8, 1, 5),
     lambda: mp.DynamicLossScaler(scale_value=8, scale_factor=1, scale_window=5)],
)  # fmt: skip
def test_scale_factor_one_points_to_the_static_scaler(make):
    with pytest.raises(ValueError, match=r"scale_factor=1 is invalid.*use StaticLossScaler"):
        make()
