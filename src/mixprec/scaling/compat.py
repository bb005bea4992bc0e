"""TensorFlow 1's and MindSpore's loss-scale managers, under their own names and defaults:
functions that build the ``DynamicLossScaler`` with each system's schedule and arithmetic,
so that code migrating from them keeps its numbers bit for bit."""

from __future__ import annotations

from mixprec._errors import ArgumentError
from mixprec.scaling.scalers import _FACTOR_ONE, DynamicLossScaler
from mixprec.scaling.values import positive

__all__ = ["DynamicLossScaleManager", "ExponentialUpdateLossScaleManager"]


def ExponentialUpdateLossScaleManager(  # noqa: N802 - TensorFlow 1's name, kept for migrants
    init_loss_scale: float,
    incr_every_n_steps: int,
    decr_every_n_nan_or_inf: int = 2,
    incr_ratio: float = 2.0,
    decr_ratio: float = 0.8,
) -> DynamicLossScaler:
    """TensorFlow 1's dynamic loss scale manager, with its names and defaults.

    Grows by ``incr_ratio`` after ``incr_every_n_steps`` finite steps in a row, shrinks by
    ``decr_ratio`` (never below 1) after ``decr_every_n_nan_or_inf`` overflows, and resets both
    counts whenever the scale changes, as ``tf.contrib.mixed_precision`` does.
    """
    return DynamicLossScaler(
        init_scale=init_loss_scale,
        growth_factor=incr_ratio,
        backoff_factor=decr_ratio,
        growth_interval=incr_every_n_steps,
        hysteresis=decr_every_n_nan_or_inf,
        min_scale=1.0,
        max_scale=None,
        arithmetic="tf1",
    )


def DynamicLossScaleManager(  # noqa: N802 - MindSpore's name, kept for migrants
    init_loss_scale: float = 2.0**24,
    scale_factor: float = 2,
    scale_window: int = 2000,
) -> DynamicLossScaler:
    """MindSpore's ``DynamicLossScaleManager``, with its names, defaults and arithmetic.

    As its update cell (what ``Model.train`` and ``TrainOneStepWithLossScaleCell`` run): an
    overflow multiplies the scale by the float32 ``1 / scale_factor`` (not a division, as
    ``DynamicLossScaler(scale_value=...)`` does for ``amp.DynamicLossScaler``; the two part
    for factors that are not powers of two), never below 1; ``scale_window`` finite steps
    in a row multiply it by ``scale_factor``, with no upper bound but float32's range. As
    the manager, the 1001st overflowing step in a row raises ``RuntimeError``.
    """
    factor = positive("scale_factor", scale_factor)
    if factor <= 1.0:
        raise ArgumentError(_FACTOR_ONE.format(scale_factor))
    if positive("init_loss_scale", init_loss_scale) < 1.0:
        raise ArgumentError(f"init_loss_scale={init_loss_scale!r} is invalid; it must be >= 1")
    return DynamicLossScaler(
        init_scale=init_loss_scale,
        growth_factor=factor,
        backoff_factor=1.0 / factor,
        growth_interval=scale_window,
        min_scale=1.0,
        max_scale=None,
        arithmetic="mindspore_manager",
        max_consecutive_skips=1000,
    )
