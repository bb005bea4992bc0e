"""The checks of ``LossScaleOptimizer``'s constructor arguments, each refused with the
argument, the value and what is valid, before anything is built."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from mixprec._errors import ArgumentError, shown
from mixprec.scaling import LossScaler
from mixprec.trace import models_of

__all__ = ["checked_arguments", "checked_options", "traced_model"]


def checked_arguments(
    optimizer: torch.optim.Optimizer | Sequence[torch.optim.Optimizer],
    loss_scaler: LossScaler | None,
    max_grad_norm: float | None,
    accumulation_steps: int,
    trace_overflow: bool | nn.Module = False,
    keep_grad_buffers: bool = False,
) -> list[torch.optim.Optimizer]:
    """The inner optimizers as a list, once every constructor argument is valid: checked
    before any group is adopted, so that a refusal leaves the torch optimizers as they were
    (one refused half way held detached masters, and its own step then moved nothing)."""
    optimizers = [optimizer] if isinstance(optimizer, torch.optim.Optimizer) else optimizer
    if not isinstance(optimizers, (list, tuple)) or not optimizers:
        raise ArgumentError(
            "optimizer must be a torch.optim.Optimizer or a non-empty list of them, got "
            f"{type(optimizer).__name__}"
        )
    for k, inner in enumerate(optimizers):
        if not isinstance(inner, torch.optim.Optimizer):
            raise ArgumentError(
                f"optimizer must be a torch.optim.Optimizer, got {type(inner).__name__}"
            )
        if any(inner is other for other in optimizers[:k]):
            raise ArgumentError(
                f"optimizer lists the same {type(inner).__name__} twice (at {k} and at "
                f"{next(i for i, o in enumerate(optimizers) if o is inner)}); list it once"
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
    checked_options(
        loss_scaler, max_grad_norm, accumulation_steps, trace_overflow, keep_grad_buffers
    )
    return list(optimizers)


def checked_options(
    loss_scaler: LossScaler | None,
    max_grad_norm: float | None,
    accumulation_steps: int,
    trace_overflow: bool | nn.Module = False,
    keep_grad_buffers: bool = False,
) -> None:
    """Refuse a bad ``LossScaleOptimizer`` option, naming it; ``build_train_step`` and the
    ``Trainer`` check them before they prepare the model."""
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
    if not isinstance(trace_overflow, (bool, nn.Module)):
        raise ArgumentError(
            f"trace_overflow={shown(trace_overflow)} is invalid; use True, False or the model "
            "(an nn.Module)"
        )
    if not isinstance(keep_grad_buffers, bool):
        raise ArgumentError(f"keep_grad_buffers must be True or False, got {keep_grad_buffers!r}")


def traced_model(
    trace_overflow: bool | nn.Module, params: list[torch.Tensor]
) -> list[nn.Module] | None:
    """The models ``trace_overflow`` asks to trace (``None``: no tracing): the one given,
    or with ``True`` every prepared model over ``params`` (one optimizer over two models
    traced the first alone, unsaid); refused before anything is built where ``True``
    finds none."""
    if trace_overflow is False:
        return None
    models = [trace_overflow] if isinstance(trace_overflow, nn.Module) else models_of(params)
    if not models:
        raise ArgumentError(
            "trace_overflow=True: pass the model (trace_overflow=model) unless it was "
            "prepared with auto_mixed_precision"
        )
    return models
