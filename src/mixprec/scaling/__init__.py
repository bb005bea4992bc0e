"""Loss scaling: pure next-state logic, the stateful scalers around it, and unscaling.

Float16 has a 5-bit exponent: gradients below 2**-24 flush to zero. Multiplying the loss by
a scale S before backward lifts them into range; dividing the gradients by S afterwards
restores them. A step whose gradients overflowed is skipped and, for the dynamic scaler,
the scale backs off.

The scale is always a float32 value (it multiplies float32/16-bit tensors), kept on the host
so that deciding to skip costs the one device-to-host transfer of ``found_inf`` per step.
"""

from __future__ import annotations

import math
import struct
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, replace
from typing import Any, Literal, TypeVar

import torch

from mixprec._dist import is_dtensor
from mixprec._dtypes import HALF_DTYPES
from mixprec._errors import ArgumentError, shown

T = TypeVar("T")

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
    return replace(state, steps=state.steps + 1, consecutive_skips=0)


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


def unscale_grads_(
    grads: Iterable[torch.Tensor | None],
    inv_scale: float,
    device: torch.device | str | None = None,
) -> torch.Tensor:
    """Multiply gradients by ``inv_scale`` in place and report whether any is inf or NaN.

    Dense and sparse gradients (their values: callers coalesce float16 sparse gradients
    first, as duplicate indices can overflow when summed). One multi-tensor kernel per
    (device, dtype) group. Returns a 0-dim float32 tensor, 1.0 if a non-finite value was
    seen, on the first gradient's device (on ``device`` when there are no gradients, so that
    a rank without gradients still joins a collective on the right device); nothing is
    synchronised with the host.
    """
    groups: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
    for grad in grads:
        if grad is None:
            continue
        values = grad._values() if grad.is_sparse else grad
        if is_dtensor(values):  # FSDP2: each rank unscales and checks its own shard
            values = values.to_local()  # type: ignore[attr-defined]
        groups.setdefault((values.device, values.dtype), []).append(values)
    tensors = [t for group in groups.values() for t in group]
    # The scale last: under torch.compile it is a graph input, and comparing it is a guard.
    if tensors and checks_on_host(tensors) and inv_scale == 1.0:
        # Scale 1 (float32, bfloat16) on CPU: a read-only check, as the multiply by 1 is
        # not needed. On CPU reading the answer costs no device synchronisation.
        return torch.tensor(0.0 if finite_on_cpu(tensors) else 1.0, dtype=torch.float32)
    found: dict[torch.device, torch.Tensor] = {}
    inv: dict[torch.device, torch.Tensor] = {}
    with torch.no_grad():
        for (device, _), tensors in groups.items():
            if device not in found:
                found[device] = torch.zeros((), dtype=torch.float32, device=device)
                if torch.compiler.is_compiling():
                    # Inductor bakes a fill value into the graph (a recompile per loss
                    # scale); a product keeps the scale a graph input.
                    inv[device] = torch.ones((), dtype=torch.float32, device=device) * inv_scale
                else:
                    inv[device] = torch.full((), inv_scale, dtype=torch.float32, device=device)
            torch._amp_foreach_non_finite_check_and_unscale_(tensors, found[device], inv[device])
    if not found:
        return torch.zeros((), dtype=torch.float32, device=device)
    flags = list(found.values())
    total = flags[0]
    for other in flags[1:]:
        total = total + other.to(total.device, non_blocking=True)
    return total


def checks_on_host(tensors: Sequence[torch.Tensor]) -> bool:
    """Whether finiteness checks read their answer at once (``finite_on_cpu``): on CPU,
    where that costs no synchronisation; not under ``torch.compile``, and not for DTensors
    (a read on the host would see this rank's partial sum only)."""
    return not torch.compiler.is_compiling() and all(
        t.device.type == "cpu" and not is_dtensor(t) for t in tensors
    )


