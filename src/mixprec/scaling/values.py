"""The checks of the loss scalers' values: scales and counts given to a constructor, the
dynamic scaler's configuration, and the state ``load_state_dict`` takes (every value checked
before anything changes)."""

from __future__ import annotations

import math
from typing import Any

from mixprec._errors import ArgumentError, shown
from mixprec.scaling.schedule import (
    SMALLEST_NORMAL_F32,
    Arithmetic,
    DynamicConfig,
    ScalerState,
    to_float32,
)

__all__ = [
    "MIXPREC_KEYS",
    "TORCH_CONFIG",
    "check_config",
    "checked_state",
    "count",
    "positive",
    "scale_value",
    "unit",
]


def unit(name: str, scale: float) -> None:
    if scale != 1.0:
        raise ArgumentError(
            f"NoOpLossScaler: {name}={scale!r} is invalid; its scale is 1 (it never scales the "
            "loss). Use StaticLossScaler or DynamicLossScaler for another scale"
        )


def positive(name: str, value: float) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ArgumentError(f"{name} must be a number, got {type(value).__name__}: {value!r}")
    try:
        number = float(value)
    except OverflowError:  # an int beyond float's range (10**400)
        raise ArgumentError(
            f"{name}={shown(value)} is invalid; it is beyond float's range"
        ) from None
    if not (math.isfinite(number) and number > 0):
        raise ArgumentError(f"{name}={value!r} is invalid; it must be a finite number > 0")
    return number


def scale_value(name: str, value: float) -> float:
    """A positive scale, rounded to float32 as a float32 tensor holding it would be; a
    normal float32 number (below 2**-126, ``1 / scale`` is past float32's range: the
    unscale failed mid-training, and the state would not load again)."""
    rounded = to_float32(positive(name, value))
    if not SMALLEST_NORMAL_F32 <= rounded < math.inf:
        raise ArgumentError(
            f"{name}={value!r} is invalid; float32 holds scales in [2**-126, ~3.4e38] "
            "(normal numbers)"
        )
    return rounded


def count(name: str, value: int, minimum: int = 1) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ArgumentError(f"{name} must be an int, got {type(value).__name__}: {value!r}")
    if value < minimum:
        raise ArgumentError(f"{name}={value!r} is invalid; it must be an int >= {minimum}")
    return value


def checked_state(state_dict: dict[str, Any]) -> ScalerState:
    """The ``ScalerState`` in ``state_dict``, every value checked: a scale of NaN, inf, 0, a
    negative number, a string or one float32 cannot hold would make every later step skip,
    divide by zero or apply with a wrong sign."""
    where = "load_state_dict: scaler state"
    scale = state_dict["scale"]
    if isinstance(scale, bool) or not isinstance(scale, (int, float)):
        raise ArgumentError(
            f"{where} 'scale' must be a number, got {type(scale).__name__}: {scale!r}"
        )
    try:
        value = float(scale)
    except OverflowError:
        value = math.inf
    if not (math.isfinite(value) and value > 0):
        raise ArgumentError(f"{where} 'scale'={shown(scale)} is invalid; it must be finite and > 0")
    if not SMALLEST_NORMAL_F32 <= to_float32(value) < math.inf:
        raise ArgumentError(
            f"{where} 'scale'={shown(scale)} is invalid; float32 holds scales in "
            f"[2**-126, ~3.4e38] (normal numbers)"
        )
    counts = {}
    for key, minimum in (
        ("growth_tracker", 0), ("hysteresis_left", 1), ("steps", 0), ("skipped_steps", 0),
        ("consecutive_skips", 0),
    ):  # fmt: skip
        counts[key] = count(f"{where} {key!r}", state_dict[key], minimum)
    last = state_dict["last_overflow_step"]
    if last is not None:
        last = count(f"{where} 'last_overflow_step'", last, 0)
    return ScalerState(scale=to_float32(value), last_overflow_step=last, **counts)


# The keys of ``torch.amp.GradScaler().state_dict()`` besides ``_growth_tracker``.
TORCH_CONFIG = ("scale", "growth_factor", "backoff_factor", "growth_interval")
# What a DynamicLossScaler holds besides them: bounds, hysteresis and counters.
MIXPREC_KEYS = frozenset(
    {*DynamicConfig.__dataclass_fields__, *ScalerState.__dataclass_fields__} - {"growth_tracker"}
)


def check_config(
    growth_factor: float,
    backoff_factor: float,
    growth_interval: int,
    hysteresis: int,
    min_scale: float | None,
    max_scale: float | None,
    arithmetic: Arithmetic = "torch",
    max_consecutive_skips: int | None = None,
) -> DynamicConfig:
    growth = positive("growth_factor", growth_factor)
    if growth <= 1.0:
        raise ArgumentError(f"growth_factor={growth_factor!r} is invalid; it must be > 1.0")
    backoff = positive("backoff_factor", backoff_factor)
    if not backoff < 1.0:
        raise ArgumentError(
            f"backoff_factor={backoff_factor!r} is invalid; it must be in the open interval (0, 1)"
        )
    low = None if min_scale is None else scale_value("min_scale", min_scale)
    high = None if max_scale is None else scale_value("max_scale", max_scale)
    if low is not None and high is not None and low > high:
        raise ArgumentError(f"min_scale={min_scale!r} is larger than max_scale={max_scale!r}")
    if arithmetic not in ("torch", "tf1", "mindspore", "mindspore_manager"):
        raise ArgumentError(
            f"arithmetic={arithmetic!r} is invalid; valid: 'torch', 'tf1', 'mindspore', "
            "'mindspore_manager'"
        )
    return DynamicConfig(
        growth_factor=growth,
        backoff_factor=backoff,
        growth_interval=count("growth_interval", growth_interval),
        hysteresis=count("hysteresis", hysteresis),
        min_scale=low,
        max_scale=high,
        arithmetic=arithmetic,
        max_consecutive_skips=(
            None
            if max_consecutive_skips is None
            else count("max_consecutive_skips", max_consecutive_skips)
        ),
    )
