"""Checks around ``LossScaleOptimizer`` that catch set-up mistakes which would otherwise train
silently in the wrong precision, and what a step says about the run.

- ``SetupCheck``: at the first backward, the optimizer's construction-time decisions (which
  parameters get float32 masters, whether the loss is scaled) must still fit the model: a
  model prepared by ``auto_mixed_precision`` (or cast to 16 bits) *after* the optimizer was
  built would train its 16-bit weights without masters, or float16 math without scaling.
- (A plain torch optimizer stepping such a model's 16-bit weights itself is caught by
  ``mixprec._plain_optimizers``, which ``auto_mixed_precision`` installs.)
- ``no_gradients``: a step where no parameter has a gradient applies nothing, and says so.
- ``refuse_accelerate_wrapper``: ``accelerator.prepare`` given a ``LossScaleOptimizer``.
- (``BackwardLook``, in ``backward_look``: what the first steps' backwards left, looked
  at again before the next backward and the step.)
- ``watch_health``: the loss scaler's health (``ScalerHealth``) after every step, so custom
  loops hear, once, of a run stuck at the scaler's floor or of runs of skipped steps.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from types import FrameType
from typing import TYPE_CHECKING, Any

import torch

from mixprec import _averaged_copies as averaged_copies
from mixprec._dist import agree_found_inf, is_distributed, is_dtensor
from mixprec._dtypes import dtype_name
from mixprec._errors import ArgumentError, MisuseError
from mixprec._float32_copies import say_if_frozen_copies
from mixprec._live_masters import has_live_master
from mixprec._param_tags import unpickled_keepers
from mixprec._warn import caller_stacklevel, warn_at_caller
from mixprec.casting import POLICY_ATTR
from mixprec.optim import sharing
from mixprec.optim.backward_look import grad_versions
from mixprec.optim.fused import needs_scaling
from mixprec.optim.lr_watch import note_rates_at_skip
from mixprec.optim.masters import MasterWeights, needs_master
from mixprec.optim.norm_statistics import reset_nonfinite_statistics
from mixprec.optim.step_result import DeviceFlag, StepResult
from mixprec.policy import global_policy
from mixprec.scaling import LossScaler, NoOpLossScaler
from mixprec.scaling.health import ScalerHealth, scale_floor
from mixprec.trace import models_of

if TYPE_CHECKING:
    from mixprec.optim.loss_scale_optimizer import LossScaleOptimizer, _Bookkeeping

__all__ = [
    "SetupCheck",
    "after_step",
    "check_micro_batches",
    "drop_unscaled_group",
    "no_backward_error",
    "no_gradients",
    "refuse_accelerate_wrapper",
    "say_if_grads_unfilled",
    "watch_health",
]

_ORDER = (
    "build the optimizer after auto_mixed_precision: model = mp.auto_mixed_precision(model, "
    "...); opt = mp.LossScaleOptimizer(torch.optim.AdamW(model.parameters()))"
)


def _ends(params: list[torch.Tensor]) -> tuple[torch.dtype, ...]:
    return (params[0].dtype, params[-1].dtype) if params else ()


class SetupCheck:
    """What a ``LossScaleOptimizer`` decided when it was built, checked against the model
    at the first backward (not in the step, which ``torch.compile`` may trace); at every
    later backward, only the first and last plain parameters' dtypes are looked at, which a
    ``model.to(torch.bfloat16)`` (or ``.half()``) in the middle of training changes."""

    def __init__(self, weights: MasterWeights, scaler_chosen: bool) -> None:
        self.pending = True
        self.scaler_chosen = scaler_chosen  # by the user: their choice is not second-guessed
        self.dtypes = [p.dtype for p in weights.plain]
        # The 16-bit weights' at either end: a model with no plain parameter (no norm
        # layer) cast by .half() mid-training changed only these.
        self.half_dtypes = _ends(weights.half)

    def due(self, weights: MasterWeights) -> bool:
        """Whether ``run`` must look: at the first backward, after a group was added, or
        when a parameter at either end of the plain or the 16-bit ones changed dtype (four
        reads, not a pass)."""
        plain = weights.plain
        if self.pending or len(plain) != len(self.dtypes):
            return True
        if _ends(weights.half) != self.half_dtypes:
            return True
        return bool(plain) and (
            plain[0].dtype != self.dtypes[0] or plain[-1].dtype != self.dtypes[-1]
        )

    def run(self, weights: MasterWeights, scaler: LossScaler) -> None:
        """Raise ``MisuseError`` with the right order when the model was prepared (or cast
        to 16 bits) after the optimizer was built."""
        unpickled_keepers()  # sent to another process: the parameters' notes back first
        self.dtypes += [p.dtype for p in weights.plain[len(self.dtypes) :]]  # add_param_group
        late = [
            p
            for p, then in zip(weights.plain, self.dtypes, strict=True)
            # (A frozen 16-bit alias of a trained weight has no master by design: _aliases.)
            if p.dtype.itemsize < then.itemsize or (needs_master(p) and p.requires_grad)
        ]
        params = weights.model_params()
        unscaled = (
            not self.scaler_chosen
            and isinstance(scaler, NoOpLossScaler)
            and any(hasattr(p, POLICY_ATTR) for p in params)
            and needs_scaling(params)
        )
        if late or unscaled:
            found = []
            if late:
                kinds = ", ".join(sorted({dtype_name(p.dtype) for p in late}))
                found.append(
                    f"{len(late)} parameters it holds are now {kinds} with no float32 master "
                    "weights (small updates round away, the optimizer state is 16-bit)"
                )
            if unscaled:
                stored = any(p.dtype == torch.float16 for p in params)
                found.append(
                    f"{'its parameters are now' if stored else 'the model now computes in'} "
                    "float16, which needs loss scaling, and this optimizer does no loss "
                    "scaling (it chose NoOpLossScaler for a float32 or bfloat16 model), so "
                    "small gradients underflow to 0"
                )
            if not self.pending:  # it trained in its precision until now
                # A prepared model is prepared once (mp.auto_mixed_precision refuses it
                # again, cast or not): the way back is a fresh model.
                raise MisuseError(
                    "the model was cast to 16 bits (model.to(torch.bfloat16), .half()) after "
                    f"its first backward: {'; and '.join(found)}. The cast rounded these "
                    "float32 parameters, and the masters were decided when the optimizer was "
                    "built. Leave the model in the dtypes mp.auto_mixed_precision gave it (O2 "
                    "already stores the matrix weights in 16 bits behind float32 masters). "
                    "This model cannot be prepared again: to go on, build it afresh in "
                    f"float32, then {_ORDER}, and load your last checkpoint into both: "
                    "mp.load_checkpoint(path, model, opt)"
                )
            raise MisuseError(
                "LossScaleOptimizer was built before the model was prepared for mixed "
                f"precision (or cast to 16 bits): {'; and '.join(found)}. Its masters and loss "
                f"scaler are decided when it is built: {_ORDER}"
            )
        # A widening (an O3 model back in float32) loses nothing: recorded, or every
        # backward would look again.
        self.dtypes = [p.dtype for p in weights.plain]
        self.half_dtypes = _ends(weights.half)
        if self.pending:
            self.pending = False
            _say_if_global_policy_unused(params)


def _say_if_global_policy_unused(params: list[torch.Tensor]) -> None:
    """A 16-bit global policy (Keras' ``set_global_policy``) over parameters of no prepared
    model: torch's layers do not read it as Keras' layers do, so the model trains in
    float32 (with the policy's loss scaling, which ``needs_scaling`` still takes from it)."""
    policy = global_policy()
    if policy.compute_dtype == torch.float32 or not params:
        return
    # FSDP2's DTensors do not carry the tags: fully_shard's own mp_policy computes.
    if any(hasattr(p, POLICY_ATTR) or p.dtype != torch.float32 or is_dtensor(p) for p in params):
        return
    warn_at_caller(
        f"the global policy {policy.name!r} (mp.set_global_policy) is in effect, and this "
        "optimizer's parameters belong to no model prepared for it: the model computes in "
        "float32. torch's layers do not read the global policy as Keras' layers do; it "
        "applies when a model is prepared: model = mp.auto_mixed_precision(model) (the "
        "global policy is its default), before building the optimizer, or mp.Trainer"
    )


def no_gradients(book: _Bookkeeping, scale: float) -> StepResult:
    """The result of a due step where no parameter has a gradient: nothing is applied, the
    scaler does not move (this was not a step), and it is said once per optimizer."""
    book.micro = 0
    book.found_inf = None
    book.no_grads = False
    if not book.said_no_grads:
        book.said_no_grads = True
        warnings.warn(
            "LossScaleOptimizer.step(): no parameter has a gradient, so nothing was applied "
            "(applied=False). Did zero_grad() run between backward() and step()? Clear the "
            "gradients before the forward or after the step: opt.zero_grad(); "
            "opt.backward(loss_fn(model(x), y)); opt.step(). Or were the model's parameters "
            "replaced after the optimizer was built (load_state_dict(assign=True), "
            "model.to_empty())? Then build the optimizer for the model's new parameters",
            UserWarning,
            stacklevel=4,
        )
    return StepResult(applied=False, found_inf=False, scale=scale)


def watch_health(
    health: ScalerHealth | None, result: StepResult, scaler: LossScaler, traced: bool = False
) -> None:
    """Feed one due step to ``health`` and warn with what it diagnoses (once per kind);
    ``traced``: the step ran under ``trace_overflow``.

    Under ``torch.compile(opt.step)`` this runs eagerly: traced, its counters and window
    would be guards, and every step would compile again."""
    if health is None or result.accumulating or isinstance(result.found_inf, DeviceFlag):
        return  # a step decided on the device is observed when it is read (optim.deferred)
    if torch.compiler.is_compiling():
        _observe_eagerly(health, result, scaler, traced)
    else:
        _observe(health, result, scaler, traced)


def check_micro_batches(book: Any, accumulation_steps: int, drop: Callable[[], None]) -> bool:
    """At ``step()``: with accumulation, each backward counts as a micro-batch, so two per
    micro-batch (two losses, a ``retain_graph`` double backward, a gradient penalty through
    ``get_scaled_loss``) applied the group early: 4 steps where float32 took 2, unsaid.
    Allowed: one backward per ``step()`` call, or a whole group's before one ``step()``
    (the loop that steps every N-th batch). With two per micro-batch at N=2 the two look
    alike; that case cannot be told. Refused, the group is dropped (``drop``): a second
    ``step()`` would apply it.

    Returns whether this is a shorter group's ``step()`` in a loop that stepped whole
    groups (an epoch's last batches: 10 at N=4 end in 2), to apply as the mean of its
    micro-batches: it was refused, its gradients dropped, or, for one, carried into the
    next epoch's first group."""
    taken, n = book.backwards, accumulation_steps
    tail = _is_tail(book, n)
    if n > 1 and taken > 1 and not taken == book.micro == n and not tail:
        drop()
        raise MisuseError(
            f"{taken} backward() calls since the last step(), with accumulation_steps="
            f"{n}: each backward counts as a micro-batch, so step() must follow each "
            f"backward (it applies every {n}th) or exactly {n} of them (after whole groups, "
            "a shorter one at an epoch's end is applied as its mean). Sum a micro-batch's "
            "losses into one backward (opt.backward(loss_a + loss_b)); for "
            "torch.autograd.grad of an inner loss (a gradient penalty) take "
            "opt.scale_loss(loss), which starts no micro-batch. Their gradients are dropped"
        )
    # Which loop this is: whole groups, or a step() each backward. Once a tail applied, the
    # next group says again (a step() each after it is not taken for another tail).
    if n > 1 and taken:
        book.whole_groups = taken == n
    book.backwards = 0
    return tail


def _is_tail(book: Any, n: int) -> bool:
    """A shorter group's backwards in a loop that stepped whole groups (an epoch's end)."""
    return n > 1 and book.whole_groups and 0 < book.backwards == book.micro < n


def unscale_group_factor(book: Any, accumulation_steps: int) -> float:
    """At ``unscale_()``: 1 after a whole group; ``N / k`` for an epoch's last, shorter
    group of ``k`` in a loop that steps whole groups (its mean, as ``step()`` applies it:
    clipping by hand before that step raised for want of a last micro-batch). Else,
    before the group's last micro-batch, refused."""
    if book.micro >= accumulation_steps:
        return 1.0
    if _is_tail(book, accumulation_steps):
        return float(accumulation_steps / book.micro)
    raise MisuseError(
        f"LossScaleOptimizer.unscale_() called after {book.micro} of {accumulation_steps} "
        "accumulation micro-batches; call it after the last"
    )


def after_step(
    health: ScalerHealth | None,
    result: StepResult,
    scaler: LossScaler,
    weights: MasterWeights,
    traced: bool = False,
) -> None:
    """What follows every step once it is decided (on the host, or when its device flag is
    read): a skipped one's forward may have made running statistics inf/NaN (reset and
    said, ``norm_statistics``), then the scaler's health (``watch_health``)."""
    if result.found_inf is True:  # decided; a DeviceFlag is observed at its read
        reset_nonfinite_statistics(weights.model_params())
    watch_health(health, result, scaler, traced)
    if weights.step_looks == 1 and not weights.said_frozen:  # the first step that looked
        _say_frozen_eagerly(weights)  # at the 16-bit weights; compiled: one break, once
    if averaged_copies.PENDING or averaged_copies.WATCHED:  # 16-bit averages (made since)
        _say_averaged_eagerly(has_live_master, weights)  # compiled: one break, once


def looks_after_step(
    book: Any, optimizers: list[torch.optim.Optimizer], result: StepResult
) -> None:
    """The learning rates after a skip decided on the host (``lr_watch``), and whether
    the weights stepped in place still move (``stall``)."""
    if result.found_inf is True:
        note_rates_at_skip(book, optimizers)
    book.stall.after_step(result.applied)
    book.share.backward_scale = None  # the next step's first backward sets it (sharing)


def _observe(health: ScalerHealth, result: StepResult, scaler: LossScaler, traced: bool) -> None:
    message = health.observe(
        scaler.state, bool(result.found_inf), result.overflow, scale_floor(scaler), traced=traced
    )
    if message:
        # At the caller's line: step() or apply_gradients(), or the read of a StepResult
        # that told it of steps decided on the device (optim.deferred).
        warnings.warn(message, UserWarning, stacklevel=caller_stacklevel())


# torch's lazy form of torch.compiler.disable: dynamo is imported at the first call (under
# compile, when it is loaded anyway), not when mixprec is.
_observe_eagerly = torch._disable_dynamo(_observe)  # type: ignore[attr-defined]


def _say_frozen(weights: MasterWeights) -> None:
    weights.said_frozen = True
    say_if_frozen_copies(models_of(weights.half))


_say_frozen_eagerly = torch._disable_dynamo(_say_frozen)  # type: ignore[attr-defined]
_say_averaged_eagerly = torch._disable_dynamo(averaged_copies.say_averaged_copies)  # type: ignore[attr-defined]


def refuse_accelerate_wrapper(caller: FrameType | None) -> None:
    """Raise when ``caller`` is accelerate's optimizer wrapper, which ``accelerator.prepare``
    builds (and which reads ``state_dict()`` as it does). Wrapped, ``step()`` would return
    ``None`` instead of the ``StepResult``, and its ``clip_grad_norm_`` would clip the
    scaled 16-bit gradients. Matched by module name: accelerate is not imported."""
    if caller is not None and caller.f_globals.get("__name__") == "accelerate.optimizer":
        raise ArgumentError(
            "accelerator.prepare() got a mixprec LossScaleOptimizer: accelerate's wrapper "
            "hides step()'s StepResult and its clip_grad_norm_ would clip the scaled 16-bit "
            "gradients. Prepare only the model and the data, step the LossScaleOptimizer "
            "yourself (max_grad_norm= clips), and save it with "
            "accelerator.register_for_checkpointing(optimizer)"
        )


def say_if_half_grads_changed(then: list[int], half: list[torch.Tensor]) -> None:
    """After ``unscale_()`` the gradients ``step()`` applies are the masters'
    (``master_params()``); a change to the 16-bit weights' own gradients since (the
    ``torch.amp`` habit ``clip_grad_norm_(model.parameters(), ...)``) changes nothing, and
    is said at the caller's line."""
    if then != grad_versions(half):
        warn_at_caller(
            "the 16-bit weights' gradients changed after unscale_() (clip_grad_norm_("
            "model.parameters()) as with torch.amp?), but step() applies their float32 "
            "masters' gradients, which did not change: clip opt.master_params() instead, "
            "or pass LossScaleOptimizer(..., max_grad_norm=...)"
        )


def say_if_grads_unfilled(weights: MasterWeights, scale: float, book: _Bookkeeping) -> None:
    """``master_params()`` after the backward and before ``unscale_()``: the masters'
    gradients are ``None`` until the unscale fills them, and plain parameters' are still
    multiplied by the scale. Said once: Apex's ``clip_grad_norm_(amp.master_params(opt))``
    right after the backward would clip nothing that counts, and return 0."""
    if book.said_unfilled or (not weights.half and scale == 1.0):
        return  # said; or the plain parameters' gradients are the unscaled ones already
    book.said_unfilled = True
    held = "the float32 masters' .grad are None" if weights.half else "their .grad are scaled"
    warn_at_caller(
        f"master_params() after backward() and before unscale_(): {held} until unscale_() "
        "(or step()) runs. To clip or read the gradients, as Apex's "
        "clip_grad_norm_(amp.master_params(opt), ...) right after its backward, call "
        "opt.unscale_() first (here clip_grad_norm_ would clip nothing the step applies), "
        "or give LossScaleOptimizer(max_grad_norm=...). (Said once; reading the values "
        "alone is fine.)"
    )


def say_if_masters_lost(count: int) -> None:
    """``count`` 16-bit weights had masters in an earlier optimizer that is gone: theirs
    start from the rounded weights (``MasterWeights.adopt``), which is said."""
    if count:
        warn_at_caller(
            f"{count} 16-bit weight(s) had float32 masters in an earlier LossScaleOptimizer "
            "that is gone (deleted with its Trainer): their masters start from the rounded "
            "16-bit values. Build the new optimizer while the old one lives, or resume from "
            "a checkpoint, to keep them"
        )


def drop_unscaled_group(opt: LossScaleOptimizer) -> None:
    """``zero_grad()`` of gradients unscaled and not stepped: the unscale goes with them
    (else the next step skipped its own and applied the new gradients still scaled), and
    the group they ended too. Dropped because they held inf/NaN (a check of one's own after
    ``unscale_()``), it is a skipped step all the same: the scale backs off (before, it
    never did, and every batch was dropped)."""
    book = opt._book
    book.micro, book.fresh, book.backwards = 0, False, 0
    if book.no_grads and not is_distributed():
        return
    # Agreed across ranks as a step's is (every rank drops the batch, or none could step):
    # one rank's overflow backs off every rank's scale, or the scales drift apart.
    found = agree_found_inf(book.found_inf.reshape(1).float())  # type: ignore[union-attr]
    if bool(found.any()):
        opt._read_device_steps()
        opt._folded(True)


def no_backward_error(params: list[torch.Tensor], book: Any) -> MisuseError:
    """``step()`` with no backward of its own. Parameters that hold gradients anyway got
    them from a plain ``loss.backward()`` (the torch habit) or, where another
    ``LossScaleOptimizer`` is alive, maybe from its backward over the same loss."""
    message = (
        "LossScaleOptimizer.step() called without a new backward since the last step(): "
        "call opt.backward(loss) (or backward on opt.get_scaled_loss(loss)) first"
    )
    if book.raised == "applied":  # a retry of a step that went in
        return MisuseError(
            message + ". The last step() raised after its update was applied (a step "
            "post-hook, or an interrupt in the copy-back to the 16-bit weights) and was "
            "finished as applied: that batch is done; go on with the next batch's backward"
        )
    if book.raised:  # a retry: its gradients may be unscaled in place already
        return MisuseError(
            message + ". The last step() raised before it finished, and its backward went "
            "with it (some gradients may be unscaled in place already): zero_grad() and run "
            "the batch's backward again"
        )
    if not any(p.grad is not None for p in params):
        return MisuseError(message)
    message += (
        ". Its parameters hold gradients from a backward it did not run: a plain "
        "loss.backward()? Use opt.backward(loss) in its place: it scales the loss where "
        "the policy needs it (float16) and marks the backward as this optimizer's, so "
        "step() unscales by the scale the gradients carry. Gradients computed by hand "
        "(torch.autograd.grad): opt.apply_gradients(zip(grads, params)), unscaled first "
        "with opt.get_unscaled_gradients(grads) where the loss was scaled"
    )
    if sharing.others_live(book):
        message += (
            ". Or another LossScaleOptimizer's opt.backward(loss): for one loss over the "
            "parameters of two optimizers, wrap both in one, mp.LossScaleOptimizer([opt_a, "
            "opt_b]) (one scale, one backward); a backward per wrapper would add every "
            "gradient twice"
        )
    return MisuseError(message)
