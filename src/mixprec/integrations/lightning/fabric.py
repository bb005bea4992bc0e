"""``MixprecFabricPrecision``: mixprec's mixed precision as a ``lightning.fabric.Fabric``
plugin."""

from __future__ import annotations

import sys
import weakref
from collections.abc import Iterator
from types import FrameType
from typing import Any

import torch
from torch import nn

from mixprec._errors import ArgumentError, MisuseError
from mixprec._input_casts import cast_inputs
from mixprec._rebuilt import Casts, write_back
from mixprec._save_guard import FABRIC_MODULES, guard_saves
from mixprec.casting import cast_floating
from mixprec.integrations.lightning._lightning import FabricPrecision
from mixprec.integrations.lightning.precision import _MixprecPlugin
from mixprec.optim import LossScaleOptimizer, StepResult
from mixprec.region import get_region
from mixprec.scaling import DynamicLossScaler

_FABRIC_WRAPPERS = ("lightning.fabric.wrappers", "lightning_fabric.wrappers")


class MixprecFabricPrecision(_MixprecPlugin, FabricPrecision):  # type: ignore[misc]
    """mixprec's mixed precision in ``lightning.fabric.Fabric``: the same options as
    ``MixprecPrecision``.

    Fabric shows a plugin the optimizer only when it steps, unscales or clips, so each
    optimizer is wrapped in a ``LossScaleOptimizer`` then (masters from the float32 values
    kept when the model was prepared), and ``fabric.backward`` scales the loss by the shared
    scaler. ``optimizer.step()`` returns the ``StepResult``: step a scheduler only when
    ``not result.skipped``. The 16-bit gradients are released after each step, and from the
    first step on ``optimizer.zero_grad()`` clears them too (the torch optimizer's own
    reaches only the float32 masters, now its groups' parameters).

    Inputs (``convert_input``): floating inputs of ``model(...)`` are cast where the prepared
    model casts its own, at O2 and O3, to its compute dtype, as Fabric's ``MixedPrecision``
    and ``HalfPrecision`` cast them. At O1 they pass as given: the weights are float32 and
    autocast picks each op's dtype, so ops it keeps in float32 (and modules in
    ``keep_float32``) see the inputs unrounded.

    Checkpoints: put the plugin in the state, ``fabric.save(path, {"model": model,
    "optimizer": optimizer, "mixprec": plugin})``; its state holds the scaler and every
    wrapped optimizer's masters, which the optimizer's own state does not. A
    ``fabric.save`` of the model without the plugin warns once, naming what it loses.
    """

    # A first forward's cast inputs to look at after it (convert_input, convert_output).
    _watched: tuple[Any, list[Any]] | None = None
    _written: Casts | None = None  # several models' rebuilt containers (convert_input)

    def _reset_run(self) -> None:
        super()._reset_run()
        self._last_loss: torch.Tensor | None = None  # see _fabric_lso
        #: States loaded before their optimizer was seen, with its parameters' names.
        self._pending: list[tuple[list[str] | None, dict[str, Any]]] = []
        self._models: list[weakref.ref[nn.Module]] = []  # every model fabric.setup prepared
        self._backwards = 0  # fabric.backward calls
        #: id(LossScaleOptimizer) -> (self._backwards at its last step, the Fabric wrapper
        #: that made that step): a second wrapper of one optimizer is a double setup.
        self._last_steps: dict[int, tuple[int, weakref.ref[Any] | None]] = {}

    def __getstate__(self) -> dict[str, Any]:
        state = super().__getstate__()
        for key in ("_last_loss", "_pending", "_models", "_backwards", "_last_steps"):
            state.pop(key, None)
        return state

    def convert_module(self, module: nn.Module) -> nn.Module:
        module = super().convert_module(module)
        if not any(ref() is module for ref in self._models):
            self._models.append(weakref.ref(module))
        # fabric.save(path, {"model": model, ...}) without the plugin loses the masters and
        # the scale: the model's state_dict hook says so (once) when it does.
        guard_saves(module, holder=self)
        return module

    def _unsaved_state(self) -> str:
        """What a ``fabric.save`` without this plugin loses ("" for nothing): the masters
        once an optimizer was wrapped (or loaded, waiting for it), and a dynamic scale."""
        if not self._lsos and not self._pending:
            return ""
        lost = []
        if self._pending or any(lso.master_weights() for lso in self._lsos):
            lost.append("the float32 master weights")
        if isinstance(self._scaler, DynamicLossScaler):
            lost.append("the loss scale")
        return " and ".join(lost)

    def _input_dtype(self) -> torch.dtype | None:
        """The dtype the prepared models cast their floating inputs to, read from their
        regions (a model kept in float32 with ``keep_float32`` or ``to_float`` has a float32
        one); ``None`` at O1 (autocast casts per op) or where the models disagree (each then
        casts its own inputs)."""
        if not self._step_context:
            return None
        dtypes: set[torch.dtype | None] = set()
        for model in (ref() for ref in self._models):
            if model is None:
                continue
            region = get_region(model)
            dtypes.add(region.compute_dtype if region is not None and region.cast_inputs else None)
        return dtypes.pop() if len(dtypes) == 1 else None

    def convert_input(self, data: Any) -> Any:
        """Floating tensors in ``data`` (the arguments of ``model(...)``) in the model's
        compute dtype where its region casts inputs (O2, O3), as Fabric's own plugins do;
        at O1 and O0 as they are. Integer and bool tensors are never cast. With one prepared
        model, the cast is its boundary's own: ``labels`` and ``keep_inputs`` pass as given,
        and its first forwards' look sees the float32 inputs (cast here, it saw none)."""
        dtype = self._input_dtype()
        if dtype is None:
            return data
        boundary = self._boundary()
        if boundary is not None and isinstance(data, tuple) and len(data) == 2:
            args, kwargs, watched = boundary.cast_at_boundary(tuple(data[0]), dict(data[1]))
            self._watched = (boundary, watched) if watched else None
            return args, kwargs
        if isinstance(data, tuple) and len(data) == 2:  # several models: no boundary's own,
            args, kwargs, casts = cast_inputs(tuple(data[0]), dict(data[1]), dtype, frozenset(), [])
            self._written = casts  # but what the model sets in rebuilt containers goes back
            return args, kwargs
        return cast_floating(data, dtype)

    def convert_output(self, data: Any) -> Any:
        """As the Lightning plugin's; after the first forwards, their look at writes into
        the cast inputs (``convert_input``)."""
        watched, self._watched = self._watched, None
        if watched is not None:
            watched[0].after_forward(watched[1])
        written, self._written = self._written, None
        if written is not None:
            write_back(written)
        return super().convert_output(data)

    def _boundary(self) -> Any:
        """The one prepared model's region forward that casts at its boundary, or ``None``
        (several models: each casts its own, and ``cast_floating`` serves them all)."""
        models = [m for m in (ref() for ref in self._models) if m is not None]
        forward = models[0].__dict__.get("forward") if len(models) == 1 else None
        region = getattr(forward, "region", None)  # a region's forward carries its region
        return forward if region is not None and region.keep_inputs is not None else None

    def _fabric_lso(self, optimizer: Any) -> LossScaleOptimizer:
        lso = self._owner_of(optimizer)
        if lso is not None:
            return lso
        lso = self._wrap(getattr(optimizer, "_optimizer", optimizer))
        if self._pending:
            lso.load_state_dict(self._take_pending(lso))
        # Backward passes made before Fabric showed us this optimizer (the first step) left
        # gradients scaled by the shared scale: count them as the step's micro-batch.
        waiting = any(p.grad is not None for p in lso.model_params())  # masters: new, none
        if waiting and self._last_loss is not None:
            lso.get_scaled_loss(self._last_loss)
        return lso

    def backward(
        self, tensor: torch.Tensor, model: nn.Module | None, *args: Any, **kwargs: Any
    ) -> None:
        self._last_loss = tensor.detach()
        self._backwards += 1
        self._scaled_loss(tensor, list(self._lsos)).backward(*args, **kwargs)

    def unscale_gradients(self, optimizer: torch.optim.Optimizer) -> None:
        """Unscale into the float32 masters (``fabric.clip_gradients`` calls this)."""
        lso = self._fabric_lso(optimizer)
        self._route_zero_grad(lso, self._refuse_double_setup(lso, stepping=False))
        self._unscale(lso)

    @staticmethod
    def _route_zero_grad(lso: LossScaleOptimizer, wrapper: Any) -> None:
        """Once wrapped, the torch optimizer's groups hold the float32 masters, so its own
        ``zero_grad`` (which Fabric's wrapper runs) cleared only theirs: the 16-bit weights'
        gradients of a backward that was not stepped added into the next step. The
        optimizer and Fabric's wrapper of it get the ``LossScaleOptimizer``'s, which clears
        both (an instance attribute comes before the class's method)."""
        for holder in (wrapper, *lso.optimizers):
            if holder is not None and "zero_grad" not in vars(holder):
                holder.zero_grad = lso.zero_grad

    def main_params(self, optimizer: torch.optim.Optimizer) -> Iterator[torch.Tensor]:  # type: ignore[override]
        return self._fabric_lso(optimizer).master_params()

    def optimizer_step(self, optimizer: Any, **kwargs: Any) -> StepResult:
        if kwargs:
            raise ArgumentError(
                f"{type(self).__name__}: optimizer.step() got {sorted(kwargs)}; a "
                "LossScaleOptimizer step takes no closure or other arguments"
            )
        lso = self._fabric_lso(optimizer)
        self._route_zero_grad(lso, self._refuse_double_setup(lso, stepping=True))
        self._unscale(lso)
        result = self._apply(lso)
        for half, _ in lso.master_weights():  # spent: the masters' gradients were applied
            half.grad = None
        return result

    def _refuse_double_setup(self, lso: LossScaleOptimizer, stepping: bool) -> Any:
        """One optimizer set up twice (``fabric.setup(model, opt, opt)``, or
        ``fabric.setup_optimizers(opt)`` after ``fabric.setup(model, opt)``) gives two Fabric
        wrappers of it; stepping (or clipping) the second after the first stepped, with no
        ``fabric.backward`` between, finds the gradients used. Said here, before the unscale
        would blame a missing backward. Returns the wrapper the user called (or None)."""
        wrapper = _calling_wrapper()
        at, ref = self._last_steps.get(id(lso), (-1, None))
        previous = ref() if ref is not None else None
        if at == self._backwards and wrapper is not None and previous not in (None, wrapper):
            raise MisuseError(
                f"{type(self).__name__}: the same {type(lso.optimizers[0]).__name__} was set "
                "up twice with Fabric, and its second wrapper stepped after the first with no "
                "fabric.backward(loss) between; set each optimizer up once (not "
                "fabric.setup(model, opt, opt), nor fabric.setup_optimizers(opt) after "
                "fabric.setup(model, opt)) and step the one Fabric returned"
            )
        if stepping:
            now = weakref.ref(wrapper) if wrapper is not None else None
            self._last_steps[id(lso)] = (self._backwards, now)
        return wrapper

    def _held_names(self, lso: LossScaleOptimizer) -> list[str]:
        """The names of the model parameters ``lso`` steps: what identifies its state in a
        checkpoint (the order optimizers first step in may differ after a resume)."""
        names: dict[int, str] = {}
        for model in (ref() for ref in self._models):
            if model is not None:
                names.update((id(p), n) for n, p in model.named_parameters())
        return sorted(names.get(id(p), "?") for p in lso.model_params())

    def _take_pending(self, lso: LossScaleOptimizer) -> dict[str, Any]:
        """The loaded state saved for ``lso``'s parameters (by order for a state saved
        without their names)."""
        mine = self._held_names(lso)
        for i, (names, _) in enumerate(self._pending):
            if names is None or names == mine:
                return self._pending.pop(i)[1]
        saved = "; ".join(", ".join(names[:3]) for names, _ in self._pending if names)
        raise MisuseError(
            f"{type(self).__name__}: the loaded checkpoint holds no optimizer state for the "
            f"optimizer over {', '.join(mine[:3])}{'...' * (len(mine) > 3)} (it holds states "
            f"for optimizers over: {saved}); set up the optimizers over the parameters they "
            "were saved with"
        )

    def state_dict(self) -> dict[str, Any]:
        if self._scaler is None:
            return {}
        pending = [state for _, state in self._pending]
        return {
            **self._scaler_state(),
            "optimizers": [lso.state_dict() for lso in self._lsos] + pending,
            # Which optimizer each state is: matched by its parameters' names when loaded.
            "optimizer_params": [self._held_names(lso) for lso in self._lsos]
            + [names for names, _ in self._pending],
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._load_scaler_state(state_dict)
        states = list(state_dict.get("optimizers", []))
        names = list(state_dict.get("optimizer_params", [None] * len(states)))
        self._pending = list(zip(names, states, strict=True))
        for lso in self._lsos:
            lso.load_state_dict(self._take_pending(lso))
        # The rest wait for Fabric to show us their optimizers: they load when it does.


def _calling_wrapper() -> Any:
    """The Fabric optimizer wrapper the user called: the one whose ``step()`` is running
    (it calls the strategy, which calls ``optimizer_step``), or the one given to
    ``fabric.clip_gradients`` (which calls ``unscale_gradients``); None if neither."""
    frame: FrameType | None = sys._getframe(2)
    for _ in range(6):
        if frame is None:
            return None
        name, module = frame.f_code.co_name, frame.f_globals.get("__name__")
        if name == "step" and module in _FABRIC_WRAPPERS:
            return frame.f_locals.get("self")
        if name == "clip_gradients" and module in FABRIC_MODULES:
            given = frame.f_locals.get("optimizer")
            return given if "_optimizer" in getattr(given, "__dict__", {}) else None
        frame = frame.f_back
    return None
