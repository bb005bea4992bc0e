"""``GradScaler``: a drop-in replacement for ``torch.amp.GradScaler``.

Same constructor arguments, public methods, state-dict keys, error messages and arithmetic
(the scale is float32 and follows the same growth/backoff rule), so a script that swaps
``torch.amp.GradScaler`` for ``mixprec.GradScaler`` trains identically. It runs on mixprec's
scaling core and adds ``hysteresis``, ``min_scale``/``max_scale``, the health counters in
``state``, and agreement on skipping across ``torch.distributed`` ranks.

One difference by design: torch lets the scale sink into float32's subnormals and on to zero
after ~150 consecutive overflows; here it stops at ``min_scale`` (by default the smallest
normal float32, 2**-126), so it never becomes zero.
"""

from __future__ import annotations

import enum
import inspect
import math
import warnings
from collections import abc
from dataclasses import asdict, dataclass
from typing import Any

import torch

from mixprec._dist import agree_found_inf
from mixprec._errors import ArgumentError, MisuseError, is_number
from mixprec.scaling import (
    SMALLEST_NORMAL_F32,
    DynamicLossScaler,
    ScalerState,
    to_float32,
    unscale_grads_,
)
from mixprec.scaling.health import ScalerHealth, scale_floor

__all__ = ["GradScaler"]


class _Stage(enum.Enum):
    READY = 0
    UNSCALED = 1
    STEPPED = 2


@dataclass
class _PerOptimizer:
    stage: _Stage = _Stage.READY
    found_inf: torch.Tensor | None = None
    host_found_inf: bool | None = None


class _Accessors:
    """``torch.amp.GradScaler``'s getters and setters, read from and written to the
    ``DynamicLossScaler`` behind a ``GradScaler``, so that code tuning torch's scaler works
    unchanged."""

    _scaler: DynamicLossScaler
    _enabled: bool

    def get_scale(self) -> float:
        return self._scaler.get_scale() if self._enabled else 1.0

    def get_growth_factor(self) -> float:
        return self._scaler.config.growth_factor

    def set_growth_factor(self, new_factor: float) -> None:
        self._reconfigure(growth_factor=new_factor)

    def get_backoff_factor(self) -> float:
        return self._scaler.config.backoff_factor

    def set_backoff_factor(self, new_factor: float) -> None:
        self._reconfigure(backoff_factor=new_factor)

    def get_growth_interval(self) -> int:
        return self._scaler.config.growth_interval

    def set_growth_interval(self, new_interval: int) -> None:
        self._reconfigure(growth_interval=new_interval)

    def _reconfigure(self, **changes: Any) -> None:
        self._scaler.load_state_dict({**self._scaler.state_dict(), **changes})

    def _get_growth_tracker(self) -> int:
        return self._scaler.state.growth_tracker if self._enabled else 0

    def is_enabled(self) -> bool:
        return self._enabled


def _check_device_and_enabled(device: object, enabled: object) -> None:
    """``device`` a device torch knows, by name or ``torch.device`` ("gpu" and 5 were taken,
    and failed at the first ``scale``), and ``enabled`` not a string or None ("no" was
    read as True); torch's other truthy values (1, numpy's bool) stay."""
    try:
        known = isinstance(device, torch.device) or (
            isinstance(device, str) and torch.device(device).type == device.split(":")[0]
        )
    except RuntimeError:
        known = False
    if not known:
        raise ArgumentError(
            f"GradScaler(device={device!r}) is invalid; valid: a device type such as 'cuda' "
            "or 'cpu'"
        )
    if isinstance(enabled, (str, type(None))):
        raise ArgumentError(f"GradScaler(enabled={enabled!r}) is invalid; valid: True or False")


def _new_scale(new_scale: float | torch.Tensor, device: str) -> float:
    """``update(new_scale)``'s value, as torch checks a tensor's, and a finite number > 0
    (``set_scale``'s error named "scale=", which ``update`` does not take)."""
    if isinstance(new_scale, torch.Tensor):
        reason = (
            "new_scale should be a float or a 1-element torch.cuda.FloatTensor or "
            "torch.FloatTensor with requires_grad=False."
        )
        if new_scale.device.type != device or new_scale.numel() != 1:
            raise ArgumentError(reason + f" Got {new_scale!r}.")
        if new_scale.requires_grad:
            raise ArgumentError(reason)
        new_scale = float(new_scale.item())
    if not (is_number(new_scale) and 0 < new_scale < math.inf):
        raise ArgumentError(
            f"update(new_scale={new_scale!r}) is invalid; it must be a finite number > 0"
        )
    return float(new_scale)