def finite_on_cpu(tensors: Sequence[torch.Tensor]) -> bool:
    """Whether every value of these CPU tensors is finite, reading each once.

    A sum is finite when every value is (inf and NaN propagate); a non-finite sum of finite
    values (float32 overflow in the sum) is told apart by the exact per-tensor check. On one
    thread this is ~25% faster than torch's amp kernel, which also writes every gradient,
    and ~20x faster than ``torch._foreach_norm(..., inf)``, a per-tensor loop on CPU. Under
    ``torch.compile`` the branch would break the graph: the caller uses the kernels there.
    """
    with torch.no_grad():
        # Python floats: a 0-dim isfinite is several kernels, .item() on CPU is not.
        if math.isfinite(sum(t.sum(dtype=torch.float32).item() for t in tensors)):
            return True
        return all(bool(t.isfinite().all()) for t in tensors)


def all_finite(tensors: Iterable[torch.Tensor | None]) -> torch.Tensor:
    """A 0-dim bool tensor: True when every value of every tensor is finite (MindSpore's
    ``all_finite``). Sparse tensors are checked through their values; ``None`` is skipped.
    Does not synchronise; ``bool(...)`` on the result does."""
    dense = [t._values() if t.is_sparse else t for t in tensors if t is not None]
    floating = [t for t in dense if t.is_floating_point() and t.numel() > 0]
    if not floating:
        return torch.ones((), dtype=torch.bool)
    device = floating[0].device
    if checks_on_host(floating):
        return torch.tensor(finite_on_cpu(floating))
    with torch.no_grad():
        # The inf-norm is inf when any value is inf and NaN when any is NaN.
        norms = torch._foreach_norm(floating, float("inf"))
        return torch.stack([n.to(device, torch.float32) for n in norms]).isfinite().all()


class LossScaler:
    """The protocol every scaler follows: ``scale``, ``unscale_``, ``update``, ``get_scale``,
    ``state_dict``/``load_state_dict``. The state (scale and counters) is in ``state``."""

    def __init__(self, scale: float) -> None:
        self._state = ScalerState(scale=scale)

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
        raise TypeError(
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
        raise TypeError(
            f"unscale(value) needs a tensor or a list of tensors, got {type(value).__name__}"
        )

    #: What ``adjust`` returns: MindSpore's dynamic scaler says True, its static one False.
    _ADJUSTS = False

    def adjust(self, grads_finite: bool | torch.Tensor) -> bool:
        """MindSpore's ``adjust``: ``update`` with the flag inverted (True = all finite);
        returns True for a dynamic scaler and False otherwise, as MindSpore's do."""
        if isinstance(grads_finite, torch.Tensor):
            grads_finite = bool(grads_finite.item())
        self.update(not grads_finite)
        return self._ADJUSTS

    def unscale_(
        self, grads: Sequence[torch.Tensor | None], device: torch.device | str | None = None
    ) -> torch.Tensor:
        """Divide ``grads`` by the scale in place; return the 0-dim ``found_inf`` tensor
        (on ``device`` when ``grads`` is empty)."""
        return unscale_grads_(grads, 1.0 / self._state.scale, device)

    def update(self, found_inf: bool | torch.Tensor) -> None:
        """Advance the state after a step whose gradients were (not) finite."""
        if isinstance(found_inf, torch.Tensor):
            found_inf = bool(found_inf.item())
        self._state = self._next(self._state, bool(found_inf))

    def _next(self, state: ScalerState, found_inf: bool) -> ScalerState:
        return count_step(state, found_inf)

    def _config(self) -> dict[str, Any]:
        return {}

    def state_dict(self) -> dict[str, Any]:
        return {"type": type(self).__name__, **self._config(), **asdict(self._state)}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        kind = state_dict.get("type")
        if kind != type(self).__name__:
            raise ValueError(
                f"load_state_dict: state of a {kind!r} cannot load into {type(self).__name__}"
            )
        fields = ScalerState.__dataclass_fields__
        missing = [k for k in fields if k not in state_dict]
        if missing:
            raise ValueError(f"load_state_dict: scaler state lacks {', '.join(missing)}")
        state = _checked_state(state_dict)  # every value checked before anything changes
        self._load_config(state_dict, state.scale)
        self._state = state

    def _load_config(self, state_dict: dict[str, Any], scale: float) -> None:
        pass

    def __repr__(self) -> str:
        config = ", ".join(f"{k}={v!r}" for k, v in self._config().items())
        return f"{type(self).__name__}(scale={self.get_scale()!r}{', ' if config else ''}{config})"


class NoOpLossScaler(LossScaler):
    """Scale 1, for bfloat16 and float32. Non-finite gradients are still found and skipped."""

    def __init__(self) -> None:
        super().__init__(1.0)

    @property
    def needs_scaling(self) -> bool:
        return False


def _positive(name: str, value: float) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a number, got {type(value).__name__}: {value!r}")
    try:
        number = float(value)
    except OverflowError:  # an int beyond float's range (10**400)
        raise ArgumentError(
            f"{name}={shown(value)} is invalid; it is beyond float's range"
        ) from None
    if not (math.isfinite(number) and number > 0):
        raise ArgumentError(f"{name}={value!r} is invalid; it must be a finite number > 0")
    return number


def _scale_value(name: str, value: float) -> float:
    """A positive scale, rounded to float32 as a float32 tensor holding it would be."""
    rounded = to_float32(_positive(name, value))
    if math.isinf(rounded):
        raise ArgumentError(f"{name}={value!r} is beyond float32's range (max ~3.4e38)")
    return rounded


def _count(name: str, value: int, minimum: int = 1) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}: {value!r}")
    if value < minimum:
        raise ArgumentError(f"{name}={value!r} is invalid; it must be an int >= {minimum}")
    return value


