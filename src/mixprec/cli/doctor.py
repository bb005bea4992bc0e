"""``mixprec doctor``: per-layer numerics of one batch in 16 bits (or float8) against
float32, for the model and data ``train`` takes."""

from __future__ import annotations

import argparse

import torch

from mixprec._atomic import write_text_atomically
from mixprec.cli._common import UsageError, output_file, plot_file, train_float8
from mixprec.cli._model_options import (
    SPEC_HELP,
    add_model_options,
    build_model,
    check_model_options,
    classes_of,
    load_data,
)
from mixprec.doctor import Report, diagnose
from mixprec.policy import Policy

HELP = "per-layer numerics of one batch in 16 bits against float32"
EPILOG = SPEC_HELP  # what --model and --data module:function must name
MEMORY_HINT = "a smaller --batch-size"  # said where an allocation fails


def add_arguments(sub: argparse.ArgumentParser) -> None:
    """The options of ``mixprec doctor``."""
    add_model_options(sub, policy="mixed_float16", batch_size=256)
    sub.add_argument("--json", metavar="FILE", help="write the report as JSON")
    sub.add_argument("--plot", metavar="FILE.png", help="plot per-layer ranges")


def run(args: argparse.Namespace) -> int:
    """Diagnose one batch of the chosen data with the chosen (untrained) model."""
    check_model_options(args)
    torch.manual_seed(args.seed)
    json_path = output_file("--json", args.json) if args.json is not None else None
    plot_path = plot_file("--plot", args.plot) if args.plot is not None else None
    is_float8 = Policy(args.policy).float8_recipe is not None
    if is_float8 and plot_path:
        raise UsageError("--plot: the float8 doctor's report is a table; use --json")
    splits = load_data(args.data, args.seed)
    (x_train, y_train), _ = splits
    model = build_model(args.model, x_train, classes_of(splits), data=args.data)
    x, y = x_train[: args.batch_size], y_train[: args.batch_size]
    loss_fn = torch.nn.functional.cross_entropy
    float8 = None
    if is_float8:
        float8 = train_float8(None)  # as `mixprec train` converts: the head kept
    report = diagnose(model, x, y, loss_fn, args.policy, args.level, float8=float8)
    print(report)
    if json_path:
        write_text_atomically(json_path, report.to_json(indent=2))
        print(f"report written to {json_path}")
    if plot_path and isinstance(report, Report):
        report.plot(plot_path)
        print(f"ranges plotted to {plot_path}")
    return 0
