"""Watching a loss scaler during training: ``ScalerHealth`` says, once, what a collapsing
scale, a run stuck at the scaler's floor or a run of skipped steps means. The Trainer uses it
each step; it reads only the scaler's state, so it sits beside the scalers, not in the
doctor."""

from __future__ import annotations

from collections import deque

from mixprec._errors import ArgumentError
from mixprec.scaling.scalers import DynamicLossScaler, LossScaler
from mixprec.scaling.schedule import ScalerState
from mixprec.trace import Overflow

__all__ = ["ScalerHealth", "scale_floor"]


def scale_floor(scaler: LossScaler) -> float | None:
    """The lowest scale ``scaler`` backs off to: a ``DynamicLossScaler``'s ``min_scale``
    (float32's smallest normal number without one); ``None`` for scalers that never move."""
    return scaler.config.floor if isinstance(scaler, DynamicLossScaler) else None


class ScalerHealth:
    """Watches ``ScalerState`` after each step and returns a diagnosis, once per kind.

    ``floor_skips``: this many skipped steps in a row with the scale at the scaler's floor
    (``observe(..., floor=scale_floor(scaler))``) mean the run is stuck: it overflows at
    every scale it can reach, and no update will ever be applied. That is said once, with
    the module where the inf/NaN starts when known. When it is not known, the first
    ``observe`` that finds the run stuck returns nothing and sets ``needs_trace``: the caller
    may trace the next step (``mixprec.trace.OverflowTracer``) and pass its culprit; the
    warning comes then, with the module or without it.

    Settling is not a streak: a scale that starts high (TensorFlow 1's 2**32, MindSpore's
    2**24) skips steps until it backs off into range. Skips before any step was applied
    that each lower the scale (or spend its hysteresis) while it stays above 2**16 (the
    usual start) and above the floor, with no forward overflow (which no scale causes)
    traced, count toward neither the streak nor the skip rate. Once a step was applied, at
    the floor, or without ``floor``, every skip counts."""

    def __init__(
        self,
        max_consecutive_skips: int = 10,
        window: int = 100,
        max_skip_rate: float = 0.2,
        floor_skips: int = 3,
    ) -> None:
        for name, value in (("max_consecutive_skips", max_consecutive_skips),
                            ("window", window), ("floor_skips", floor_skips)):  # fmt: skip
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ArgumentError(f"ScalerHealth({name}={value!r}) is invalid; use an int >= 1")
        number = not isinstance(max_skip_rate, bool) and isinstance(max_skip_rate, (int, float))
        if not number or not 0.0 <= max_skip_rate <= 1.0:
            raise ArgumentError(
                f"ScalerHealth(max_skip_rate={max_skip_rate!r}) is invalid; use a fraction "
                "in [0, 1]"
            )
        self.max_consecutive_skips = max_consecutive_skips
        self.window = window
        self.max_skip_rate = max_skip_rate
        self.floor_skips = floor_skips
        # Step numbers of the skipped steps among the last ``window``: O(1) per clean step.
        self._skips: deque[int] = deque()
        self._steps = 0
        self._at_floor = 0  # skipped steps in a row with the scale at its floor
        self._asked = False  # needs_trace was set once: the next stuck step warns regardless
        self.needs_trace = False
        self._first_loss: float | None = None
        self.warned: set[str] = set()
        self._applied = False  # a step was applied: settling is over, for good
        self._last: tuple[float, int] | None = None  # scale, hysteresis_left while settling
        self._settling = 0  # skips in the current run that were settling

    def observe(
        self,
        state: ScalerState,
        skipped: bool,
        culprit: str | Overflow | None = None,
        floor: float | None = None,
        loss: float | None = None,
        traced: bool = False,
    ) -> str | None:
        """``floor``: the scaler's lowest scale (``scale_floor``); ``loss``: this step's
        loss, for the stuck warning to show how it moved since the first step observed;
        ``traced``: the step was traced, so no ``culprit`` means the tracer found none."""
        # Settling skips stay out of the window; a flag check once a step was applied.
        if self._applied or not self._settles(state, skipped, culprit, floor):
            self._steps += 1
            if skipped:
                self._skips.append(self._steps)
        while self._skips and self._skips[0] <= self._steps - self.window:
            self._skips.popleft()
        if self._first_loss is None and loss is not None:
            self._first_loss = loss
        self.needs_trace = False
        stuck = skipped and floor is not None and state.scale <= floor
        self._at_floor = self._at_floor + 1 if stuck else 0
        where = f" The first non-finite values came from {culprit}." if culprit else ""
        if self._at_floor >= self.floor_skips and "floor" not in self.warned:
            if culprit is None and not self._asked and not traced:
                self._asked = self.needs_trace = True
                return None
            # Said once: the streak and skip-rate warnings would repeat it less precisely.
            self.warned |= {"floor", "streak", "rate"}
            losses = None if loss is None else (self._first_loss or loss, loss)
            return _stuck_message(state, self._at_floor, culprit, losses, traced)
        if state.scale < 1.0 and "scale" not in self.warned:
            self.warned.add("scale")
            return (
                f"loss scale fell to {state.scale:g} < 1: values overflow float16 even "
                f"without scaling (typical of models pretrained in bfloat16).{where} Use "
                "policy='mixed_bfloat16', or keep the layers named by mp.diagnose(...) in "
                "float32 (keep_float32=report.recommended_keep_float32)."
            )
        streak = state.consecutive_skips - self._settling
        if streak >= self.max_consecutive_skips and "streak" not in self.warned:
            self.warned.add("streak")
            return (
                f"{state.consecutive_skips} steps in a row were skipped for inf/NaN "
                f"gradients (scale now {state.scale:g}).{where} If the scale is already low, "
                "values overflow even unscaled (in the forward pass, or in a backward through "
                "a large gain): run mp.diagnose(model, x, y, loss_fn) to find the layers, "
                "then keep them in float32 or use bfloat16."
            )
        if (
            self._steps >= self.window
            and len(self._skips) / self.window > self.max_skip_rate
            and "rate" not in self.warned
        ):
            self.warned.add("rate")
            if floor is not None and state.scale <= floor:
                # At the floor the scale cannot be what overflows: some batches do at any
                # scale (every 4th skipped, whatever growth_factor and growth_interval).
                return (
                    f"{len(self._skips)} of the last {self.window} steps were skipped, with "
                    f"the loss scale at its floor ({state.scale:g}).{where} These are not "
                    "probes of the range: some batches overflow float16 at any scale. Find "
                    "the layers with mp.diagnose(model, x, y, loss_fn) on such a batch and "
                    "keep them in float32, or use policy='mixed_bfloat16'."
                )
            return (
                f"{len(self._skips)} of the last {self.window} steps were skipped.{where} "
                "Occasional skips are how dynamic loss scaling probes the range; this many "
                "waste training: lower growth_factor or raise growth_interval, or find the "
                "layer with mp.diagnose."
            )
        return None

    def _settles(
        self,
        state: ScalerState,
        skipped: bool,
        culprit: str | Overflow | None,
        floor: float | None,
    ) -> bool:
        """Whether this step is a skip of the scale settling from a high start: nothing
        applied yet (here or, per the scaler's counters, before a resume), and the skip
        lowered the scale or spent hysteresis, still above the floor."""
        last, self._last = self._last, (state.scale, state.hysteresis_left)
        if not skipped or state.skipped_steps < state.steps:
            self._applied, self._settling = True, 0
            return False
        # No floor (a scale that never moves), or down to it or to torch's and mixprec's
        # start: nothing settles.
        if floor is None or state.scale <= max(floor, _USUAL_START):
            return False
        if isinstance(culprit, Overflow) and culprit.phase == "forward":
            return False  # the forward overflows whatever the scale
        if last is not None and state.scale >= last[0] and state.hysteresis_left >= last[1]:
            return False
        self._settling += 1
        return True


