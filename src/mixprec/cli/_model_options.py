"""The options ``train`` and ``doctor`` share: which model, data, policy, level and batch
size; their checks, and the data and model they name."""

from __future__ import annotations

import argparse

import torch

from mixprec import data as datasets
from mixprec import models
from mixprec.cli._common import UsageError, choice, policy_option
from mixprec.levels import LEVELS
from mixprec.policy import NAMES

TRAIN_MODELS = ("mlp", "cnn")  # the classification models of mixprec.models
DATA = ("digits", "mnist:DIR", "synthetic")


def add_model_options(sub: argparse.ArgumentParser, policy: str, batch_size: int) -> None:
    """Add the shared options, with the command's own default policy and batch size."""
    sub.add_argument("--model", default="mlp", help=f"one of {', '.join(TRAIN_MODELS)}")
    sub.add_argument("--data", default="digits", help=f"one of {', '.join(DATA)}")
    sub.add_argument("--policy", default=policy, help=f"one of {', '.join(NAMES)}")
    sub.add_argument("--level", default="auto", help="O0, O1, O2, O3 or auto")
    sub.add_argument("--batch-size", type=int, default=batch_size)
    sub.add_argument("--seed", type=int, default=0)


def check_model_options(args: argparse.Namespace) -> None:
    """Refuse a bad shared option before any data is loaded."""
    choice("model", args.model, TRAIN_MODELS)
    if args.data not in ("digits", "synthetic") and not args.data.startswith("mnist:"):
        choice("data", args.data, DATA)
    policy_option("policy", args.policy)
    if args.level.upper() not in (*LEVELS, "AUTO"):
        choice("level", args.level, [*LEVELS, "auto"])
    if args.batch_size < 1:
        raise UsageError(f"--batch-size must be >= 1, got {args.batch_size}")


def load_data(data: str, seed: int) -> tuple[tuple[torch.Tensor, torch.Tensor], ...]:
    """``(x_train, y_train), (x_test, y_test)`` of the ``--data`` named."""
    if data == "digits":
        return datasets.load_digits(seed=seed)
    if data.startswith("mnist:"):
        return datasets.load_mnist(data.removeprefix("mnist:"))
    if data == "synthetic":
        x, y = datasets.synthetic_classification(n=2048, seed=seed)
        cut = int(0.8 * len(x))
        return (x[:cut], y[:cut]), (x[cut:], y[cut:])
    raise UsageError(f"unknown data {data!r}; valid: {', '.join(DATA)}")


def build_model(model: str, x: torch.Tensor, classes: int, hidden: int = 512) -> torch.nn.Module:
    """The ``--model`` named, shaped for inputs like ``x`` and ``classes`` outputs; ``hidden``
    is the MLP's width."""
    if model == "mlp":
        return models.mlp(input_shape=tuple(x.shape[1:]), hidden=hidden, classes=classes)
    if x.dim() != 3:
        raise UsageError(f"model 'cnn' needs image data (n, H, W); this data is {tuple(x.shape)}")
    return models.cnn(in_channels=1, classes=classes)
