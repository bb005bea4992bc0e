"""``MixprecPrecision``: mixprec's mixed precision as a ``lightning.pytorch.Trainer`` plugin.

trainer = L.Trainer(plugins=[MixprecPrecision("mixed_float16", level="O2")])
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn

from mixprec._errors import ArgumentError, MisuseError
from mixprec.checkpoint import masters_of
from mixprec.integrations.lightning._lightning import GradClipAlgorithmType, Precision, pl
from mixprec.integrations.lightning.precision import Wrappers, _MixprecPlugin
from mixprec.integrations.lightning.schedulers import _held_on_skip, _HeldOnSkip
from mixprec.optim import LossScaleOptimizer


def _switched_off(lsos: list[LossScaleOptimizer]) -> list[torch.Tensor]:
    """The 16-bit weights whose float32 masters are all switched off
    (``LightningModule.toggle_optimizer`` sets ``requires_grad`` on the optimizers'
    parameters, which at O2 are the masters). A weight in two optimizers has a master in
    each and stays on while one is on."""
    on: dict[int, tuple[torch.Tensor, bool]] = {}
    for lso in lsos:
        for weight, master in lso.master_weights():
            was = on.get(id(weight), (weight, False))[1]
            on[id(weight)] = (weight, was or master.requires_grad)
    return [w for w, kept in on.values() if w.requires_grad and not kept]


@contextlib.contextmanager
def _off_during(weights: list[torch.Tensor]) -> Iterator[None]:
    """``weights`` take no gradient during the backward inside, as a toggled-off model's
    in float32 (a GAN's discriminator took the generator's gradients and applied them at
    its own step). A leaf's ``requires_grad`` is read when the backward reaches it, so
    turning it off after the forward is enough; it is turned back on after."""
    for weight in weights:
        weight.requires_grad_(False)
    try:
        yield
    finally:
        for weight in weights:
            weight.requires_grad_(True)


# The ignore: the mixin's `precision` and `main_params` are narrower than Lightning's.
class MixprecPrecision(_MixprecPlugin, Precision):  # type: ignore[misc]
    """mixprec's mixed precision in ``lightning.pytorch.Trainer``.

    ``L.Trainer(plugins=[MixprecPrecision("mixed_float16", level="O2")])``. ``policy`` and
    ``level`` as in ``auto_mixed_precision`` (``"auto"``: O2 for mixed policies);
    ``loss_scaler`` (default: dynamic for float16 compute, none otherwise) is shared by all
    optimizers; ``keep_float32`` lists module types, name patterns (relative to the
    LightningModule) or modules kept in float32; ``trace_overflow`` names the first module
    that overflowed when a step is skipped (a warning on the ``mixprec`` logger).

    The plugin logs nothing, as Lightning's own plugins: the ``LossScaleMonitor`` callback
    logs ``loss_scale`` and ``skipped_steps``; ``loss_scaler.state`` holds them at any time and
    ``last_step`` the latest ``StepResult``. LR schedulers with ``interval="step"`` do not
    advance after a skipped step.
    """

    def connect(
        self, model: nn.Module, optimizers: list[torch.optim.Optimizer], lr_schedulers: list[Any]
    ) -> tuple[nn.Module, list[torch.optim.Optimizer], list[Any]]:
        """Wrap each optimizer in a ``LossScaleOptimizer`` and each step-interval scheduler
        so that it holds after a skipped step. Lightning calls this at every ``setup``, with
        the optimizers it already has outside ``fit``: those stay as they are."""
        if any(self._owner_of(opt) is None for opt in optimizers):
            self._lsos, self._records = Wrappers(), {}  # a new fit: configure_optimizers again
        wrapped: list[torch.optim.Optimizer] = []
        for opt in optimizers:
            wrapped.append(self._owner_of(opt) or self._wrap(opt))
        for config in lr_schedulers:
            if getattr(config, "interval", None) != "step" or isinstance(
                config.scheduler, _HeldOnSkip
            ):
                continue
            lso = self._owner_of(getattr(config.scheduler, "optimizer", None))
            if lso is None and len(self._lsos) == 1:
                lso = self._lsos[0]
            if lso is not None:
                config.scheduler = _held_on_skip(config.scheduler, self._records[id(lso)])
        return model, wrapped, lr_schedulers

    def backward(  # type: ignore[override]
        self,
        tensor: torch.Tensor,
        model: pl.LightningModule,
        optimizer: Any,
        *args: Any,
        **kwargs: Any,
    ) -> None:
        """The scaled loss goes to ``LightningModule.backward`` (a user's override of it still
        runs). ``manual_backward`` names no optimizer: every wrapped one counts it."""
        if optimizer is None:
            lsos = list(self._lsos)
        else:
            owner = self._owner_of(optimizer)
            if owner is None:
                raise MisuseError(
                    f"{type(self).__name__}.backward: the optimizer {type(optimizer).__name__} "
                    "is not one this plugin wrapped in connect()"
                )
            lsos = [owner]
        with _off_during(self._toggled_off(model)):
            model.backward(self._scaled_loss(tensor, lsos), *args, **kwargs)

    def _toggled_off(self, model: pl.LightningModule) -> list[torch.Tensor]:
        """The weights a toggle switches off, found once per toggle: Lightning records each
        ``toggle_optimizer`` in a new dict, empty when nothing is toggled (the usual case,
        which costs nothing; absent in another Lightning: the masters are read each time)."""
        record = getattr(model, "_param_requires_grad_state", None)
        if record is not None and not record:
            return []
        if record is None or self._toggled is None or self._toggled[0] is not record:
            self._toggled = (record, _switched_off(list(self._lsos)))
        return self._toggled[1]

    def optimizer_step(  # type: ignore[override]
        self,
        optimizer: Any,
        model: pl.LightningModule,
        closure: Callable[[], Any],
        **kwargs: Any,
    ) -> Any:
        """Run the closure (forward, backward), unscale into the float32 masters, then
        ``on_before_optimizer_step`` and gradient clipping, then apply or skip.

        Returns the ``StepResult`` (manual optimization: ``opt.step()`` returns it), or the
        closure's ``None`` when ``training_step`` returned ``None`` (no step, as in
        Lightning's own plugins)."""
        lso = self._owner_of(optimizer)
        if lso is None:
            raise MisuseError(
                f"{type(self).__name__}.optimizer_step: {type(optimizer).__name__} is not an "
                "optimizer this plugin wrapped in connect()"
            )
        if kwargs:
            raise ArgumentError(
                f"{type(self).__name__}: optimizer.step() got {sorted(kwargs)}; a "
                "LossScaleOptimizer step takes no arguments"
            )
        closure_result = closure()
        skip = closure_result is None and model.automatic_optimization
        if not skip:
            self._unscale(lso)
        # Lightning's own hook (protected, used the same way by its MixedPrecision):
        # on_before_optimizer_step, then configure_gradient_clipping on the unscaled masters.
        # A skipped batch (training_step returned None) steps nothing: its clipping must not
        # unscale, or the next step would take the stale unscaled state for its own.
        self._skipping = skip
        try:
            self._after_closure(model, optimizer)
        finally:
            self._skipping = False
        if skip:
            # No step: its schedulers step as Lightning steps them, whatever the last one did.
            self._records[id(lso)].skipped = False
            return closure_result
        return self._apply(lso)

    def clip_gradients(
        self,
        optimizer: torch.optim.Optimizer,
        clip_val: float = 0.0,
        gradient_clip_algorithm: Any = GradClipAlgorithmType.NORM,
    ) -> None:
        """Clip the unscaled float32 masters. In manual optimization ``self.clip_gradients``
        comes before ``opt.step()``: the gradients are unscaled here first."""
        if getattr(self, "_skipping", False):
            return
        lso = self._owner_of(optimizer)
        if lso is not None and clip_val > 0:
            self._unscale(lso)
        super().clip_gradients(optimizer, clip_val, gradient_clip_algorithm)

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        """A full checkpoint's ``state_dict`` holds each 16-bit weight as its float32
        master, as mixprec's own checkpoints and ``MixprecTrainer`` write it: the 16-bit
        rounding alone is what ``load_from_checkpoint`` gave (up to 1e-3 off at O2). A
        resume loads the masters again from ``optimizer_states``."""
        super().on_save_checkpoint(checkpoint)
        state = checkpoint.get("state_dict")
        module = self._module() if self._module is not None else None
        if not isinstance(state, dict) or module is None:
            return
        # The masters' keys alone: the others hold what the strategy wrote (gathered shards).
        for key, master in masters_of(module, self._lsos).items():
            if key in state:
                state[key] = master.detach().clone()

    def state_dict(self) -> dict[str, Any]:
        """The scaler's state (scale, counters) with the policy and level. Masters and the
        inner optimizer's state are in Lightning's ``optimizer_states`` (the
        ``LossScaleOptimizer``'s ``state_dict``)."""
        return self._scaler_state() if self._scaler is not None else {}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._load_scaler_state(state_dict)