def _checked_state(state_dict: dict[str, Any]) -> ScalerState:
    """The ``ScalerState`` in ``state_dict``, every value checked: a scale of NaN, inf, 0, a
    negative number, a string or one float32 cannot hold would make every later step skip,
    divide by zero or apply with a wrong sign."""
    where = "load_state_dict: scaler state"
    scale = state_dict["scale"]
    if isinstance(scale, bool) or not isinstance(scale, (int, float)):
        raise TypeError(f"{where} 'scale' must be a number, got {type(scale).__name__}: {scale!r}")
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
        counts[key] = _count(f"{where} {key!r}", state_dict[key], minimum)
    last = state_dict["last_overflow_step"]
    if last is not None:
        last = _count(f"{where} 'last_overflow_step'", last, 0)
    return ScalerState(scale=to_float32(value), last_overflow_step=last, **counts)


class StaticLossScaler(LossScaler):
    """A fixed scale (MindSpore ``StaticLossScaler(scale_value)``); overflowing steps skip."""

    def __init__(self, scale: float | None = None, *, scale_value: float | None = None) -> None:
        if (scale is None) == (scale_value is None):
            raise TypeError("StaticLossScaler needs exactly one of scale= or scale_value=")
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
                raise TypeError(
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


def _check_config(
    growth_factor: float,
    backoff_factor: float,
    growth_interval: int,
    hysteresis: int,
    min_scale: float | None,
    max_scale: float | None,
    arithmetic: Arithmetic = "torch",
    max_consecutive_skips: int | None = None,
) -> DynamicConfig:
    growth = _positive("growth_factor", growth_factor)
    if growth <= 1.0:
        raise ArgumentError(f"growth_factor={growth_factor!r} is invalid; it must be > 1.0")
    backoff = _positive("backoff_factor", backoff_factor)
    if not backoff < 1.0:
        raise ArgumentError(
            f"backoff_factor={backoff_factor!r} is invalid; it must be in the open interval (0, 1)"
        )
    low = None if min_scale is None else _positive("min_scale", min_scale)
    high = None if max_scale is None else _positive("max_scale", float(max_scale))
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
        growth_interval=_count("growth_interval", growth_interval),
        hysteresis=_count("hysteresis", hysteresis),
        min_scale=low,
        max_scale=high,
        arithmetic=arithmetic,
        max_consecutive_skips=(
            None
            if max_consecutive_skips is None
            else _count("max_consecutive_skips", max_consecutive_skips)
        ),
    )


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
    factor = _positive("scale_factor", scale_factor)
    if factor <= 1.0:
        raise ArgumentError(_FACTOR_ONE.format(scale_factor))
    if _positive("init_loss_scale", init_loss_scale) < 1.0:
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
