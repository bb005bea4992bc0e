"""``mixprec autotune``: each layer's dtype chosen by its measured speed and error on this
machine (``mp.autotune``), for a ``mixprec bench`` workload or the model and data ``train``
takes; the plan printed as a table, optionally saved as JSON and charted. A tqdm bar on
stderr shows what is being measured."""

from __future__ import annotations

import argparse
import math
import sys
from typing import Any

import torch

from mixprec._plan_apply import PLAN_DTYPES
from mixprec.autotune.check import MIN_STEPS
from mixprec.cli._common import UsageError, output_file, plot_file
from mixprec.cli._model_options import (
    SPEC_HELP,
    TRAIN_MODELS,
    build_model,
    check_model_and_data,
    classes_of,
    load_data,
)

HELP = "choose each layer's dtype by its measured speed and error on this machine"
EPILOG = SPEC_HELP
MEMORY_HINT = "a smaller --batch-size, or --small beside --workload"  # where allocation fails


def add_arguments(sub: argparse.ArgumentParser) -> None:
    """The options of ``mixprec autotune``."""
    sub.add_argument(
        "--workload", metavar="NAME|module:function",
        help="a mixprec bench workload (mlp-b64, lm-d512, cnn...) or a module:function "
        "returning a mixprec.bench.Workload; in place of --model/--data",
    )  # fmt: skip
    sub.add_argument("--small", action="store_true", help="the workload's tiny version (tests)")
    # Defaults None: given beside --workload, which replaces them, they are refused.
    sub.add_argument(
        "--model", metavar="NAME|module:function",
        help=f"without --workload: {' or '.join(TRAIN_MODELS)}, or a module:function of "
        "yours (default: mlp)",
    )  # fmt: skip
    sub.add_argument(
        "--data", metavar="NAME|module:function",
        help="without --workload: digits, mnist:DIR, synthetic, or a module:function of yours "
        "(default: digits)",
    )  # fmt: skip
    sub.add_argument("--batch-size", type=int, metavar="N",
                     help="samples in the batch measured (--model/--data; 256)")  # fmt: skip
    sub.add_argument("--seed", type=int, default=0, metavar="N", help="seeds weights and data")
    sub.add_argument(
        "--candidates", default=",".join(PLAN_DTYPES),
        help="comma-separated dtypes to consider",
    )  # fmt: skip
    sub.add_argument("--error-budget", type=float, default=0.05, metavar="E",
                     help="largest relative error against float32")  # fmt: skip
    sub.add_argument("--time-budget", type=float, default=60.0, metavar="S",
                     help="seconds the tuning may take")  # fmt: skip
    sub.add_argument("--check-steps", type=int, default=50, metavar="N",
                     help="steps of the training check beside float32")  # fmt: skip
    sub.add_argument("--compile", action="store_true", help="time and check compiled steps")
    sub.add_argument("--json", metavar="FILE", help="save the plan as JSON (mp.Plan.load)")
    sub.add_argument("--plot", metavar="FILE.png", help="chart time against error per layer")


def _check_options(args: argparse.Namespace) -> tuple[str, ...]:
    """Options that do not apply are refused, not ignored; the candidates to consider."""
    if args.workload:
        given = [f"--{n.replace('_', '-')}" for n in ("model", "data", "batch_size")
                 if getattr(args, n) is not None]  # fmt: skip
        if given:
            raise UsageError(
                f"{', '.join(given)} apply to --model/--data; --workload {args.workload} "
                "brings its own model and batch"
            )
    else:
        if args.small:
            raise UsageError("--small picks a workload's tiny version; give --workload too")
        args.model, args.data = args.model or "mlp", args.data or "digits"
        args.batch_size = 256 if args.batch_size is None else args.batch_size
        if args.batch_size < 1:
            raise UsageError(f"--batch-size must be >= 1, got {args.batch_size}")
    # As autotune checks them, named as typed (NaN fails >= 0).
    if not args.error_budget >= 0:
        raise UsageError(f"--error-budget must be a number >= 0, got {args.error_budget:g}")
    if not 0 <= args.time_budget < math.inf:
        raise UsageError(f"--time-budget must be a finite number >= 0, got {args.time_budget:g}")
    if args.check_steps < MIN_STEPS:  # the first step's loss comes before any update
        raise UsageError(f"--check-steps must be an int >= {MIN_STEPS}, got {args.check_steps}")
    # Both paths: the seed seeds the workload's weights too (--workload skips the check below).
    if not 0 <= args.seed < 2**63:
        raise UsageError(f"--seed must be an int in [0, 2**63), got {args.seed}")
    candidates = tuple(c.strip() for c in args.candidates.split(",") if c.strip())
    if not candidates:
        raise UsageError(
            f"--candidates {args.candidates!r} names no dtype; valid: {', '.join(PLAN_DTYPES)}"
        )
    return candidates


def _problem(args: argparse.Namespace) -> tuple[torch.nn.Module, tuple[Any, Any], Any]:
    """The model, batch and loss to tune."""
    if args.workload:
        from mixprec.bench import get_workload

        work = get_workload(args.workload, small=args.small)
        torch.manual_seed(args.seed)
        return work.make_model(), work.batch, work.loss_fn
    check_model_and_data(args)  # a name that is no model is refused, not taken as the CNN
    splits = load_data(args.data, args.seed)
    (x, y), _ = splits
    torch.manual_seed(args.seed)
    model = build_model(args.model, x, classes_of(splits), data=args.data)
    return model, (x[: args.batch_size], y[: args.batch_size]), torch.nn.functional.cross_entropy


def run(args: argparse.Namespace) -> int:
    """Tune, print the plan, and write what was asked for."""
    from tqdm import tqdm

    from mixprec.autotune import autotune
    from mixprec.autotune.plot import plot_plan

    candidates = _check_options(args)
    json_path = output_file("--json", args.json) if args.json is not None else None
    plot_path = plot_file("--plot", args.plot) if args.plot is not None else None
    model, batch, loss_fn = _problem(args)
    with tqdm(desc="autotune", unit=" measurements", file=sys.stderr, leave=False) as bar:

        def progress(text: str) -> None:
            bar.set_postfix_str(text, refresh=False)
            bar.update(1)

        plan = autotune(
            model, batch, loss_fn, candidates=candidates, error_budget=args.error_budget,
            time_budget_s=args.time_budget, compile=args.compile, check_steps=args.check_steps,
            progress=progress,
        )  # fmt: skip
    print(plan)
    if json_path:
        plan.save(json_path)
        print(f"plan written to {json_path}")
    if plot_path:
        plot_plan(plan, plot_path)
        print(f"chart written to {plot_path}")
    return 0
