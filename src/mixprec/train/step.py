"""One training step: ``TrainStep`` and ``build_train_step`` (MindSpore's
``build_train_network``).

Composition only: the model is prepared by ``auto_mixed_precision`` and the optimizer step
(scaling, unscaling, skip on overflow, float32 masters) is ``LossScaleOptimizer``'s.

    step = build_train_step(model, torch.optim.SGD(model.parameters(), 0.1), "cross_entropy",
                            policy="mixed_float16")
    loss, result = step(x, y)  # result.applied: False when an overflow skipped the step
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from mixprec._calling import call
from mixprec._compile import (
    CompileOption,
    compile_options,
    compile_step,
    say_if_past_recompile_limit,
)
from mixprec._errors import ArgumentError
from mixprec._plan_apply import PlanLike
from mixprec._prepare_once import needs_preparation
from mixprec.levels import auto_mixed_precision
from mixprec.losses import cross_entropy
from mixprec.optim import LossScaleOptimizer, StepResult
from mixprec.optim.arguments import checked_options
from mixprec.optim.partial_group import apply_partial_group
from mixprec.policy import PolicyLike
from mixprec.scaling import LossScaler
from mixprec.train.metrics import LossFn, get_loss
from mixprec.train.optimizers import get_optimizer
from mixprec.train.warn import warn

#: A compiled step's first calls compile (not timed); the next ``_PROBE`` are timed
#: compiled and as many eagerly; compiled more than ``_SLOWER`` times eager is said once.
_WARMUP, _PROBE, _SLOWER = 3, 3, 1.10


class TrainStep:
    """One training step: zero grads, forward, loss, scaled backward, step.

    ``step(x, y) -> (loss, StepResult)``; the loss is detached and ``last_output`` holds the
    detached model output (for metrics). With ``compile``, the forward and the loss run as one
    ``torch.compile``'d function (so inductor fuses the output's upcast into the loss); the
    loss scaling and the optimizer step run outside the graph, so a new scale, a skipped step
    or an accumulation micro-step compile nothing new. Compiled, steps 4-6 are timed and
    steps 7-9 run eagerly, timed, once: a compiled step slower than eager is said (compiling
    does not always pay: on CPU most of a step can be kernels it only calls)."""

    def __init__(
        self,
        model: nn.Module,
        optimizer: LossScaleOptimizer,
        loss_fn: LossFn,
        compile: CompileOption = False,
    ) -> None:
        self.model = model
        self.optimizer = optimizer
        self.loss_fn = loss_fn
        self.last_output: torch.Tensor | None = None
        self.last_loss: torch.Tensor | None = None  # this call's, once its backward ran
        options = compile_options(compile)
        self._forward_loss = (
            self._forward_and_loss
            if options is None
            else compile_step(self._forward_and_loss, options, model)
        )
        if options is not None:
            say_if_past_recompile_limit(model)
        # Compiled: calls _WARMUP.. are timed compiled, then as many eagerly, once, to say
        # when compiling made the step slower (not with accumulation: uneven calls).
        self._calls = 0
        self._probe: list[float] | None = (
            [] if options is not None and optimizer.accumulation_steps == 1 else None
        )
        # Under CUDA graphs (reduce-overhead, max-autotune, the cudagraphs backend, inductor's
        # global or environment setting) the next replay overwrites this step's loss, and
        # torch raises where a caller kept it (a list of losses). Which options record graphs
        # is not all in `compile`: every compiled step copies its loss out (one value).
        self._copy_loss = options is not None

    def resumed_at(self, steps: int) -> None:
        """Count ``steps`` calls as made (a resumed run's optimizer steps, skipped ones
        too): the eager probe runs at the calls it ran at in the run resumed, or not
        again. Run again at the resumed run's own 7th to 9th calls, its eager dropout drew
        other masks than the compiled steps of the run it resumed (0.01 off at the next
        step, 0.056 by the 12th)."""
        self._calls = max(self._calls, steps)
        if self._calls >= _WARMUP + 2 * _PROBE:
            self._probe = None
        elif self._probe is not None and self._calls > _WARMUP:
            # Resumed inside the probe: its calls before count as done (untimed, NaN), so
            # its eager calls are the run resumed's and it ends where that one's did.
            self._probe = [math.nan] * (self._calls - _WARMUP)

    def _forward_and_loss(self, x: Any, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        output = model_output(call(self.model, x))
        # A pure policy's 16-bit output: the loss from its float32 copy (a 16-bit loss's
        # rounding hides progress; mp.cross_entropy upcasts its chunks itself).
        upcast = output.dtype in (torch.float16, torch.bfloat16)
        upcast = upcast and self.loss_fn is not cross_entropy
        return checked_loss(self.loss_fn(output.float() if upcast else output, y)), output

    def __call__(
        self, x: Any, y: torch.Tensor, *, flush: bool = False
    ) -> tuple[torch.Tensor, StepResult]:
        """One micro-step; with ``flush``, an accumulation group that is not full yet is
        applied now, as the mean over the micro-steps it has (the last batch of an epoch)."""
        timed = self._probe is not None and self._calls >= _WARMUP
        eager = timed and self._calls >= _WARMUP + _PROBE
        start = time.perf_counter()
        self.last_loss = None
        self.optimizer.zero_grad()
        loss, output = (self._forward_and_loss if eager else self._forward_loss)(x, y)
        self.optimizer.backward(loss)
        # Before the step: a step that raises after its update went in leaves its batch's
        # loss and output to the Trainer's bookkeeping (train/batch_end.py).
        self.last_output, self.last_loss = output.detach(), loss.detach()
        if flush and self.optimizer.accumulation_steps > 1:
            result = apply_partial_group(self.optimizer)
        else:
            result = self.optimizer.step()
        self._calls += 1
        if timed and self._probe is not None:
            self._probe.append(time.perf_counter() - start)
            if len(self._probe) == 2 * _PROBE:
                self._say_if_compiled_is_slower(self._probe)
                self._probe = None
        return (loss.detach().clone() if self._copy_loss else loss.detach()), result

    @staticmethod
    def _say_if_compiled_is_slower(times: list[float]) -> None:
        if any(math.isnan(t) for t in times):  # a resumed probe: not all timed here
            return
        compiled, eager = statistics.median(times[:_PROBE]), statistics.median(times[_PROBE:])
        if compiled > _SLOWER * eager:
            warn(
                f"compile: on this machine a compiled training step took {1e3 * compiled:.2f} "
                f"ms and an eager one {1e3 * eager:.2f} ms (medians of {_PROBE} steps each, "
                f"steps {_WARMUP + 1}-{_WARMUP + 2 * _PROBE}): compile=False trains faster here"
            )


def model_output(output: Any) -> torch.Tensor:
    """The tensor the loss and metrics take from a forward's result: the result itself, the
    first item of a tuple or list, or the ``logits`` of a mapping (a Hugging Face
    ``ModelOutput``, as HF users expect)."""
    if isinstance(output, torch.Tensor):
        return output
    if isinstance(output, Mapping):
        logits = output.get("logits")
        if isinstance(logits, torch.Tensor):
            return logits
        keys = ", ".join(repr(k) for k in list(output)[:8])
        raise ArgumentError(
            f"model output is a {type(output).__name__} with keys [{keys}] and no 'logits' "
            "tensor; valid: a tensor, a tuple or list whose first item is a tensor, or a "
            "mapping with a 'logits' tensor"
        )
    if isinstance(output, (tuple, list)):
        if output and isinstance(output[0], torch.Tensor):
            return output[0]
        kind = type(output).__name__
        what = (
            f"a {kind} whose first item is a {type(output[0]).__name__}"
            if output
            else (f"an empty {kind}")
        )
        raise ArgumentError(
            f"model output is {what}; valid: "
            "a tensor, a tuple or list whose first item is a tensor, or a mapping with a "
            "'logits' tensor"
        )
    raise ArgumentError(
        f"model output is a {type(output).__name__}; valid: a tensor, a tuple or list whose "
        "first item is a tensor, or a mapping with a 'logits' tensor"
    )


def checked_loss(loss: Any) -> torch.Tensor:
    """``loss`` if it is a floating-point scalar tensor (one element) that backward can
    start from; else one ``ArgumentError`` naming what ``loss_fn`` returned."""
    if isinstance(loss, torch.Tensor):
        if loss.is_floating_point() and loss.numel() == 1:
            return loss
        got = f"a tensor of shape {tuple(loss.shape)} and dtype {loss.dtype}"
    else:
        got = f"a {type(loss).__name__}"
    raise ArgumentError(
        f"loss_fn returned {got}; valid: a floating-point scalar tensor "
        "(a loss with reduction='mean' or 'sum')"
    )


def build_train_step(
    model: nn.Module,
    optimizer: torch.optim.Optimizer | str,
    loss_fn: str | LossFn,
    policy: PolicyLike = None,
    level: str = "auto",
    loss_scaler: LossScaler | None = None,
    max_grad_norm: float | None = None,
    accumulation_steps: int = 1,
    trace_overflow: bool = False,
    compile: CompileOption = False,
    *,
    amp_level: str | None = None,
    plan: PlanLike | None = None,
) -> TrainStep:
    """Prepare ``model`` (unless ``auto_mixed_precision`` was already applied) and wrap
    ``optimizer`` (unless it is a ``LossScaleOptimizer``); return the step callable.

    ``optimizer`` may be a Keras name (``"adam"``, ``"sgd"``...; see
    ``mixprec.train.optimizers``), built over ``model.parameters()`` with Keras' defaults.
    ``amp_level``: MindSpore's keyword, in place of ``level``, as ``auto_mixed_precision``
    takes it. ``compile``: ``True`` or a dict of ``torch.compile`` options compiles the
    forward and the loss together (see ``TrainStep``). ``plan``: an ``mp.autotune`` plan,
    applied as ``auto_mixed_precision(model, plan=plan)`` (alone: not with policy or level)."""
    # Bad values fail before the model or the optimizer is changed: a retry with the
    # value fixed was refused as "prepared already" or "holds none of the parameters".
    compile_options(compile)
    loss = get_loss(loss_fn)
    if not isinstance(optimizer, LossScaleOptimizer):
        checked_options(loss_scaler, max_grad_norm, accumulation_steps, trace_overflow)
    if isinstance(optimizer, LossScaleOptimizer):
        # They configure the LossScaleOptimizer this call would build: one built already
        # has its own, and would silently train without clipping or accumulation asked.
        given = (
            ("loss_scaler", loss_scaler, None),
            ("max_grad_norm", max_grad_norm, None),
            ("accumulation_steps", accumulation_steps, 1),
            ("trace_overflow", trace_overflow, False),
        )
        for name, value, default in given:
            if value != default:
                raise ArgumentError(
                    f"{name}={value!r} configures the LossScaleOptimizer built around the "
                    f"optimizer, but optimizer is a LossScaleOptimizer already; pass {name} to "
                    "LossScaleOptimizer(...) instead, or give the inner optimizer"
                )
    if isinstance(model, nn.Module):  # else auto_mixed_precision says what model must be
        if isinstance(optimizer, str):
            # Built before the model is prepared, as a user builds one: over float32 weights.
            optimizer = get_optimizer(optimizer, model.parameters())
        check_optimizer_covers(model, optimizer)  # before the model changes
    asked = f"level={level!r}" if amp_level is None else f"amp_level={amp_level!r}"
    where = "plan=" if plan is not None else f"build_train_step(policy={policy!r}, {asked})"
    # A model prepared already (by the user, an earlier step) is used as it is when it has
    # what is asked; policy=None and level="auto" ask nothing of it.
    if needs_preparation(model, policy, level, where=where, amp_level=amp_level, plan=plan):
        auto_mixed_precision(model, policy, level, amp_level=amp_level, plan=plan)
    if not isinstance(optimizer, LossScaleOptimizer):
        optimizer = LossScaleOptimizer(
            optimizer, loss_scaler, max_grad_norm, accumulation_steps, trace_overflow
        )
    return TrainStep(model, optimizer, loss, compile)


def _held_parameters(optimizer: Any) -> set[int] | None:
    """The ids of the model parameters ``optimizer`` updates (a torch optimizer, a list of
    them, or a ``LossScaleOptimizer``), or None for anything else.

    A ``LossScaleOptimizer`` holds a 16-bit parameter with a float32 master through that
    master, and every other as it is (``model_params()`` lists both)."""
    if isinstance(optimizer, LossScaleOptimizer):
        return {id(p) for p in optimizer.model_params()}
    optimizers = optimizer if isinstance(optimizer, (list, tuple)) else [optimizer]
    plain = [
        isinstance(o, torch.optim.Optimizer) and not isinstance(o, LossScaleOptimizer)
        for o in optimizers
    ]
    if not optimizers or not all(plain):
        return None
    return {id(p) for o in optimizers for group in o.param_groups for p in group["params"]}


def check_optimizer_covers(model: nn.Module, optimizer: Any) -> None:
    """Refuse an optimizer that holds none of ``model``'s trainable parameters (built over
    another model: every step would report applied and change nothing); warn, naming
    them, when it holds only some. Anything but optimizers is left to
    ``LossScaleOptimizer``'s own checks."""
    trainable = [(name, p) for name, p in model.named_parameters() if p.requires_grad]
    held = _held_parameters(optimizer)
    if not trainable or held is None:
        return
    missing = [name for name, p in trainable if id(p) not in held]
    if len(missing) == len(trainable):
        raise ArgumentError(
            f"optimizer holds none of the model's {len(trainable)} trainable parameters (was "
            "it built over another model?): no step would change the model; build it over "
            "this model's parameters, e.g. torch.optim.Adam(model.parameters())"
        )
    if missing:
        names = ", ".join(missing[:5]) + (f" and {len(missing) - 5} more" if missing[5:] else "")
        warn(
            f"optimizer holds {len(trainable) - len(missing)} of the model's {len(trainable)} "
            f"trainable parameters; these will not train: {names}. Add them to the "
            "optimizer, or freeze them with requires_grad_(False) if that is meant"
        )
