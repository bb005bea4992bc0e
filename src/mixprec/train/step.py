"""One training step: ``TrainStep`` and ``build_train_step`` (MindSpore's
``build_train_network``).

Composition only: the model is prepared by ``auto_mixed_precision`` and the optimizer step
(scaling, unscaling, skip on overflow, float32 masters) is ``LossScaleOptimizer``'s.

    step = build_train_step(model, torch.optim.SGD(model.parameters(), 0.1), "cross_entropy",
                            policy="mixed_float16")
    loss, result = step(x, y)  # result.applied: False when an overflow skipped the step
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from mixprec._calling import call
from mixprec._compile import CompileOption, compile_options, compile_step
from mixprec._errors import ArgumentError
from mixprec.levels import applied, auto_mixed_precision, resolve_level
from mixprec.optim import LossScaleOptimizer, StepResult
from mixprec.policy import PolicyLike, get_policy
from mixprec.scaling import LossScaler
from mixprec.train.metrics import LossFn, get_loss


class TrainStep:
    """One training step: zero grads, forward, loss, scaled backward, step.

    ``step(x, y) -> (loss, StepResult)``; the loss is detached and ``last_output`` holds the
    detached model output (for metrics). With ``compile``, the forward and the loss run as one
    ``torch.compile``'d function (so inductor fuses the output's upcast into the loss); the
    loss scaling and the optimizer step run outside the graph, so a new scale, a skipped step
    or an accumulation micro-step compile nothing new."""

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
        options = compile_options(compile)
        self._forward_loss = (
            self._forward_and_loss
            if options is None
            else compile_step(self._forward_and_loss, options, model)
        )
        # Under CUDA graphs (reduce-overhead, max-autotune, the cudagraphs backend, inductor's
        # global or environment setting) the next replay overwrites this step's loss, and
        # torch raises where a caller kept it (a list of losses). Which options record graphs
        # is not all in `compile`: every compiled step copies its loss out (one value).
        self._copy_loss = options is not None

    def _forward_and_loss(self, x: Any, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        output = call(self.model, x)
        return self.loss_fn(output, y), output

    def __call__(self, x: Any, y: torch.Tensor) -> tuple[torch.Tensor, StepResult]:
        self.optimizer.zero_grad()
        loss, output = self._forward_loss(x, y)
        self.optimizer.backward(loss)
        result = self.optimizer.step()
        self.last_output = output.detach()
        return (loss.detach().clone() if self._copy_loss else loss.detach()), result


def build_train_step(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    loss_fn: str | LossFn,
    policy: PolicyLike = None,
    level: str = "auto",
    loss_scaler: LossScaler | None = None,
    max_grad_norm: float | None = None,
    accumulation_steps: int = 1,
    trace_overflow: bool = False,
    compile: CompileOption = False,
) -> TrainStep:
    """Prepare ``model`` (unless ``auto_mixed_precision`` was already applied) and wrap
    ``optimizer`` (unless it is a ``LossScaleOptimizer``); return the step callable.

    ``compile``: ``True`` or a dict of ``torch.compile`` options compiles the forward and
    the loss together (see ``TrainStep``)."""
    compile_options(compile)  # a bad value fails before the model is changed
    done = applied(model)
    if done is None:
        auto_mixed_precision(model, policy, level)
    elif (policy is not None and get_policy(policy) != done.policy) or (
        level != "auto" and resolve_level(level, done.policy) != done.level
    ):
        raise ArgumentError(
            f"the model was already prepared with policy {done.policy.name}, level "
            f"{done.level}; build_train_step(policy={policy!r}, level={level!r}) cannot change "
            "that: build the model again, or leave policy=None and level='auto'"
        )
    if not isinstance(optimizer, LossScaleOptimizer):
        optimizer = LossScaleOptimizer(
            optimizer, loss_scaler, max_grad_norm, accumulation_steps, trace_overflow
        )
    return TrainStep(model, optimizer, get_loss(loss_fn), compile)
