"""``LossScaleOptimizer``: master weights, loss scaling, skip on overflow, clipping,
gradient accumulation, around any ``torch.optim`` optimizer.

One step: copy the 16-bit gradients into the float32 master gradients, unscale them with one
multi-tensor kernel that also finds inf/NaN, clip, make the one host synchronisation of the
step, then either apply the inner optimizer and copy the masters back into the 16-bit weights
(one multi-tensor copy), or skip, leaving weights and optimizer state untouched.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from math import inf
from typing import Any

import torch
from torch import nn

from mixprec._dist import agree_found_inf, is_distributed, is_dtensor
from mixprec._errors import ArgumentError, MisuseError, is_number
from mixprec._plain_optimizers import watch_wrapped
from mixprec._save_guard import guard_saves
from mixprec.optim.arguments import checked_arguments, traced_model
from mixprec.optim.backward_look import BackwardLook, grad_versions
from mixprec.optim.checks import (
    SetupCheck,
    after_step,
    check_micro_batches,
    drop_unscaled_group,
    looks_after_step,
    no_backward_error,
    no_gradients,
    say_if_half_grads_changed,
    say_if_masters_lost,
    unscale_group_factor,
)
from mixprec.optim.deferred import COPIED, Deferred, device_tail, on_device
from mixprec.optim.direct import FusedStep
from mixprec.optim.fused import _fuse, _unfuse_sparse, needs_scaling, step_inner_fused_safely
from mixprec.optim.groups import ParamGroups, adopt_all
from mixprec.optim.host_step import host_step
from mixprec.optim.in_place import say_what_in_place_loses
from mixprec.optim.keras_api import KerasMethods, keras_scaler
from mixprec.optim.lr_watch import say_if_rates_moved
from mixprec.optim.masters import MasterWeights
from mixprec.optim.partial_group import apply_partial_group
from mixprec.optim.replicas import masters_of_rank0_if_replicas, state_of_rank
from mixprec.optim.sharing import Sharing, check_partners, note_partners
from mixprec.optim.stall import StallWatch
from mixprec.optim.state_dict import StateDictMethods
from mixprec.optim.state_view import InnerViews, StepHooks
from mixprec.optim.step_result import StepResult
from mixprec.recompute import with_pointer
from mixprec.scaling import (
    DynamicLossScaler,
    LossScaler,
    NoOpLossScaler,
    StaticLossScaler,
    all_finite,
)
from mixprec.scaling.health import ScalerHealth
from mixprec.trace import OverflowTracer, join_prepared_model, model_of

__all__ = ["LossScaleOptimizer"]

_log = logging.getLogger("mixprec")

# Scalers whose scale-1 unscale is the finiteness check alone (a subclass may do more).
_HOST_SCALERS = (NoOpLossScaler, StaticLossScaler, DynamicLossScaler)
#: The first explicit unscale_() calls whose 16-bit gradients step() checks for edits.
UNSCALE_CHECKS = 3


@dataclass
class _Bookkeeping:
    """What one step leaves for the next. On an object of its own: inside
    ``torch.compile(opt.step)`` dynamo drops attribute writes on the ``Optimizer`` itself
    (torch 2.13; a write before the first graph break is lost), not on other objects."""

    deferred: Deferred  # steps decided on the device, not yet read
    micro: int = 0  # backward passes since the last update
    backwards: int = 0  # backward passes since the last step() call (check_micro_batches)
    fresh: bool = False  # a backward happened since the last step()
    # The last step() raised, and no backward since (no_backward_error): "dropped" before
    # its update went in, "applied" after (finished as applied, state_dict._after_raise).
    raised: str = ""
    # Within a step (state_dict._after_raise): how many inner optimizers have stepped;
    # COPIED after the copy-back; ON_DEVICE once the fused kernel decided on the device.
    stepped: int = 0
    device_found: torch.Tensor | None = None  # that step's flag (ON_DEVICE)
    found_inf: torch.Tensor | None = None  # set by unscale_()
    # The 16-bit gradients' versions at an explicit unscale_(): changed by step(), they
    # were clipped (or edited) where step() does not read them.
    unscaled_versions: list[int] | None = None
    unscale_checks: int = 0  # explicit unscale_() calls checked so far (UNSCALE_CHECKS)
    look: BackwardLook = field(default_factory=BackwardLook)  # the first steps' gradients
    # register_step_post_hook's hooks, run after the copy-back of an applied step.
    # An OrderedDict: RemovableHandle holds a weak reference, which a dict does not take.
    post_hooks: OrderedDict[int, Callable[..., Any]] = field(default_factory=OrderedDict)
    # Whether the float16 weights were finite after the last applied update; see _finish.
    weights_finite: torch.Tensor = field(default_factory=lambda: torch.ones((), dtype=torch.bool))
    no_grads: bool = False  # set by unscale_(): no parameter had a gradient
    # What _host_step needs and construction decides: local CPU parameters, no float16
    # weight to check, a scaler whose unscale at scale 1 is the check alone.
    host_path: bool = False
    said_no_grads: bool = False  # the no-gradient step was warned about (once)
    said_unfilled: bool = False  # master_params() before unscale_() was warned about (once)
    # A loss multiplied by the scale (get_scaled_loss, scale_loss) since the last
    # apply_gradients: get_unscaled_gradients divides by it; without one, said once.
    scaled_loss: bool = False
    unscaled_grads: bool = False  # get_unscaled_gradients since the last apply_gradients
    said_scaled_apply: bool = False  # apply_gradients of still-scaled gradients (once)
    replicas_checked: bool = False  # see optim.replicas
    stepping_inner: bool = False  # an inner optimizer's step is this wrapper's (step_inner)
    said_unscaled: bool = False
    # The inner optimizers' steps as direct fused-kernel calls (host_step uses them).
    fused: list[FusedStep] = field(default_factory=list)
    # How many param groups of each inner optimizer were adopted (masters, fusing).
    groups: list[int] = field(default_factory=list)
    # Other live wrappers over the same weights or scaler (optim.sharing).
    share: Sharing = field(default_factory=Sharing)
    rates_at_skip: list[Any] | None = None  # learning rates after a skip (lr_watch)
    said_rates: bool = False
    whole_groups: bool = False  # the last step() came after a whole group's backwards
    rate_moved: tuple[int, Any, Any] | None = None  # a move after the last skip (lr_watch)
    stall: StallWatch = field(default_factory=lambda: StallWatch([]))  # O3's weights


def _params_of(inner: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [p for group in inner.param_groups for p in group["params"]]


class LossScaleOptimizer(  # type: ignore[override, misc]  # torch's attributes as views
    KerasMethods, StateDictMethods, ParamGroups, InnerViews, StepHooks, torch.optim.Optimizer
):
    """Wrap ``optimizer`` for mixed precision training.

    16-bit parameters (made by ``auto_mixed_precision`` at O2, say) get float32 master copies
    that the inner optimizer updates, so its state stays float32; O3 parameters are updated in
    place, as O3 asks. ``loss_scaler`` defaults to a ``DynamicLossScaler`` when the
    parameters' model computes in float16, else a ``NoOpLossScaler`` (non-finite steps are
    still skipped). ``max_grad_norm`` clips the unscaled gradients (dense ones). With
    ``accumulation_steps=N``, ``backward`` adds ``loss / N`` and only every N-th ``step``
    updates; ``zero_grad`` in between keeps the sum.

    ``optimizer`` may be a list, e.g. ``[SparseAdam(embeddings), Adam(dense)]`` from
    ``split_embedding_parameters``: one loss scale, one backward, one finiteness check, and
    all of them step or all skip. It is a ``torch.optim.Optimizer`` (schedulers accept it)
    whose ``param_groups`` are the inner optimizers'.

    Keras 3's keywords ``initial_scale=`` and ``dynamic_growth_steps=`` give Keras 3's
    schedule (start at ``2**15``, double after ``2000`` clean steps, halve on overflow, no
    ceiling, no floor above float32's smallest normal) in place of mixprec's default.

    ``keep_grad_buffers=True`` keeps the masters' float32 gradients across ``zero_grad``: 4
    bytes a parameter more at the peak, no fresh allocation (page faults) each step.

    Build it after ``auto_mixed_precision`` (the first backward raises ``MisuseError`` when
    the model was prepared later). ``health`` (a ``ScalerHealth``; ``None`` turns it off)
    warns once when steps keep being skipped.
    """

    #: Read by ``mp.GradScaler``, which refuses such an optimizer (it scales its own loss).
    SCALES_ITS_OWN_LOSS = True

    def __init__(
        self,
        optimizer: torch.optim.Optimizer | Sequence[torch.optim.Optimizer],
        loss_scaler: LossScaler | None = None,
        max_grad_norm: float | None = None,
        accumulation_steps: int = 1,
        trace_overflow: bool | nn.Module = False,
        *,
        initial_scale: float | None = None,
        dynamic_growth_steps: int | None = None,
        keep_grad_buffers: bool = False,
    ) -> None:
        # torch.optim.Optimizer.__init__ is not called: groups and state are the inner ones.
        if initial_scale is not None or dynamic_growth_steps is not None:
            loss_scaler = keras_scaler(loss_scaler, initial_scale, dynamic_growth_steps)
        self.optimizers: list[torch.optim.Optimizer] = checked_arguments(
            optimizer, loss_scaler, max_grad_norm, accumulation_steps, trace_overflow,
            keep_grad_buffers,
        )  # fmt: skip
        if any(isinstance(inner, LossScaleOptimizer) for inner in self.optimizers):
            raise ArgumentError("optimizer is already a LossScaleOptimizer; wrap the inner one")
        self.max_grad_norm = None if max_grad_norm is None else float(max_grad_norm)
        self.accumulation_steps = accumulation_steps
        self._weights = MasterWeights()
        self._weights.keep_grads = keep_grad_buffers
        given = [p for inner in self.optimizers for p in _params_of(inner)]
        traced = traced_model(trace_overflow, given)
        # Adapters added since preparation take the model's policy first: it decides masters.
        join_prepared_model(given)
        adopt_all(self._weights, self.optimizers)
        say_if_masters_lost(self._weights.lost)
        for inner in self.optimizers:
            for i, group in enumerate(inner.param_groups):
                _fuse(inner, group)  # first: a fused kernel adds eps in float32
                say_what_in_place_loses(inner, group, f"{type(inner).__name__} param_groups[{i}]")
        groups = [len(inner.param_groups) for inner in self.optimizers]
        model_params = self._weights.model_params()
        # Where found_inf lives when no parameter has a gradient (a rank with none).
        self._device = model_params[0].device if model_params else None
        self._setup = SetupCheck(self._weights, scaler_chosen=loss_scaler is not None)
        self._loss_scaler = loss_scaler or (
            DynamicLossScaler() if needs_scaling(model_params) else NoOpLossScaler()
        )
        self._book = _Bookkeeping(
            Deferred(self._folded),
            fused=[FusedStep(inner) for inner in self.optimizers],
            groups=groups,
        )
        for inner in self.optimizers:  # its own step() refused while this wrapper lives
            watch_wrapped(inner, self._book, self.zero_grad)
        note_partners(self._book, self._weights.half, self._weights.plain, self._loss_scaler)
        self._book.stall = StallWatch(self._weights.plain)  # 16-bit ones, stepped in place
        self._decide_host_path()
        self.health: ScalerHealth | None = ScalerHealth()
        self._tracer = None if traced is None else OverflowTracer(traced)
        model = model_of(model_params) if self._weights.half else None
        if model is not None:  # a framework save that takes the model alone loses the masters
            guard_saves(model)

    # -- parameters -------------------------------------------------------------------------

    def _decide_host_path(self) -> None:
        weights = self._weights
        self._book.host_path = (
            weights.on_host and not weights.checked and type(self._loss_scaler) in _HOST_SCALERS
        )

    @property
    def loss_scaler(self) -> LossScaler:
        """The scaler, its counters up to date (steps decided on the device read first)."""
        self._read_device_steps()
        return self._loss_scaler

    def _read_device_steps(self) -> None:
        self._book.deferred.fold()  # at once when nothing is pending

    def _folded(self, found_inf: bool) -> None:
        """One step decided on the device, now read: count it and watch the health."""
        self._loss_scaler.update(found_inf)
        result = StepResult(not found_inf, found_inf, self._loss_scaler.get_scale())
        after_step(self.health, result, self._loss_scaler, self._weights)

    def broadcast_masters(self, src: int = 0) -> None:
        """Make every rank's float32 masters (and so 16-bit weights) those of rank ``src``,
        and its loss scale and inner optimizer state where a rank's differ (replicas.py).

        DDP broadcasts rank 0's 16-bit weights when it wraps a model; this sends the
        float32 masters behind them too, so no rank starts from rounded values."""
        self._weights.broadcast(src)
        state_of_rank(self, src)

    # -- gradients --------------------------------------------------------------------------

    def backward(self, loss: torch.Tensor, **kwargs: Any) -> None:
        """``(loss * scale / accumulation_steps).backward(**kwargs)``. One that raises half
        way has added some layers' gradients: its whole group goes (``drop_gradients``)."""
        look = self._book.look
        try:
            if look.looking(self._book.micro):  # the first steps (backward_look.py)
                look.backward(self, loss, kwargs)
            else:
                self.get_scaled_loss(loss).backward(**kwargs)
        except BaseException as err:
            self.drop_gradients()
            pointed = with_pointer(err)  # torch's checkpoint of a block: what to use
            if pointed is not None:
                raise pointed from err
            raise

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear the model's gradients, except between the micro-batches of an accumulation."""
        if 0 < self._book.micro < self.accumulation_steps:
            return
        book = self._book
        if book.micro >= self.accumulation_steps > 1:  # a whole group, its step() never came
            book.micro = book.backwards = 0  # (it raised): else the next group was refused
        if book.found_inf is not None:  # unscaled, then dropped (a batch skipped by hand)
            drop_unscaled_group(self)
        book.found_inf, book.no_grads, book.unscaled_versions = None, False, None
        if self._tracer is not None:  # a backward no step followed (it raised): not blamed
            self._tracer.clear()
        self._adopt_added_groups()  # their gradients are cleared too, as the inner's would be
        self._weights.zero_grad(set_to_none)

    def unscale_(self, factor: float = 1.0) -> None:
        """Unscale now (to inspect or clip ``master_params()`` grads yourself); ``step``
        then does not unscale again. ``factor``: a further multiplier, applied in the same
        pass, before the inf/NaN check (``optim.partial_group.apply_partial_group`` passes a partial
        accumulation group's ``accumulation_steps / micro-steps taken``)."""
        if not (is_number(factor) and 0 < factor < inf):
            raise ArgumentError(f"unscale_(factor={factor!r}) is invalid; give a finite number > 0")
        if self._book.found_inf is not None:
            raise MisuseError(
                "LossScaleOptimizer.unscale_() has already been called since the last step()"
            )
        if not self._book.fresh:
            raise MisuseError(
                "LossScaleOptimizer.unscale_() called without a backward() since the last step()"
            )
        factor *= unscale_group_factor(self._book, self.accumulation_steps)
        self._adopt_added_groups()  # step() adopts before its own unscale
        self._book.look.before_unscale(self._weights, self._loss_scaler.get_scale())
        self._unscale(float(factor))
        if self._book.unscale_checks < UNSCALE_CHECKS:  # the habit shows at once: no more cost
            self._book.unscale_checks += 1
            self._book.unscaled_versions = grad_versions(self._weights.half)

    def _unscale(self, factor: float = 1.0) -> None:
        self._weights.follow_external_writes(stepping=True)
        if not self._book.replicas_checked:  # the first step: a DDP built since the wrap
            self._book.replicas_checked = masters_of_rank0_if_replicas(self._weights)
        self._weights.load_master_grads()
        grads = self._weights.step_grads()
        self._book.no_grads = not grads
        self._book.found_inf = self._loss_scaler.unscale_(grads, self._device, factor)

    # -- the step ---------------------------------------------------------------------------

    def step(self, closure: Callable[[], float] | None = None) -> StepResult:  # type: ignore[override]
        """Unscale once, check, clip, apply or skip, update the scale; see ``StepResult``.
        With no gradient at all (``zero_grad`` between ``backward`` and ``step``) nothing is
        applied and the scale does not move: ``applied=False``, said once."""
        if closure is not None:
            raise MisuseError("LossScaleOptimizer.step() does not take a closure")
        if not self._book.fresh:
            raise no_backward_error(self._weights.model_params(), self._book)
        if check_micro_batches(self._book, self.accumulation_steps, self.drop_gradients):
            return apply_partial_group(self)  # an epoch's last, shorter group
        check_partners(self._book, self._loss_scaler)
        self._book.fresh = False
        if self._book.micro < self.accumulation_steps:
            return StepResult(False, False, self._loss_scaler.get_scale(), accumulating=True)
        say_if_rates_moved(self._book, self.optimizers)  # steps that apply or skip alone
        self._adopt_added_groups()
        if self._book.look.versions is not None:  # None after unscale_(), which looked
            self._book.look.before_unscale(self._weights, self._loss_scaler.get_scale())
        if self._book.unscaled_versions is not None:
            say_if_half_grads_changed(self._book.unscaled_versions, self._weights.half)
            self._book.unscaled_versions = None
        try:
            result = host_step(self) if self._book.found_inf is None else None
            if result is None:
                if self._book.found_inf is None:
                    self._unscale()
                result = self._finish()
        except BaseException:
            self._after_raise()
            raise
        after_step(self.health, result, self._loss_scaler, self._weights, self._tracer is not None)
        looks_after_step(self._book, self.optimizers, result)
        return result

    def _finish(self) -> StepResult:
        # Flags agreed across ranks in one collective: this step's found_inf, and whether the
        # last applied update made a float16 weight inf/NaN (checked then, read now: no extra
        # host synchronisation). A skipped step changed no weight and sends the same answer
        # again, so a compiled step has one shape whichever steps were skipped.
        # One process only: under torch.distributed a rank may hold no gradient and still
        # has to join the collective below.
        if self._book.no_grads and not is_distributed():
            self._read_device_steps()  # earlier steps decided on the device count first
            return no_gradients(self._book, self._loss_scaler.get_scale())
        flags = [self._book.found_inf.reshape(1).float()]  # type: ignore[union-attr]
        if self._weights.checked:
            flags.append((~self._book.weights_finite).reshape(1).to(flags[0]))
        agreed = agree_found_inf(flags[0] if len(flags) == 1 else torch.cat(flags))
        scale = self._loss_scaler.get_scale()
        if on_device(self):  # one flag: no float16 weights are checked on this path
            # Flags of several devices are summed: the fused kernels skip on exactly 1.
            found = agreed.reshape(()).clamp(max=1.0)
            if self._book.fused[0].step(found_inf=found):
                return device_tail(self, found, scale)
        self._read_device_steps()  # earlier steps decided on the device count first
        norm = None
        if self.max_grad_norm is not None:
            dense = [p for p in self._held() if p.grad is not None and not p.grad.is_sparse]
            norm = nn.utils.clip_grad_norm_(dense, self.max_grad_norm, foreach=True)
            if is_dtensor(norm):  # FSDP2: the norm over every shard
                norm = norm.full_tensor()  # type: ignore[attr-defined]
        # The one host synchronisation of the step: the flags (and the norm) together.
        if norm is not None:
            *found_flags, norm_value = torch.cat([agreed, norm.reshape(1).to(agreed)]).tolist()
        else:
            found_flags, norm_value = agreed.tolist(), None
        if len(found_flags) > 1 and found_flags[1]:
            self._book.weights_finite = torch.ones((), dtype=torch.bool)  # said once
            self._weights.raise_nonfinite_weights()
        overflow = bool(found_flags[0])
        origin = None
        if self._tracer is not None:
            origin = self._tracer.first_overflow() if overflow else None
            self._tracer.clear()
            if origin is not None:
                _log.warning("step skipped: overflow first in %s", origin)
        if not overflow:
            for k, inner in enumerate(self.optimizers, start=1):
                if self._weights.saw_sparse:
                    _unfuse_sparse(inner)
                step_inner_fused_safely(inner, self._book)
                self._book.stepped = k  # in: a raise from here finishes the step as applied
            # Inline: dynamo runs this eagerly after the graph break in the loop above, where
            # a MasterWeights method would compile as a graph of its own (torch 2.13).
            if self._weights.half:
                with torch.no_grad():
                    torch._foreach_copy_(self._weights.half, self._weights.masters)
                self._weights.versions = self._weights.half_versions()
            self._book.stepped = COPIED
            self._run_post_hooks()  # nothing to run without hooks
            if self._weights.checked:
                self._book.weights_finite = all_finite(self._weights.checked)
        self._book.stepped = 0
        self._loss_scaler.update(overflow)
        self._book.micro = 0
        self._book.found_inf = None
        return StepResult(
            applied=not overflow,
            found_inf=overflow,
            scale=scale,
            grad_norm=norm_value,
            overflow=origin,
        )
