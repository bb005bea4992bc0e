"""The Trainer's passes without training: ``evaluate``, ``predict`` and the one-sample look
at the number of classes, each in evaluation mode and without gradients, leaving the model
in the mode it was in."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from mixprec import distributed
from mixprec._calling import call
from mixprec.train import batches
from mixprec.train.batches import to_device
from mixprec.train.metrics import class_dim, counted
from mixprec.train.step import model_output

if TYPE_CHECKING:
    from mixprec.train.trainer import Trainer

__all__ = ["count_classes", "eval_mode", "evaluate", "predict"]


@contextlib.contextmanager
def eval_mode(model: nn.Module) -> Iterator[None]:
    """Evaluation mode, then the mode the model was in: ``evaluate`` called from a
    callback mid-epoch must not leave dropout off for the rest of the epoch."""
    was_training = model.training
    model.eval()
    try:
        yield
    finally:
        model.train(was_training)


def count_classes(trainer: Trainer, inputs: torch.Tensor) -> int:
    """One sample in eval mode tells the number of classes (train mode would update
    BatchNorm statistics and reject a batch of one)."""
    with torch.no_grad(), eval_mode(trainer.model):
        output = model_output(call(trainer.model, to_device(inputs, trainer.device)))
    return int(output.shape[class_dim(trainer.loss_fn, output)])


def evaluate(trainer: Trainer, x: Any, y: Any, batch_size: int) -> dict[str, float]:
    """Mean loss and metrics over ``(x, y)`` or an iterable of batches (checked already),
    weighted by each batch's samples (its kept labels, under a cross-entropy:
    ``metrics.counted``); under torchrun over every rank's share."""
    x, y = batches.rank_share(x, y)  # under torchrun each rank evaluates its share
    epoch_batches, _, _ = batches.epoch_batches(
        x, y, batch_size, shuffle=False, split=False, device=trainer.device
    )
    sums = dict.fromkeys(["loss", *trainer.metrics], 0.0)
    samples = 0
    with torch.no_grad(), eval_mode(trainer.model):
        for batch in epoch_batches():
            xb, yb = batches.xy(batch, trainer.device)
            if batches.is_empty(yb):  # its mean loss is NaN: no samples to count
                continue
            output = model_output(call(trainer.model, xb)).float()
            size = counted(trainer.loss_fn, yb)  # labels kept, under a cross-entropy
            if size == 0:  # padding alone: its mean loss is NaN
                continue
            sums["loss"] += float(trainer.loss_fn(output, yb)) * size
            for name, fn in trainer.metrics.items():
                sums[name] += float(fn(output, yb)) * size
            samples += size
    totals = distributed.all_reduce_sum([float(samples), *sums.values()])
    if totals[0] == 0:
        raise ValueError("evaluate: the data is empty (0 samples)")
    return {k: v / totals[0] for k, v in zip(sums, totals[1:], strict=True)}


def predict(model: nn.Module, device: torch.device, x: Any, batch_size: int) -> torch.Tensor:
    """The model's outputs in float32, on the CPU, for tensors/arrays or batches."""
    outputs = []
    with torch.no_grad(), eval_mode(model):
        for chunk in batches.inputs_of(x, batch_size):
            output = model_output(call(model, to_device(chunk, device)))
            outputs.append(output.float().cpu())
    return torch.cat(outputs) if outputs else torch.empty(0)
