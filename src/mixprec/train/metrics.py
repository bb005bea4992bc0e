"""Metrics and losses by name, computed in float32 on the model's outputs."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from mixprec._dtypes import closest
from mixprec._errors import ArgumentError

Metric = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def accuracy(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Mean of correct predictions: argmax over classes, or logit > 0 for one output."""
    if output.dim() == target.dim() + 1:
        predicted = output.argmax(dim=-1)
    else:
        predicted = (output > 0).to(target.dtype)
    return (predicted == target).float().mean()


def mae(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return (output.float() - target.float()).abs().mean()


def mse(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return (output.float() - target.float()).pow(2).mean()


METRICS: dict[str, Metric] = {"accuracy": accuracy, "acc": accuracy, "mae": mae, "mse": mse}


def _bce_with_logits(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.binary_cross_entropy_with_logits(output, target.to(output.dtype))


LOSSES: dict[str, LossFn] = {
    "cross_entropy": F.cross_entropy,
    "sparse_categorical_crossentropy": F.cross_entropy,  # the Keras name
    "mse": F.mse_loss,
    "mean_squared_error": F.mse_loss,
    "mae": F.l1_loss,
    "binary_crossentropy": _bce_with_logits,
}


def get_metric(metric: str | Metric) -> tuple[str, Metric]:
    """``(name, function)`` for a metric name or a callable ``(output, target) -> scalar``."""
    if callable(metric):
        return getattr(metric, "__name__", type(metric).__name__), metric
    if isinstance(metric, str) and metric in METRICS:
        return ("accuracy" if metric == "acc" else metric), METRICS[metric]
    hint = closest(str(metric), list(METRICS))
    raise ArgumentError(
        f"metrics entry {metric!r} is not a known metric; valid: {', '.join(METRICS)} or a "
        "callable (output, target) -> scalar" + (f" (closest: {hint!r})" if hint else "")
    )


def get_loss(loss: str | LossFn) -> LossFn:
    """A loss function from a name or a callable (``nn.Module`` losses included)."""
    if callable(loss):
        return loss
    if isinstance(loss, str) and loss in LOSSES:
        return LOSSES[loss]
    hint = closest(str(loss), list(LOSSES))
    raise ArgumentError(
        f"loss={loss!r} is not a known loss; valid: {', '.join(LOSSES)} or a callable "
        "(output, target) -> scalar" + (f" (closest: {hint!r})" if hint else "")
    )
