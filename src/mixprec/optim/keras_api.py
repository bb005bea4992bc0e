"""Keras' custom-training-loop methods of ``LossScaleOptimizer``: ``get_scaled_loss``,
``get_unscaled_gradients``, ``apply_gradients`` (and Keras 3's ``scale_loss``), and Keras 3's
constructor keywords ``initial_scale=`` and ``dynamic_growth_steps=``.

The Keras loop computes the gradients itself (``torch.autograd.grad`` on the scaled loss),
unscales them, and hands them back with their variables::

    scaled = opt.get_scaled_loss(loss)
    grads = opt.get_unscaled_gradients(torch.autograd.grad(scaled, params))
    opt.apply_gradients(zip(grads, params))
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

import torch

from mixprec._dtypes import HALF_DTYPES
from mixprec._errors import ArgumentError, MisuseError
from mixprec._warn import warn_at_caller
from mixprec.optim.checks import SetupCheck, after_step, looks_after_step
from mixprec.optim.masters import MasterWeights
from mixprec.optim.sharing import check_partners, check_unscale
from mixprec.optim.step_result import StepResult
from mixprec.scaling import DynamicLossScaler, LossScaler, unscale_grads_
from mixprec.scaling.health import ScalerHealth

if TYPE_CHECKING:
    from mixprec.optim.loss_scale_optimizer import _Bookkeeping
    from mixprec.trace import OverflowTracer

__all__ = ["KerasMethods"]


class KerasMethods:
    """The Keras methods, on the state ``LossScaleOptimizer`` sets up."""

    accumulation_steps: int
    _book: _Bookkeeping
    _loss_scaler: LossScaler
    _weights: MasterWeights
    _device: torch.device | None
    _setup: SetupCheck
    health: ScalerHealth | None
    optimizers: list[torch.optim.Optimizer]
    _tracer: OverflowTracer | None

    if TYPE_CHECKING:

        def _finish(self) -> StepResult: ...

        def _adopt_added_groups(self) -> None: ...

        def _drop_unscaled(self) -> None: ...

        def _after_raise(self) -> None: ...

    def get_scaled_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """``loss * scale / accumulation_steps`` (Keras ``get_scaled_loss``; the division
        only matters with accumulation, where it makes the summed gradients a mean, as
        ``backward`` does)."""
        if self._setup.due(self._weights):  # prepared (or cast) after the build?
            self._setup.run(self._weights, self._loss_scaler)
        if self._book.found_inf is not None:
            # The masters hold the unscaled gradients and the plain parameters' are unscaled
            # in place: this backward's would be left out (masters) or added still scaled.
            raise MisuseError(
                "a backward after unscale_() and before step(): its gradients would be left "
                "out of the float32 masters or applied still multiplied by the loss scale. "
                "Unscale once per step, after its last backward; or zero_grad() to drop the "
                "unscaled gradients first"
            )
        self._book.micro += 1
        self._book.backwards += 1
        self._book.fresh, self._book.raised = True, ""
        self._book.scaled_loss = True
        scale = self._loss_scaler.get_scale()
        self._book.share.note_scale(scale)  # a scaler shared with another wrapper
        if not self._book.look.hooks_looked:  # the first: hooks that will see it scaled
            self._book.look.first_scaled_loss(self._weights.model_params(), scale, loss)
        factor = scale / self.accumulation_steps
        return loss * factor if factor != 1.0 else loss

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """``loss * scale`` (Keras 3's ``scale_loss``): a pure read that starts no
        micro-batch, for logging or for ``torch.autograd.grad`` followed by
        ``apply_gradients(zip(get_unscaled_gradients(grads), params))``. To train,
        use ``backward(loss)``, which also counts the micro-batch."""
        scale = self._loss_scaler.get_scale()
        self._book.scaled_loss = True
        self._book.share.note_scale(scale)
        return loss * scale if scale != 1.0 else loss

    def get_unscaled_gradients(
        self, grads: Iterable[torch.Tensor | None]
    ) -> list[torch.Tensor | None]:
        """New gradients divided by the scale; ``None`` stays ``None`` (Keras semantics).

        16-bit gradients come back in float32 (the dtype of their masters): unscaled in
        float16, small values would flush to zero."""
        book = self._book
        check_unscale(book, self._loss_scaler)  # a shared scale moved since the scaling?
        scale = self._loss_scaler.get_scale()
        book.unscaled_grads = True
        if scale != 1.0 and not book.scaled_loss and not book.said_unscaled:
            book.said_unscaled = True
            warn_at_caller(
                f"get_unscaled_gradients() divides the gradients by the loss scale ({scale:g}), "
                "but no loss was multiplied by it through this optimizer since the last "
                f"apply_gradients(): gradients of the plain loss come out {scale:g} times too "
                "small. Take them of opt.get_scaled_loss(loss) (or opt.scale_loss(loss), which "
                "the scaler's own scale(loss) is too, unseen here)"
            )
        inv = 1.0 / scale
        return [
            None if g is None else (g.float() if g.dtype in HALF_DTYPES else g) * inv for g in grads
        ]

    def apply_gradients(
        self, grads_and_vars: Iterable[tuple[torch.Tensor | None, torch.Tensor]]
    ) -> StepResult:
        """Apply already unscaled gradients (Keras ``apply_gradients``): check them, clip,
        apply or skip, update the scale. Every call applies: with ``accumulation_steps``
        above 1 it is refused (``get_scaled_loss`` divides by it, so each call would apply
        a fraction of the gradient)."""
        if self.accumulation_steps > 1:
            raise MisuseError(
                f"apply_gradients applies the gradients it is given at every call, and "
                f"accumulation_steps={self.accumulation_steps} is for backward() and step() "
                "(get_scaled_loss divides the loss by it, so each call would apply "
                f"1/{self.accumulation_steps} of its gradient; with scale_loss, each call "
                "would apply one micro-batch's as a whole step): accumulate the gradients "
                "yourself and apply their mean with accumulation_steps=1, or use "
                "opt.backward(loss) and opt.step()"
            )
        if self._setup.due(self._weights):
            self._setup.run(self._weights, self._loss_scaler)
        pairs = list(grads_and_vars)
        check_partners(self._book, self._loss_scaler)
        _say_if_still_scaled(self._book, self._loss_scaler.get_scale())
        self._adopt_added_groups()
        weights = self._weights
        weights.follow_external_writes(stepping=True)
        for p in weights.half + weights.plain:
            p.grad = None
        for m in weights.masters:
            m.grad = None
        for k, (grad, var) in enumerate(pairs):
            slot = weights.index.get(id(var))
            if slot is None:
                raise ArgumentError(
                    f"apply_gradients: variable {k} (shape {tuple(var.shape)}, {var.dtype}) is "
                    "not a parameter of this optimizer"
                )
            if grad is None:
                continue
            if grad.shape != var.shape:
                raise ArgumentError(
                    f"apply_gradients: gradient {k} has shape {tuple(grad.shape)}, its variable "
                    f"{tuple(var.shape)}"
                )
            has_master, pos = slot
            target = weights.masters[pos] if has_master else var
            # A copy even in the same dtype: clipping then works on it, not on the caller's.
            target.grad = grad.detach().to(target.dtype, copy=True)
        self._book.micro = self.accumulation_steps
        self._book.fresh = self._book.scaled_loss = False
        grads = weights.step_grads()
        self._book.no_grads = not grads
        self._book.found_inf = unscale_grads_(grads, 1.0, self._device)
        try:
            result = self._finish()
        except BaseException:
            self._after_raise()  # as step(): else the next backward would be refused
            raise
        after_step(self.health, result, self._loss_scaler, weights, self._tracer is not None)
        looks_after_step(self._book, self.optimizers, result)
        return result


def _say_if_still_scaled(book: _Bookkeeping, scale: float) -> None:
    """``apply_gradients`` after a loss was scaled through this optimizer and before any
    ``get_unscaled_gradients``: the Keras 3 habit (its ``apply`` unscales) applied the
    gradients of the scaled loss as they were, 65536 times too large (every weight moved
    by 489 where float32 moved by 0.0075), unsaid. Said once; gradients of the plain loss
    beside a scaled one for logging are the one case it is wrong about."""
    if scale != 1.0 and book.scaled_loss and not book.unscaled_grads and not book.said_scaled_apply:
        book.said_scaled_apply = True
        warn_at_caller(
            f"apply_gradients() got gradients while a loss was multiplied by the loss scale "
            f"({scale:g}) through this optimizer and get_unscaled_gradients() was not called "
            f"since: the scaled loss's gradients are applied {scale:g} times too large. "
            "Unscale them first: opt.apply_gradients(zip(opt.get_unscaled_gradients(grads), "
            "params)) (if they are the plain loss's, scaled only to log it, this is not so)"
        )
    book.unscaled_grads = False


def keras_scaler(
    loss_scaler: LossScaler | None, initial_scale: float | None, growth_steps: int | None
) -> DynamicLossScaler:
    """Keras 3's dynamic schedule, reached through its keyword names."""
    if loss_scaler is not None:
        raise ArgumentError(
            "LossScaleOptimizer takes loss_scaler= or Keras' initial_scale=/"
            "dynamic_growth_steps=, not both"
        )
    try:
        return DynamicLossScaler(
            init_scale=2.0**15 if initial_scale is None else initial_scale,
            growth_interval=2000 if growth_steps is None else growth_steps,
            min_scale=None,  # Keras 3 has no floor; float32's smallest normal is ours
            max_scale=None,
        )
    except (ArgumentError, TypeError) as err:  # name the arguments the user wrote
        text = str(err).replace("init_scale", "initial_scale")
        raise type(err)(text.replace("growth_interval", "dynamic_growth_steps")) from None
