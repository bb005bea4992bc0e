"""``mixprec convert``: rewrite a checkpoint's weights as safetensors in one dtype."""

from __future__ import annotations

import argparse

from mixprec.checkpoint import convert_checkpoint
from mixprec.cli._common import output_file

HELP = "rewrite a checkpoint's weights as safetensors in one dtype"


def add_arguments(sub: argparse.ArgumentParser) -> None:
    """The options of ``mixprec convert``."""
    sub.add_argument("input", help="mixprec checkpoint, .safetensors or torch.save file")
    sub.add_argument("output", help="the .safetensors file to write")
    sub.add_argument("--dtype", default="float32", help="float32, bfloat16 or float16")
    sub.add_argument(
        "--on-range", default="error", choices=("error", "clamp", "ignore"),
        help="values beyond the dtype's range: fail (default), saturate, or cast as is; "
        "NaN/inf fail unless 'ignore'",
    )  # fmt: skip


def run(args: argparse.Namespace) -> int:
    """Convert, then say what was written and which values left the dtype's range."""
    output_file("output", args.output)
    report = convert_checkpoint(args.input, args.output, args.dtype, args.on_range)
    from safetensors import safe_open

    with safe_open(args.output, "pt") as written:
        count = len(list(written.keys()))
    print(
        f"wrote {args.output}: {count} tensors in {args.dtype} "
        f"({len(report.converted)} converted from another dtype)"
    )
    for name, peak, dtype, action in report.out_of_range:
        print(f"  {name}: max |value| {peak:.6g} exceeds {dtype} ({action})")
    for name, nan, inf in report.non_finite:
        print(f"  {name}: {nan} NaN, {inf} inf (kept: --on-range ignore)")
    return 0
