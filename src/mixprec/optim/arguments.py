"""The checks of ``LossScaleOptimizer``'s constructor arguments, each refused with the
argument, the value and what is valid, before anything is built."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from mixprec._errors import ArgumentError, shown
from mixprec.scaling import LossScaler
from mixprec.trace import OverflowTracer, model_of

__all__ = ["checked_arguments", "make_tracer"]


def checked_arguments(
    optimizer: torch.optim.Optimizer | Sequence[torch.optim.Optimizer],
    loss_scaler: LossScaler | None,
    max_grad_norm: float | None,
    accumulation_steps: int,
) -> list[torch.optim.Optimizer]:
    """The inner optimizers as a list, once every constructor argument is valid."""
    optimizers = [optimizer] if isinstance(optimizer, torch.optim.Optimizer) else optimizer
    if not isinstance(optimizers, (list, tuple)) or not optimizers:
        raise ArgumentError(
            "optimizer must be a torch.optim.Optimizer or a non-empty list of them, got "
            f"{type(optimizer).__name__}"
        )
    for inner in optimizers:
        if not isinstance(inner, torch.optim.Optimizer):
            raise ArgumentError(
                f"optimizer must be a torch.optim.Optimizer, got {type(inner).__name__}"
            )
        if isinstance(inner, torch.optim.LBFGS):
            # Its step re-evaluates the loss through a closure, many times a step: no
            # scaled backward or skip decision fits it (torch's raw TypeError at the first
            # step without one).
            raise ArgumentError(
                "optimizer=LBFGS is not supported: its step calls a closure that re-runs "
                "the forward and backward, which a loss-scaled step cannot wrap; step "
                "torch.optim.LBFGS itself on a float32 model (no LossScaleOptimizer, no "
                "Trainer), or use a first-order optimizer"
            )
    if loss_scaler is not None and not isinstance(loss_scaler, LossScaler):
        raise ArgumentError(
            "loss_scaler must be a NoOpLossScaler, StaticLossScaler or DynamicLossScaler, "
            f"got {type(loss_scaler).__name__}"
        )
    if max_grad_norm is not None and (
        isinstance(max_grad_norm, bool)
        or not isinstance(max_grad_norm, (int, float))
        or not 0 < max_grad_norm < torch.finfo(torch.float64).max  # 10**400 too
    ):
        raise ArgumentError(
            f"max_grad_norm={shown(max_grad_norm)} is invalid; use a finite number > 0 or None"
        )
    if isinstance(accumulation_steps, bool) or not isinstance(accumulation_steps, int):
        raise ArgumentError(f"accumulation_steps must be an int, got {accumulation_steps!r}")
    if accumulation_steps < 1:
        raise ArgumentError(
            f"accumulation_steps={accumulation_steps!r} is invalid; it must be >= 1"
        )
    return list(optimizers)


def make_tracer(
    trace_overflow: bool | nn.Module, params: list[torch.Tensor]
) -> OverflowTracer | None:
    if trace_overflow is False:
        return None  # no hooks at all: tracing off costs nothing
    model = trace_overflow if isinstance(trace_overflow, nn.Module) else model_of(params)
    if model is None or (trace_overflow is not True and not isinstance(trace_overflow, nn.Module)):
        raise ArgumentError(
            f"trace_overflow={trace_overflow!r}: pass the model (trace_overflow=model) "
            "unless it was prepared with auto_mixed_precision"
        )
    return OverflowTracer(model)