class GradScaler(_Accessors):
    """Loss scaling for ``torch.autocast`` loops: ``scaler.scale(loss).backward()``,
    ``scaler.step(optimizer)``, ``scaler.update()``.

    Extra keyword arguments over torch's: ``hysteresis`` (overflows tolerated before backing
    off, default 1 as in torch), ``min_scale`` (default 2**-126) and ``max_scale`` (default
    none but float32's range, as in torch).
    """

    def __init__(
        self,
        device: str | torch.device = "cuda",
        init_scale: float = 2.0**16,
        growth_factor: float = 2.0,
        backoff_factor: float = 0.5,
        growth_interval: int = 2000,
        enabled: bool = True,
        *,
        hysteresis: int = 1,
        min_scale: float | None = SMALLEST_NORMAL_F32,
        max_scale: float | None = None,
    ) -> None:
        _check_device_and_enabled(device, enabled)
        self._device, self._enabled = str(device), enabled  # a torch.device by its name
        if self._device == "cuda" and enabled and not torch.cuda.is_available():
            warnings.warn(  # torch's behaviour and words, plus what they leave out
                "mixprec.GradScaler is enabled, but CUDA is not available.  Disabling. Losses "
                "are not scaled, so small float16 gradients may underflow to zero; to scale on "
                'the CPU, pass GradScaler("cpu") (device="cpu"), as with torch.amp.GradScaler',
                stacklevel=2,
            )
            self._enabled = False
        if self._enabled:
            self._scaler = DynamicLossScaler(
                init_scale=init_scale,
                growth_factor=growth_factor,
                backoff_factor=backoff_factor,
                growth_interval=growth_interval,
                hysteresis=hysteresis,
                min_scale=min_scale,
                max_scale=max_scale,
            )
            # Like torch, scale() must run before unscale_/step/update in each process.
            self._scale_device: torch.device | None = None
            self._per_optimizer: dict[int, _PerOptimizer] = {}
            # As LossScaleOptimizer's (None: off). At its 2**-126 floor the scale makes
            # float16 gradients 0: 200 NaN batches then left ~200k clean steps applied as
            # zero updates, unsaid (torch's scale reaches 0 and writes NaN into the weights).
            self.health: ScalerHealth | None = ScalerHealth()

    # -- state ------------------------------------------------------------------------------

    @property
    def loss_scaler(self) -> DynamicLossScaler:
        """The scaling core (schedule and counters)."""
        self._require_enabled("loss_scaler")
        return self._scaler

    @property
    def state(self) -> ScalerState:
        """Scale and health counters: steps, skipped steps, consecutive skips, last overflow."""
        return self.loss_scaler.state

    def _require_enabled(self, what: str) -> None:
        if not self._enabled:
            raise MisuseError(f"GradScaler.{what} is not available: this GradScaler is disabled")

    def _check_started(self, funcname: str) -> torch.device:
        if self._scale_device is None:
            raise MisuseError(
                f"Attempted {funcname} but _scale is None.  This may indicate your script did "
                "not use scaler.scale(loss or outputs) earlier in the iteration."
            )
        return self._scale_device

    def _opt(self, optimizer: torch.optim.Optimizer) -> _PerOptimizer:
        if getattr(optimizer, "SCALES_ITS_OWN_LOSS", False):
            # Its step saw no backward of its own (or, at O2, the masters no gradient):
            # the message was about that, not about the two scalers.
            raise MisuseError(
                f"GradScaler given a {type(optimizer).__name__}, which scales the loss "
                "itself: two scalers would multiply the loss twice, and its step sees no "
                "backward of its own. Drop the GradScaler: opt.backward(loss); opt.step()"
            )
        return self._per_optimizer.setdefault(id(optimizer), _PerOptimizer())

    # -- the loop ---------------------------------------------------------------------------

    def scale(self, outputs: Any) -> Any:
        """Multiply a tensor, or each tensor of an iterable, by the scale."""
        if not self._enabled:
            return outputs
        scale = self._scaler.get_scale()

        def apply(value: Any) -> Any:
            if isinstance(value, torch.Tensor):
                if self._scale_device is None:
                    self._scale_device = value.device
                return value * scale
            if isinstance(value, abc.Iterable):
                scaled = map(apply, value)
                return type(value)(scaled) if isinstance(value, (list, tuple)) else scaled
            raise ArgumentError("outputs must be a Tensor or an iterable of Tensors")

        return apply(outputs)

    def _grads(self, optimizer: torch.optim.Optimizer, allow_fp16: bool) -> list[torch.Tensor]:
        grads = []
        for group in optimizer.param_groups:
            for param in group["params"]:
                if param.grad is None:
                    continue
                if not allow_fp16 and param.grad.dtype == torch.float16:
                    raise ValueError("Attempting to unscale FP16 gradients.")
                if param.grad.is_sparse and param.grad.dtype is torch.float16:
                    # Duplicate indices of scaled float16 values can overflow when summed.
                    param.grad = param.grad.coalesce()
                grads.append(param.grad)
        return grads

    def unscale_(self, optimizer: torch.optim.Optimizer) -> None:
        """Divide the optimizer's gradients by the scale (once per step, before ``step``)."""
        if not self._enabled:
            return
        self._check_started("unscale_")
        state = self._opt(optimizer)
        if state.stage is _Stage.UNSCALED:
            raise RuntimeError(
                "unscale_() has already been called on this optimizer since the last update()."
            )
        if state.stage is _Stage.STEPPED:
            raise RuntimeError("unscale_() is being called after step().")
        grads = self._grads(optimizer, allow_fp16=False)
        inv = 1.0 / self._scaler.get_scale()
        # As in torch, an optimizer without gradients records no inf check (step then raises).
        state.found_inf = unscale_grads_(grads, inv) if grads else None
        state.stage = _Stage.UNSCALED

    def step(self, optimizer: torch.optim.Optimizer, *args: Any, **kwargs: Any) -> Any:
        """Unscale (unless done), then ``optimizer.step()`` unless gradients are inf/NaN."""
        if not self._enabled:
            return optimizer.step(*args, **kwargs)
        if "closure" in kwargs:
            raise RuntimeError("Closure use is not currently supported if GradScaler is enabled.")
        device = self._check_started("step")
        state = self._opt(optimizer)
        if state.stage is _Stage.STEPPED:
            raise RuntimeError(
                "step() has already been called since the last update() (a step() that "
                "raised counts too: call update() before the next step())."
            )

        if getattr(optimizer, "_step_supports_amp_scaling", False):
            passes_itself = "grad_scaler" in inspect.signature(optimizer.step).parameters
            if passes_itself:
                # torch's older contract, which torch still honours with a FutureWarning: the
                # optimizer gets the scaler itself and unscales and skips on its own. Warned
                # here, so that it points at the caller's line, not at the eager wrapper.
                warnings.warn(
                    "GradScaler is going to stop passing itself as a keyword argument to the "
                    "passed optimizer (as torch.amp.GradScaler): read optimizer.grad_scale and "
                    "optimizer.found_inf instead",
                    FutureWarning,
                    stacklevel=2,
                )
            return self._fused_step(optimizer, state, device, passes_itself, *args, **kwargs)

        if state.stage is _Stage.READY:
            self.unscale_(optimizer)
        if state.found_inf is None:
            raise MisuseError("No inf checks were recorded for this optimizer.")
        # The one host synchronisation of the step.
        state.host_found_inf = bool(agree_found_inf(state.found_inf).item())
        try:
            return None if state.host_found_inf else optimizer.step(*args, **kwargs)
        finally:
            # Also when the step raises (Ctrl-C, a hook): left UNSCALED, the next step
            # skipped its unscale and applied its gradients still scaled (a weight went
            # from -0.004 to -327.7, unsaid); now it raises until update().
            state.stage = _Stage.STEPPED

    # Eager under torch.compile, as torch.amp.GradScaler.step is (dynamo skips torch's own
    # code): traced, dynamo dropped the grad_scale/found_inf attributes set on the optimizer
    # (torch 2.13) and the step failed. torch.compiler.disable would import dynamo here, ~2 s
    # of every `import mixprec`; torch's lazy form imports it at the first call.
    @torch._disable_dynamo  # type: ignore[attr-defined]
    def _fused_step(
        self,
        optimizer: torch.optim.Optimizer,
        state: _PerOptimizer,
        device: torch.device,
        passes_itself: bool,
        *args: Any,
        **kwargs: Any,
    ) -> Any:
        """Optimizers with ``_step_supports_amp_scaling`` (fused Adam/SGD) unscale and skip
        inside their kernel: hand them the scale and found_inf, as torch does (or, with
        ``passes_itself``, the scaler, in torch's older contract)."""
        if state.stage is _Stage.READY:
            # Checked here in both contracts, so that update() has this step's flag.
            state.found_inf = unscale_grads_(self._grads(optimizer, allow_fp16=True), 1.0)
        if passes_itself:
            try:
                return optimizer.step(*args, **{**kwargs, "grad_scaler": self})
            finally:
                state.stage = _Stage.STEPPED
        found_inf = agree_found_inf(state.found_inf.to(device))  # type: ignore[union-attr]
        scale = torch.full((), self._scaler.get_scale(), dtype=torch.float32, device=device)
        optimizer.grad_scale = (  # type: ignore[attr-defined]
            getattr(optimizer, "grad_scale", None)
            if state.stage is _Stage.UNSCALED
            else scale * getattr(optimizer, "grad_scale", 1)
        )
        optimizer.found_inf = found_inf  # type: ignore[attr-defined]
        try:
            return optimizer.step(*args, **kwargs)
        finally:
            state.stage = _Stage.STEPPED
            del optimizer.grad_scale  # type: ignore[attr-defined]
            del optimizer.found_inf  # type: ignore[attr-defined]

    def update(self, new_scale: float | torch.Tensor | None = None) -> None:
        """Advance the scale after ``step`` for every optimizer, or set it to ``new_scale``."""
        if not self._enabled:
            return
        self._check_started("update")
        if new_scale is not None:
            self._set_scale(new_scale)
        else:
            flags = [s for s in self._per_optimizer.values() if s.found_inf is not None]
            if not flags:
                raise MisuseError("No inf checks were recorded prior to update.")
            found = any(
                s.host_found_inf if s.host_found_inf is not None else bool(s.found_inf.item())  # type: ignore[union-attr]
                for s in flags
            )
            self._scaler.update(found)
            if self.health is not None:
                state, floor = self._scaler.state, scale_floor(self._scaler)
                message = self.health.observe(state, found, floor=floor)
                if message:
                    warnings.warn(message, UserWarning, stacklevel=2)
        self._per_optimizer = {}

    def _set_scale(self, new_scale: float | torch.Tensor) -> None:
        # torch fills a float32 tensor: round the same way.
        self._scaler.set_scale(to_float32(_new_scale(new_scale, self._device)))

    def state_dict(self) -> dict[str, Any]:
        """torch's five keys, plus mixprec's schedule bounds and counters."""
        if not self._enabled:
            return {}
        state = self._scaler.state
        config = self._scaler.config
        return {
            "scale": state.scale,
            "growth_factor": config.growth_factor,
            "backoff_factor": config.backoff_factor,
            "growth_interval": config.growth_interval,
            "_growth_tracker": state.growth_tracker,
            "hysteresis": config.hysteresis,
            "min_scale": config.min_scale,
            "max_scale": config.max_scale,
            **{k: v for k, v in asdict(state).items() if k not in ("scale", "growth_tracker")},
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a state from ``state_dict()`` of this class or of ``torch.amp.GradScaler``."""
        if not self._enabled:
            return
        if len(state_dict) == 0:
            raise RuntimeError(
                "The source state dict is empty, possibly because it was saved "
                "from a disabled instance of GradScaler."
            )
        torch_keys = ("scale", "growth_factor", "backoff_factor", "growth_interval")
        missing = [k for k in (*torch_keys, "_growth_tracker") if k not in state_dict]
        if missing:
            raise ArgumentError(f"load_state_dict: GradScaler state lacks {', '.join(missing)}")
        current = self._scaler.state_dict()
        # The values go to the scaler as they are: its load_state_dict checks each by name.
        merged = {
            **current,
            **{k: v for k, v in state_dict.items() if k in current},
            **{k: state_dict[k] for k in torch_keys},
            "growth_tracker": state_dict["_growth_tracker"],
        }
        self._scaler.load_state_dict(merged)

    def __getstate__(self) -> dict[str, Any]:
        if self._enabled and self._per_optimizer:
            raise MisuseError(
                "A GradScaler instance may only be pickled at the beginning "
                "of an iteration, or at the end after scaler.update()."
            )
        return self.__dict__.copy()

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
