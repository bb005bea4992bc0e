"""The options ``train`` and ``doctor`` share: which model, data, policy, level, batch size
and seed; their checks; and the data and model they name, a user's ``module:function``
factory included.

A user's ``--model module:function`` is called with no arguments and returns a
``torch.nn.Module`` whose forward takes a batch of the data's ``x`` and returns
``(batch, classes)`` logits (a tuple's first item, or a mapping's ``logits``, as the
Trainer takes them). A user's ``--data module:function`` is called with no arguments and
returns ``(x, y)`` (the last 20% of a fixed permutation from ``--seed`` is the test set, as
for ``digits``), ``((x_train, y_train), (x_test, y_test))`` as ``keras.datasets``'
``load_data()`` does, or a map-style ``torch.utils.data.Dataset`` of ``(x, y)`` samples
(stacked, then split as ``(x, y)``); tensors or numpy arrays, ``y`` integer class labels.
Floating ``x`` is cast to float32, ``y`` to int64. Both are checked, the model by a forward
on two samples of the data, before any training, each bad spec one line.
"""

from __future__ import annotations

import argparse
import os
import sys
import textwrap
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from mixprec import data as datasets
from mixprec import models
from mixprec._errors import ArgumentError
from mixprec.cli._common import UsageError, choice, policy_option
from mixprec.levels import LEVELS
from mixprec.policy import NAMES
from mixprec.train.step import model_output

TRAIN_MODELS = ("mlp", "cnn")  # the classification models of mixprec.models
DATA = ("digits", "mnist:DIR", "synthetic")
SPEC = "module:function"
MODEL_FACTORY = "a function that takes no arguments and returns a torch.nn.Module"
DATA_FACTORY = (
    "a function that takes no arguments and returns (x, y), ((x_train, y_train), "
    "(x_test, y_test)) or a map-style torch Dataset of (x, y) samples"
)
TEST_FRACTION = 0.2  # of a user's (x, y) or Dataset: the test set, as for digits

# The epilog of ``train --help`` and ``doctor --help``: one paragraph an option.
SPEC_HELP = "\n".join(
    textwrap.fill(paragraph, 79, subsequent_indent="  ")
    for paragraph in (
        f"--model module:function: {MODEL_FACTORY}, whose forward takes a batch of the "
        "data's x and returns (batch, classes) logits.",
        f"--data module:function: {DATA_FACTORY}; tensors or numpy arrays, y integer class "
        "labels. (x, y) and a Dataset are split as digits is: the last 20% of a fixed "
        "permutation from --seed is the test set.",
        "The module is imported as Python imports any: its directory must be on sys.path "
        "(PYTHONPATH=. mixprec ..., or python -m mixprec ... from that directory).",
    )
)

