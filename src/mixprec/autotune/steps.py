"""Whole training steps under a plan: forward, loss, backward and the optimizer step through
``LossScaleOptimizer``, eager or compiled as the user will train. ``autotune`` times them
(the search) and trains with them (the check)."""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch
from torch import nn

from mixprec._calling import call
from mixprec._compile import compile_step
from mixprec.autotune.plan import Plan
from mixprec.levels import auto_mixed_precision
from mixprec.optim import LossScaleOptimizer

__all__ = ["OptimizerFactory", "default_optimizer", "make_step"]

OptimizerFactory = Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer]


def default_optimizer(params: Iterable[nn.Parameter]) -> torch.optim.Optimizer:
    """SGD at learning rate 0.01 (``mixprec bench``'s optimizer)."""
    return torch.optim.SGD(params, lr=0.01)


def make_step(
    model: nn.Module,
    dtypes: Mapping[str, str],
    level: str,
    batch: tuple[Any, Any],
    loss_fn: Callable[[Any, Any], torch.Tensor],
    optimizer: OptimizerFactory,
    compile_options: dict[str, Any] | None,
) -> Callable[[], float]:
    """A training step on a copy of ``model`` (its initial weights) under the plan
    ``dtypes`` at ``level``; each call trains one step on ``batch`` and returns the loss."""
    planned = auto_mixed_precision(
        copy.deepcopy(model), plan=Plan.from_dtypes(dict(dtypes), level=level)
    )
    opt = LossScaleOptimizer(optimizer(planned.parameters()))
    inputs, targets = batch

    def forward_loss() -> torch.Tensor:
        return loss_fn(call(planned, inputs), targets)

    if compile_options is not None:
        forward_loss = compile_step(forward_loss, compile_options, planned)

    def step() -> float:
        opt.zero_grad(set_to_none=True)
        loss = forward_loss()
        opt.backward(loss)
        opt.step()
        return float(loss.detach())

    return step
