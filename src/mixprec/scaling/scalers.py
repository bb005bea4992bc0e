"""The stateful loss scalers: one protocol (``scale``, ``unscale_``, ``update``,
``state_dict``) around the pure schedule of ``schedule.py``, and the checks of their
arguments and of the state they load.

Float16 has a 5-bit exponent: gradients below 2**-24 flush to zero. Multiplying the loss by
a scale S before backward lifts them into range; dividing the gradients by S afterwards
restores them. A step whose gradients overflowed is skipped and, for the dynamic scaler,
the scale backs off. The scale is kept on the host: a skip costs one read of ``found_inf``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, replace
from typing import Any, NoReturn, TypeVar

import torch

from mixprec._dtypes import HALF_DTYPES
from mixprec._errors import ArgumentError, is_number, shown
from mixprec.scaling.by_hand import NOTED_CALLS, note_unscaled
from mixprec.scaling.finite import unscale_grads_
from mixprec.scaling.schedule import (
    Arithmetic,
    DynamicConfig,
    ScalerState,
    count_step,
    next_state,
)
from mixprec.scaling.values import (
    MIXPREC_KEYS,
    TORCH_CONFIG,
)
from mixprec.scaling.values import check_config as _check_config
from mixprec.scaling.values import checked_state as _checked_state
from mixprec.scaling.values import positive as _positive
from mixprec.scaling.values import scale_value as _scale_value
from mixprec.scaling.values import unit as _unit

__all__ = ["DynamicLossScaler", "LossScaler", "NoOpLossScaler", "StaticLossScaler"]

T = TypeVar("T")


class LossScaler:
    """The protocol every scaler follows: ``scale``, ``unscale_``, ``update``, ``get_scale``,
    ``state_dict``/``load_state_dict``. The state (scale and counters) is in ``state``."""

    def __init__(self, scale: float) -> None:
        # Checked here too, for a scaler of the protocol's own: NaN skipped every step, 0
        # divided by zero at the first, -1024 flipped the updates.
        self._state = ScalerState(scale=_scale_value("scale", scale))

    @property
    def state(self) -> ScalerState:
        return self._state

    @property
    def needs_scaling(self) -> bool:
        """False when the scale is fixed at 1 (multiplying by it would be wasted work)."""
        return True

    def get_scale(self) -> float:
        return self._state.scale

    def set_scale(self, scale: float) -> None:
        """Set the scale by hand; the counters are unchanged."""
        self._state = replace(self._state, scale=_scale_value("scale", scale))

    def scale(self, loss: T) -> T:
        """``loss * scale`` for a tensor, or for each tensor of a list or tuple."""
        if isinstance(loss, torch.Tensor):
            return loss * self._state.scale if self.needs_scaling else loss  # type: ignore[return-value]
        if isinstance(loss, (list, tuple)):
            return type(loss)(self.scale(v) for v in loss)  # type: ignore[return-value]
        raise ArgumentError(
            f"scale(loss) needs a tensor or a list of tensors, got {type(loss).__name__}"
        )

    def unscale(self, value: T) -> T:
        """``value / scale`` out of place, for a tensor or a list/tuple of them (MindSpore's
        ``unscale``, used on the loss and on gradients). 16-bit tensors come back in
        float32: divided in float16, the small values scaling protected would flush to 0."""
        if isinstance(value, torch.Tensor):
            if not self.needs_scaling:
                return value  # type: ignore[return-value]
            wide = value.float() if value.dtype in HALF_DTYPES else value
            return wide * (1.0 / self._state.scale)  # type: ignore[return-value]
        if isinstance(value, (list, tuple)):
            return type(value)(self.unscale(v) for v in value)  # type: ignore[return-value]
        raise ArgumentError(
            f"unscale(value) needs a tensor or a list of tensors, got {type(value).__name__}"
        )

    #: What ``adjust`` returns: MindSpore's dynamic scaler says True, its static one False.
    _ADJUSTS = False

    def adjust(self, grads_finite: bool | torch.Tensor) -> bool:
        """MindSpore's ``adjust``: ``update`` with the flag inverted (True = all finite);
        returns True for a dynamic scaler and False otherwise, as MindSpore's do."""
        if isinstance(grads_finite, torch.Tensor):
            grads_finite = bool(grads_finite.item())
        elif isinstance(grads_finite, (str, type(None))):
            _refuse_flag("adjust", "grads_finite", grads_finite)
        self.update(not grads_finite)
        return self._ADJUSTS

    def unscale_(
        self,
        grads: Sequence[torch.Tensor | None],
        device: torch.device | str | None = None,
        factor: float = 1.0,
    ) -> torch.Tensor:
        """Divide ``grads`` by the scale (times ``factor``) in place, in one pass that checks
        them; return the 0-dim ``found_inf`` (on ``device`` when ``grads`` is empty)."""
        if factor != 1.0 and not (is_number(factor) and 0 < factor < math.inf):
            # NaN made every gradient NaN with found_inf 0: the step would apply them.
            raise ArgumentError(
                f"unscale_: factor={shown(factor)} is invalid; use a finite number > 0"
            )
        noted = getattr(self, "_noted", 0)  # by_hand: a loop's own unscale_ (an old pickle)
        if noted < NOTED_CALLS and not torch.compiler.is_compiling():
            grads, self._noted = list(grads), noted + 1
            note_unscaled(grads)
        return unscale_grads_(grads, factor / self._state.scale, device)

    def update(self, found_inf: bool | torch.Tensor) -> None:
        """Advance the state after a step whose gradients were (not) finite."""
        if isinstance(found_inf, torch.Tensor):
            found_inf = bool(found_inf.item())
        elif isinstance(found_inf, (str, type(None))):
            _refuse_flag("update", "found_inf", found_inf)
        self._state = self._next(self._state, bool(found_inf))

    def _next(self, state: ScalerState, found_inf: bool) -> ScalerState:
        return count_step(state, found_inf)

    def _config(self) -> dict[str, Any]:
        return {}

    def state_dict(self) -> dict[str, Any]:
        return {"type": type(self).__name__, **self._config(), **asdict(self._state)}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a state from ``state_dict()`` of this class; ``DynamicLossScaler`` also loads
        one from ``torch.amp.GradScaler().state_dict()``."""
        if "type" not in state_dict and "_growth_tracker" in state_dict:
            state_dict = self._from_torch(state_dict)
        kind = state_dict.get("type")
        if kind != type(self).__name__:
            raise ArgumentError(
                f"load_state_dict: state of a {kind!r} cannot load into {type(self).__name__}"
            )
        fields = ScalerState.__dataclass_fields__
        missing = [k for k in fields if k not in state_dict]
        if missing:
            raise ArgumentError(f"load_state_dict: scaler state lacks {', '.join(missing)}")
        state = _checked_state(state_dict)  # every value checked before anything changes
        self._load_config(state_dict, state.scale)
        self._state = state

    def _load_config(self, state_dict: dict[str, Any], scale: float) -> None:
        pass

    def _from_torch(self, state_dict: dict[str, Any]) -> dict[str, Any]:
        raise ArgumentError(
            f"load_state_dict: a torch.amp.GradScaler state cannot load into "
            f"{type(self).__name__}; load it into DynamicLossScaler or mixprec.GradScaler"
        )

    def __repr__(self) -> str:
        config = ", ".join(f"{k}={v!r}" for k, v in self._config().items())
        return f"{type(self).__name__}(scale={self.get_scale()!r}{', ' if config else ''}{config})"


def _refuse_flag(method: str, name: str, value: Any) -> NoReturn:
    """A step's flag that is not one: "no" or None, read by truthiness (a number, numpy's
    too, or a found_inf read with .item() is a flag)."""
    raise ArgumentError(f"{method}: {name}={shown(value)} is invalid; use a bool or a 0-dim tensor")


class NoOpLossScaler(LossScaler):
    """Scale 1, for bfloat16 and float32. Non-finite gradients are still found and skipped."""

    def __init__(self) -> None:
        super().__init__(1.0)

    @property
    def needs_scaling(self) -> bool:
        return False

    def set_scale(self, scale: float) -> None:
        _unit("set_scale", scale)
        super().set_scale(scale)

    def _load_config(self, state_dict: dict[str, Any], scale: float) -> None:
        # The loss is never scaled here: another scale would divide every gradient by it.
        _unit("load_state_dict: scale", scale)


class StaticLossScaler(LossScaler):
    """A fixed scale (MindSpore ``StaticLossScaler(scale_value)``); overflowing steps skip."""

    def __init__(self, scale: float | None = None, *, scale_value: float | None = None) -> None:
        if (scale is None) == (scale_value is None):
            raise ArgumentError("StaticLossScaler needs exactly one of scale= or scale_value=")
        name, given = ("scale", scale) if scale is not None else ("scale_value", scale_value)
        super().__init__(_scale_value(name, given))  # type: ignore[arg-type]


# MindSpore's constructors take scale_factor=1, a scale that never moves; mixprec says so.
_FACTOR_ONE = (
    "scale_factor={!r} is invalid; it must be > 1 (a factor of 1 never changes the scale: "
    "use StaticLossScaler(scale_value=...) for a fixed one)"
)


class _DefaultMax(float):
    """Marks the default ``max_scale`` so MindSpore-named construction can drop the bound."""


_DEFAULT_MAX = _DefaultMax(2.0**24)


class DynamicLossScaler(LossScaler):
    """A scale that backs off on overflow and grows after ``growth_interval`` clean steps.

    MindSpore users may write ``DynamicLossScaler(scale_value=2**10, scale_factor=2,
    scale_window=50)``: growth by ``scale_factor``, backoff by ``1/scale_factor``, growth
    after ``scale_window`` clean steps, a floor of 1 and no upper bound other than float32's
    range, with MindSpore's float32 arithmetic. Scales are rounded to float32.
    """

    def __init__(
        self,
        init_scale: float = 2.0**16,
        growth_factor: float = 2.0,
        backoff_factor: float = 0.5,
        growth_interval: int = 2000,
        hysteresis: int = 1,
        min_scale: float | None = 1.0,
        max_scale: float | None = _DEFAULT_MAX,
        *,
        scale_value: float | None = None,
        scale_factor: float | None = None,
        scale_window: int | None = None,
        arithmetic: Arithmetic = "torch",
        max_consecutive_skips: int | None = None,
    ) -> None:
        if scale_value is not None or scale_factor is not None or scale_window is not None:
            if None in (scale_value, scale_factor, scale_window):
                raise ArgumentError(
                    "DynamicLossScaler with MindSpore names needs all of scale_value, "
                    f"scale_factor and scale_window; got scale_value={scale_value!r}, "
                    f"scale_factor={scale_factor!r}, scale_window={scale_window!r}"
                )
            init_scale = scale_value  # type: ignore[assignment]
            growth_factor = _positive("scale_factor", scale_factor)  # type: ignore[arg-type]
            if growth_factor <= 1.0:
                raise ArgumentError(_FACTOR_ONE.format(scale_factor))
            backoff_factor = 1.0 / growth_factor
            growth_interval = scale_window  # type: ignore[assignment]
            arithmetic = "mindspore"
            if isinstance(max_scale, _DefaultMax):
                max_scale = None
        config = _check_config(
            growth_factor,
            backoff_factor,
            growth_interval,
            hysteresis,
            min_scale,
            max_scale,
            arithmetic,
            max_consecutive_skips,
        )
        init = _scale_value("init_scale", init_scale)
        low = config.floor
        high = config.max_scale if config.max_scale is not None else float(torch.finfo().max)
        if not low <= init <= high:
            raise ArgumentError(
                f"init_scale={init!r} is outside [min_scale, max_scale] = [{low!r}, {high!r}]"
            )
        super().__init__(init)
        self.config = config
        self._state = replace(self._state, hysteresis_left=config.hysteresis)

    _ADJUSTS = True

    def set_scale(self, scale: float) -> None:
        """Set the scale by hand, within ``[min_scale, max_scale]`` (outside, its state
        would not load again); the counters are unchanged."""
        value = _scale_value("scale", scale)
        low, high = self.config.floor, self.config.max_scale
        if value < low or (high is not None and value > high):
            raise ArgumentError(
                f"set_scale({scale!r}) is outside [min_scale, max_scale] = [{low!r}, {high!r}]"
            )
        super().set_scale(value)

    def _next(self, state: ScalerState, found_inf: bool) -> ScalerState:
        new = next_state(state, found_inf, self.config)
        limit = self.config.max_consecutive_skips
        if limit is not None and new.consecutive_skips > limit:
            self._state = new  # counted, as MindSpore's manager counts it before raising
            raise RuntimeError(
                f"{new.consecutive_skips} overflowing steps in a row (more than "
                f"max_consecutive_skips={limit}) at loss scale {new.scale:g}: the model "
                "overflows at every scale. Train it in bfloat16 (policy='mixed_bfloat16'), "
                "or keep the overflowing modules in float32 (keep_float32=...; "
                "mixprec.diagnose names them)"
            )
        return new

    def _config(self) -> dict[str, Any]:
        return asdict(self.config)

    def _load_config(self, state_dict: dict[str, Any], scale: float) -> None:
        # Keys added after a checkpoint was written take their defaults.
        defaults = asdict(DynamicConfig())
        config = _check_config(
            *(state_dict.get(k, defaults[k]) for k in DynamicConfig.__dataclass_fields__)
        )
        low, high = config.min_scale, config.max_scale
        if (low is not None and scale < low) or (high is not None and scale > high):
            raise ArgumentError(
                f"load_state_dict: scaler state 'scale'={scale!r} is outside [min_scale, "
                f"max_scale] = [{low!r}, {high!r}]"
            )
        self.config = config

    def _from_torch(self, state_dict: dict[str, Any]) -> dict[str, Any]:
        """This scaler's state with torch's scale, growth tracker, factors and interval.
        torch has no hysteresis, scale bounds or step counters: those stay this scaler's."""
        missing = [k for k in (*TORCH_CONFIG, "_growth_tracker") if k not in state_dict]
        if missing:
            raise ArgumentError(
                f"load_state_dict: torch.amp.GradScaler state lacks {', '.join(missing)}"
            )
        # mixprec's GradScaler adds its scaler's own keys beside torch's: taken too.
        extras = {k: v for k, v in state_dict.items() if k in MIXPREC_KEYS}
        low, high = self.config.min_scale, self.config.max_scale
        scale = state_dict["scale"]
        bounded = "min_scale" in state_dict or "max_scale" in state_dict  # mixprec's own
        if (
            is_number(scale)
            and not bounded
            and ((low is not None and scale < low) or (high is not None and scale > high))
        ):  # torch's scale has no bounds: past 2**24 after a long run of clean steps
            raise ArgumentError(
                f"load_state_dict: the torch.amp.GradScaler state's 'scale'={scale!r} is "
                f"outside this scaler's [min_scale, max_scale] = [{low!r}, {high!r}]; "
                "torch's scaler has no bounds: build this one with max_scale=None (or "
                "min_scale=None) to load it"
            )
        return {
            **self.state_dict(),
            **extras,
            **{k: state_dict[k] for k in TORCH_CONFIG},
            "growth_tracker": state_dict["_growth_tracker"],
        }