Splits = tuple[tuple[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]


def add_model_options(sub: argparse.ArgumentParser, policy: str, batch_size: int) -> None:
    """Add the shared options, with the command's own default policy and batch size."""
    sub.add_argument(
        "--model", default="mlp", metavar=f"NAME|{SPEC}",
        help=f"the model: {' or '.join(TRAIN_MODELS)} (mixprec.models), or a {SPEC} of "
        "yours returning a torch.nn.Module (below)",
    )  # fmt: skip
    sub.add_argument(
        "--data", default="digits", metavar=f"NAME|{SPEC}",
        help="the data: digits (scikit-learn's bundled 8x8 digits), mnist:DIR (MNIST's IDX "
        f"files in DIR), synthetic (random, 2048 samples), or a {SPEC} of yours (below)",
    )  # fmt: skip
    sub.add_argument(
        "--policy", default=policy, help=f"the precision policy: {', '.join(NAMES)}, or "
        "params=...,compute=...,output=..."
    )  # fmt: skip
    sub.add_argument(
        "--level", default="auto", help="the optimization level: O0, O1, O2, O3, or auto "
        "(the policy's own)"
    )  # fmt: skip
    sub.add_argument(
        "--batch-size", type=int, default=batch_size, metavar="N", help="samples per batch"
    )
    sub.add_argument(
        "--seed", type=int, default=0, metavar="N", help="seeds the model's weights and the "
        "data's split"
    )  # fmt: skip


def is_spec(value: str) -> bool:
    """Whether a ``--model`` or ``--data`` value names a user's ``module:function``."""
    return ":" in value and not value.startswith("mnist:")


def check_model_options(args: argparse.Namespace) -> None:
    """Refuse a bad shared option before any data is loaded; a ``module:function`` must
    name a function that can be called with no arguments (it is not called here)."""
    check_model_and_data(args)
    policy_option("policy", args.policy)
    if args.level.upper() not in (*LEVELS, "AUTO"):
        choice("level", args.level, [*LEVELS, "auto"])


def check_model_and_data(args: argparse.Namespace) -> None:
    """``--model``, ``--data`` and ``--batch-size`` of ``check_model_options``, for commands
    without ``--policy``/``--level`` (``autotune``)."""
    if is_spec(args.model):
        load_factory("--model", args.model, MODEL_FACTORY)
    else:
        _name_or_spec("model", args.model, TRAIN_MODELS)
    if is_spec(args.data):
        load_factory("--data", args.data, DATA_FACTORY)
    elif args.data not in ("digits", "synthetic") and not args.data.startswith("mnist:"):
        _name_or_spec("data", args.data, DATA)
    elif args.data == "mnist:":  # not the current directory, searched without a word
        raise UsageError("--data mnist: needs the directory of MNIST's IDX files: mnist:DIR")
    elif args.data.startswith("mnist:") and not os.path.isdir(args.data.removeprefix("mnist:")):
        raise UsageError(  # named as typed, not as the loader's path=
            f"--data {args.data!r}: {args.data.removeprefix('mnist:')!r} is not a directory; "
            "give mnist:DIR, DIR holding MNIST's IDX files"
        )
    if args.model == "cnn" and args.data == "synthetic":  # before any run starts
        raise UsageError(
            "--model cnn needs image data (n, H, W); --data synthetic is feature vectors: "
            "give --data digits or mnist:DIR, or --model mlp"
        )
    if args.batch_size < 1:
        raise UsageError(f"--batch-size must be >= 1, got {args.batch_size}")
    if not 0 <= args.seed < 2**63:
        raise UsageError(f"--seed must be an int in [0, 2**63), got {args.seed}")


def _name_or_spec(kind: str, value: str, names: tuple[str, ...]) -> None:
    """``value`` is one of ``names``; else one line listing them and ``module:function``,
    with the spec meant where ``value`` is a dotted name (``mymodels.net``)."""
    module, dot, func = value.rpartition(".")
    if dot and module and func.isidentifier():
        raise UsageError(
            f"unknown {kind} {value!r}; valid: {', '.join(names)} or {SPEC} "
            f"(did you mean {module + ':' + func!r}?)"
        )
    choice(kind, value, [*names, SPEC])


def load_factory(option: str, spec: str, returns: str) -> Callable[[], object]:
    """The function a ``module:function`` spec names, found as ``mixprec bench`` finds a
    workload's (``mixprec.bench.workload_factory``: import, look up, callable without
    arguments); else one line naming ``option``, the spec, why, and what ``returns``."""
    module, _, func = spec.partition(":")
    if not module or not func:
        raise UsageError(f"{option} {spec!r}: give {SPEC}, {returns}")
    from mixprec.bench import workload_factory  # the bench package loads only for a spec

    try:
        return workload_factory(spec)
    except ArgumentError as err:
        reason = str(err).removeprefix(f"workload {spec!r}: ").split("; give ")[0]
    found = getattr(sys.modules.get(module), func, None)
    if found is not None and not callable(found):
        reason = f"{module}.{func} is not a function (it is a {type(found).__name__})"
    elif reason.startswith("cannot import") and "(No module named " in reason:
        reason += " (its directory must be on sys.path: PYTHONPATH=DIR)"
    raise UsageError(f"{option} {spec!r}: {reason}; give {returns}")


def call_factory(option: str, spec: str, returns: str) -> Any:
    """What the ``module:function`` named by ``spec`` returns; an exception raised as it
    runs is one line naming ``option``, not the user's traceback."""
    from mixprec.bench.workloads import call_factory as call

    try:
        return call(spec, load_factory(option, spec, returns), f"{option} {spec!r}")
    except ArgumentError as err:
        raise UsageError(str(err)) from None


def load_data(data: str, seed: int) -> Splits:
    """``(x_train, y_train), (x_test, y_test)`` of the ``--data`` named."""
    if is_spec(data):
        return _user_data(data, seed)
    if data == "digits":
        return datasets.load_digits(seed=seed)
    if data.startswith("mnist:"):
        try:
            return datasets.load_mnist(data.removeprefix("mnist:"))
        except (OSError, ValueError) as err:  # a missing or malformed file: which --data
            raise UsageError(f"--data {data!r}: {err}") from None
    if data == "synthetic":
        x, y = datasets.synthetic_classification(n=2048, seed=seed)
        cut = int(0.8 * len(x))
        return (x[:cut], y[:cut]), (x[cut:], y[cut:])
    raise UsageError(f"unknown data {data!r}; valid: {', '.join(DATA)} or {SPEC}")


def classes_of(splits: Splits) -> int:
    """The number of classes: the largest label of either split, plus one."""
    (_, y_train), (_, y_test) = splits
    return int(max(y_train.max(), y_test.max())) + 1


def build_model(
    model: str, x: torch.Tensor, classes: int, hidden: int = 512, data: str = "digits"
) -> nn.Module:
    """The ``--model`` named, shaped for inputs like ``x`` and ``classes`` outputs; ``hidden``
    is the MLP's width. A user's model is checked by a forward on two samples of ``x``
    (the ``--data`` named ``data``)."""
    if is_spec(model):
        module, _, func = model.partition(":")
        made = call_factory("--model", model, MODEL_FACTORY)
        if not isinstance(made, nn.Module):
            raise UsageError(
                f"--model {model!r}: {module}.{func}() returned {type(made).__name__}, not a "
                f"torch.nn.Module; give {MODEL_FACTORY}"
            )
        _check_forward(model, made, x, classes, data)
        return made
    if model == "mlp":
        return models.mlp(input_shape=tuple(x.shape[1:]), hidden=hidden, classes=classes)
    if x.dim() != 3:
        raise UsageError(
            f"--model cnn needs image data (n, H, W); --data {data} is {tuple(x.shape)}: give "
            "--data digits or mnist:DIR, or --model mlp"
        )
    return models.cnn(in_channels=1, classes=classes)


def _check_forward(spec: str, model: nn.Module, x: torch.Tensor, classes: int, data: str) -> None:
    """A forward of two samples, in eval mode and without gradients (no BatchNorm statistic
    or weight changes): it runs, and returns ``(2, >= classes)`` logits."""
    sample = x[:2].to(next(model.parameters(), x).device)
    what = f"--model {spec!r} on --data {data!r} (a batch of shape {tuple(sample.shape)})"
    training = {m: m.training for m in model.modules()}
    try:
        with torch.no_grad():
            model.eval()
            output = model(sample)
    except Exception as err:
        first = (str(err).strip().splitlines() or [""])[0]
        raise UsageError(f"{what}: its forward raised {type(err).__name__}: {first}") from None
    finally:
        for module, mode in training.items():
            module.training = mode
    try:
        logits = model_output(output)
    except (TypeError, ValueError) as err:
        raise UsageError(f"{what}: {err}") from None
    shape = tuple(logits.shape)
    if len(shape) != 2 or shape[0] != len(sample) or shape[1] < classes:
        raise UsageError(
            f"{what}: the forward returned shape {shape}; the loss is cross-entropy over the "
            f"data's {classes} classes, so give ({len(sample)}, {classes}) logits"
        )


def _user_data(spec: str, seed: int) -> Splits:
    """The splits a ``--data module:function`` returns (see the module's docstring)."""
    module, _, func = spec.partition(":")
    made = call_factory("--data", spec, DATA_FACTORY)
    returned = f"--data {spec!r}: {module}.{func}() returned"
    if isinstance(made, torch.utils.data.DataLoader):
        raise UsageError(
            f"{returned} a DataLoader; return its Dataset (loader.dataset): --batch-size batches it"
        )
    if isinstance(made, torch.utils.data.IterableDataset):
        raise UsageError(f"{returned} an IterableDataset; give {DATA_FACTORY}")
    if isinstance(made, torch.utils.data.Dataset):
        made = _stacked(spec, made)
    if not isinstance(made, (tuple, list)) or len(made) != 2:
        raise UsageError(f"{returned} {_kind(made)}; give {DATA_FACTORY}")
    if all(isinstance(part, tuple) and len(part) == 2 for part in made):
        (x, y), (x_test, y_test) = made
        splits = (_tensors(spec, "train", x, y), _tensors(spec, "test", x_test, y_test))
    else:
        x, y = _tensors(spec, "", *made)
        if len(x) < 2:
            raise UsageError(f"{returned} {len(x)} sample(s); the split needs at least 2")
        n_test = min(max(round(len(x) * TEST_FRACTION), 1), len(x) - 1)
        order = torch.randperm(len(x), generator=torch.Generator().manual_seed(seed))
        train, test = order[: len(x) - n_test], order[len(x) - n_test :]
        splits = ((x[train], y[train]), (x[test], y[test]))
    return splits


def _stacked(spec: str, dataset: torch.utils.data.Dataset[Any]) -> tuple[Any, Any]:
    """A map-style Dataset's ``(x, y)`` samples, stacked into two tensors."""
    try:
        samples = [dataset[i] for i in range(len(dataset))]  # type: ignore[arg-type]
        x, y = torch.utils.data.default_collate(samples)
    except Exception as err:
        first = (str(err).strip().splitlines() or [""])[0]
        raise UsageError(
            f"--data {spec!r}: its Dataset's samples do not stack into (x, y) tensors "
            f"({type(err).__name__}: {first}); give {DATA_FACTORY}"
        ) from None
    return x, y


def _tensors(spec: str, split: str, x: Any, y: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` and ``y`` as tensors (floating x in float32, y int64), checked as a classifier's
    data (``mixprec.data.validate_classification``)."""
    name = f"--data {spec!r}" + (f" ({split} split)" if split else "")
    try:
        x, y = torch.as_tensor(x), torch.as_tensor(y)
    except (TypeError, ValueError, RuntimeError):
        raise UsageError(
            f"{name}: x and y must be tensors or arrays, got {_kind(x)} and {_kind(y)}"
        ) from None
    try:
        datasets.validate_classification(x, y, name=name)
    except (TypeError, ValueError) as err:
        raise UsageError(str(err)) from None
    if y.dim() != 1:
        raise UsageError(f"{name}: y must hold one class label a sample, got shape "
                         f"{tuple(y.shape)}")  # fmt: skip
    return (x.float() if x.is_floating_point() else x), y.long()


def _kind(value: object) -> str:
    """What a factory returned, for an error: its type, and a tuple's length."""
    if isinstance(value, (tuple, list)):
        return f"a {type(value).__name__} of {len(value)}"
    return type(value).__name__
