"""The dynamic loss-scale schedule as pure functions of a frozen state.

``next_state(state, found_inf, config)`` returns the state after one step; the stateful
scalers (``scalers.py``) only hold its result. The scale is a float32 value (it multiplies
float32 and 16-bit tensors): every new scale is rounded to float32 as a float32 tensor holding
it would be, so that a scale here and one in torch's or TensorFlow's kernels agree bit for bit.
"""

from __future__ import annotations

import math
import struct
from dataclasses import dataclass, replace
from typing import Literal

__all__ = [
    "SMALLEST_NORMAL_F32",
    "Arithmetic",
    "DynamicConfig",
    "ScalerState",
    "count_step",
    "next_state",
    "to_float32",
]

#: Smallest positive normal float32: the floor of a scale that has no explicit minimum.
SMALLEST_NORMAL_F32 = 2.0**-126


def to_float32(value: float) -> float:
    """Round a Python float to the nearest float32 (inf when out of float32's range)."""
    try:
        return float(struct.unpack("f", struct.pack("f", value))[0])
    except OverflowError:
        return math.copysign(math.inf, value)


@dataclass(frozen=True)
class ScalerState:
    """The scale and the counters, all checkpointed with the scaler.

    ``growth_tracker``: finite steps since the scale last changed or overflowed.
    ``hysteresis_left``: overflows still tolerated before the scale backs off.
    ``last_overflow_step``: 0-based index (among ``steps``) of the last overflowing step.
    """

    scale: float
    growth_tracker: int = 0
    hysteresis_left: int = 1
    steps: int = 0
    skipped_steps: int = 0
    consecutive_skips: int = 0
    last_overflow_step: int | None = None


Arithmetic = Literal["torch", "tf1", "mindspore", "mindspore_manager"]


@dataclass(frozen=True)
class DynamicConfig:
    """Parameters of the dynamic schedule; ``max_scale=None`` means float32's range.

    ``arithmetic`` reproduces each system's rounding, which matters for factors that are not
    powers of two: torch multiplies the float32 scale by the factor in double precision;
    TensorFlow 1 multiplies two float32 values; MindSpore multiplies by a float32
    ``scale_factor`` to grow and divides by it to back off (``amp.DynamicLossScaler``), or
    multiplies by the float32 ``1 / scale_factor`` (``DynamicLossScaleManager``'s update
    cell, ``"mindspore_manager"``).

    ``max_consecutive_skips``: more overflowing steps in a row than this raise
    ``RuntimeError`` (MindSpore's manager stops at 1000); ``None``: no limit.
    """

    growth_factor: float = 2.0
    backoff_factor: float = 0.5
    growth_interval: int = 2000
    hysteresis: int = 1
    min_scale: float | None = 1.0
    max_scale: float | None = 2.0**24
    arithmetic: Arithmetic = "torch"
    max_consecutive_skips: int | None = None

    @property
    def floor(self) -> float:
        """The lowest scale backing off reaches: ``min_scale``, else float32's smallest
        normal number."""
        return self.min_scale if self.min_scale is not None else SMALLEST_NORMAL_F32


def _grown(scale: float, config: DynamicConfig) -> float:
    if config.arithmetic == "torch":
        return to_float32(scale * config.growth_factor)
    return to_float32(scale * to_float32(config.growth_factor))


def _backed_off(scale: float, config: DynamicConfig) -> float:
    if config.arithmetic == "torch":
        return to_float32(scale * config.backoff_factor)
    if config.arithmetic == "tf1":
        return to_float32(scale * to_float32(config.backoff_factor))
    if config.arithmetic == "mindspore_manager":
        return to_float32(scale * to_float32(1.0 / config.growth_factor))
    return to_float32(scale / to_float32(config.growth_factor))  # mindspore


def count_step(state: ScalerState, found_inf: bool) -> ScalerState:
    """Advance the counters only (static and no-op scalers)."""
    if found_inf:
        return replace(
            state,
            steps=state.steps + 1,
            skipped_steps=state.skipped_steps + 1,
            consecutive_skips=state.consecutive_skips + 1,
            last_overflow_step=state.steps,
        )
    # Direct construction, not replace(): this runs every step, and replace() reads the
    # dataclass fields each call (about 5x the time).
    return ScalerState(
        state.scale,
        state.growth_tracker,
        state.hysteresis_left,
        state.steps + 1,
        state.skipped_steps,
        0,
        state.last_overflow_step,
    )


def next_state(state: ScalerState, found_inf: bool, config: DynamicConfig) -> ScalerState:
    """The dynamic schedule, as a pure function of the previous state.

    Overflow: the growth tracker resets and one unit of hysteresis is spent; when none is
    left the scale is multiplied by ``backoff_factor`` (not below ``min_scale``) and the
    hysteresis refills. ``growth_interval`` finite steps in a row multiply the scale by
    ``growth_factor`` (not above ``max_scale``; a growth that would leave float32's range is
    not taken) and refill the hysteresis. With ``hysteresis=1`` this is exactly
    ``torch.amp.GradScaler``'s rule; with more it is TensorFlow 1's
    ``decr_every_n_nan_or_inf``.
    """
    counted = count_step(state, found_inf)
    scale = state.scale
    if found_inf:
        left = state.hysteresis_left - 1
        if left > 0:
            return replace(counted, growth_tracker=0, hysteresis_left=left)
        scale = max(_backed_off(scale, config), config.floor)
        return replace(counted, scale=scale, growth_tracker=0, hysteresis_left=config.hysteresis)
    tracker = state.growth_tracker + 1
    if tracker < config.growth_interval:
        return replace(counted, growth_tracker=tracker)
    grown = _grown(scale, config)
    if config.max_scale is not None:
        grown = min(grown, config.max_scale)
    if math.isfinite(grown):
        scale = grown
    return replace(counted, scale=scale, growth_tracker=0, hysteresis_left=config.hysteresis)
