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


def same_shape(
    output: torch.Tensor, target: torch.Tensor, what: str
) -> tuple[torch.Tensor, torch.Tensor]:
    """``output`` and ``target`` of one shape, for a loss or metric that compares them
    element by element: as Keras does, a trailing dimension of 1 on one side (a model with
    one output, ``(N, 1)``, and targets ``(N,)``) is squeezed. Any other difference is a
    ``ValueError``: broadcasting would compare every output with every target."""
    if output.shape != target.shape:
        if output.dim() == target.dim() + 1 and output.shape[-1] == 1:
            output = output.squeeze(-1)
        elif target.dim() == output.dim() + 1 and target.shape[-1] == 1:
            target = target.squeeze(-1)
        if output.shape != target.shape:
            raise ValueError(
                f"{what}: the model's output has shape {tuple(output.shape)} and the targets "
                f"{tuple(target.shape)}; it compares them element by element, so they must "
                "have one shape (up to a trailing dimension of 1)"
            )
    return output, target


def mae(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    output, target = same_shape(output, target, "metric 'mae'")
    return (output.float() - target.float()).abs().mean()


def mse(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    output, target = same_shape(output, target, "metric 'mse'")
    return (output.float() - target.float()).pow(2).mean()


METRICS: dict[str, Metric] = {"accuracy": accuracy, "acc": accuracy, "mae": mae, "mse": mse}


def _bce_with_logits(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    output, target = same_shape(output, target, "loss 'binary_crossentropy'")
    return F.binary_cross_entropy_with_logits(output, target.to(output.dtype))


def _mse_loss(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.mse_loss(*same_shape(output, target, "loss 'mse'"))


def _l1_loss(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.l1_loss(*same_shape(output, target, "loss 'mae'"))


LOSSES: dict[str, LossFn] = {
    "cross_entropy": F.cross_entropy,
    "sparse_categorical_crossentropy": F.cross_entropy,  # the Keras name
    "mse": _mse_loss,
    "mean_squared_error": _mse_loss,
    "mae": _l1_loss,
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