# float16's usual starting scale (torch's GradScaler, mixprec's DynamicLossScaler): skips
# that bring a higher start down to it settle; below it they count (10 in a row from 2**16
# leave 64, low enough to be said).
_USUAL_START = 2.0**16


def _stuck_message(
    state: ScalerState,
    steps: int,
    culprit: str | Overflow | None,
    losses: tuple[float, float] | None,
    traced: bool,
) -> str:
    keep = "keep the modules mp.diagnose names in float32"
    if isinstance(culprit, Overflow):
        named = f" The first non-finite values came from {culprit}."
        keep = f"keep {culprit.module!r} in float32 with the modules mp.diagnose names"
    elif culprit:
        named = f" The first non-finite values came from {culprit}."
        keep = "keep that module in float32 with the modules mp.diagnose names"
    elif traced:
        # The tracer watches module outputs, their gradients and the weights' own at the
        # step: all finite, so the values turned inf/NaN outside the modules.
        named = (
            " Tracing the step found no module whose output or gradient was inf/NaN: they "
            "turn non-finite outside the modules, in the loss or in the gradient of a "
            "parameter outside the model."
        )
    else:
        named = (
            " The module was not found (run with trace_overflow=True to name it, or "
            "mp.diagnose(model, x, y, loss_fn) on the float32 model)."
        )
    return (
        f"training is stuck: the loss scale is at its floor ({state.scale:g}) and the last "
        f"{steps} steps there were all skipped for inf/NaN gradients, so no update is being "
        f"applied.{named} Values overflow float16 at every scale the scaler can reach; in "
        "the backward too, where a float32 block's gain multiplies the gradient sent to the "
        "16-bit layers before it. Fix: policy='mixed_bfloat16' (float32's range), or "
        f"{keep} (keep_float32=report.recommended_keep_float32). If the loss was growing "
        "before the skips began, the run diverges in any precision: lower the learning rate"
        + ("." if losses is None else f" (loss {losses[0]:.4g} at the first step, now "
           f"{losses[1]:.4g}).")
    )  # fmt: skip
