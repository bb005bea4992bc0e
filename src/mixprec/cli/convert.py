"""``mixprec convert``: rewrite a checkpoint's weights as safetensors in one dtype."""

from __future__ import annotations

import argparse
import json
import os
import re
from pathlib import Path

from mixprec._dtypes import dtype_name, parse_dtype
from mixprec.checkpoint import SAFETENSORS_DTYPES, CheckpointError, convert_checkpoint, same_file
from mixprec.checkpoint.format import underflow_line
from mixprec.cli._common import UsageError, output_file

HELP = "rewrite a checkpoint's weights as safetensors in one dtype"
NOT_SAFETENSORS = "a file that is not safetensors"  # what ``_holds`` says of a torch.save file


def add_arguments(sub: argparse.ArgumentParser) -> None:
    """The options of ``mixprec convert``."""
    sub.add_argument("input", help="mixprec checkpoint, .safetensors or torch.save file")
    sub.add_argument("output", help="the .safetensors file to write")
    sub.add_argument(
        "--dtype", default="float32", help="the weights' dtype: float32, bfloat16 or float16"
    )
    sub.add_argument(
        "--on-range", default="error", choices=("error", "clamp", "ignore"),
        help="values beyond the dtype's range: error (fail), clamp (saturate), or ignore "
        "(cast as is); NaN/inf fail unless 'ignore'",
    )  # fmt: skip
    sub.add_argument(
        "--in-place", action="store_true",
        help="allow OUTPUT to be INPUT: overwrite it with the weights alone (what else it "
        "held, such as optimizer, RNG and trainer state, is listed as dropped)",
    )  # fmt: skip
    sub.add_argument(
        "--overwrite", action="store_true",
        help="allow OUTPUT to be an existing file other than INPUT, and replace it",
    )  # fmt: skip


def run(args: argparse.Namespace) -> int:
    """Convert, then say what was written and which values left the dtype's range; in
    place, also what the input held that the output does not."""
    parse_dtype(args.dtype, argument="--dtype")  # named as typed, not as the API's dtype=
    output_file("output", args.output)
    in_place = same_file(args.input, args.output)
    if in_place and not args.in_place:
        raise UsageError(
            f"output {args.output!r} is the input file: it would be replaced by its model "
            "weights alone, losing any optimizer, master-weight, loss-scaler, RNG and trainer "
            "state in it; give another output, or --in-place to overwrite it"
        )
    # In place the file keeps its name whatever it held; a new file is named for what it is.
    suffix = Path(args.output).suffix
    if not in_place and suffix.lower() != ".safetensors":
        raise UsageError(
            f"output {args.output!r} "
            + (f"has the suffix {suffix!r}" if suffix else "has no suffix")
            + "; convert writes safetensors, not a torch.save file: give a .safetensors file "
            "path"
        )
    replaced = None
    if not in_place and os.path.exists(args.output):
        replaced = _holds(args.output)
        if not args.overwrite:  # another checkpoint's optimizer and trainer state would go
            raise UsageError(
                f"output {args.output!r} exists ({replaced}) and would be replaced; give "
                "another output, or --overwrite to replace it"
            )
    was_torch_file = in_place and _holds(args.input) == NOT_SAFETENSORS
    try:
        report = convert_checkpoint(
            args.input, args.output, args.dtype, args.on_range, in_place=in_place
        )
    except CheckpointError as err:  # named as typed: --on-range, not the API's on_range=
        raise CheckpointError(re.sub(r"on_range='(\w+)'", r"--on-range \1", str(err))) from None
    from safetensors import safe_open

    target = parse_dtype(args.dtype)
    with safe_open(args.output, "pt") as written:
        names = list(written.keys())
        dtypes = [SAFETENSORS_DTYPES[written.get_slice(k).get_dtype()] for k in names]
    # Integer, bool and complex tensors keep their dtype (a cast would lose them).
    own = [dtype_name(d) for d in dtypes if d != target]
    count = len(names)
    kept = f", {len(own)} kept in their own dtype ({', '.join(sorted(set(own)))})" if own else ""
    print(
        f"wrote {args.output}"
        + (f" (replaced {replaced})" if replaced else "")
        + f": {count - len(own)} tensors in {args.dtype} "
        f"({len(report.converted)} converted from another dtype){kept}"
    )
    for name, peak, dtype, action in report.out_of_range:
        print(f"  {name}: max |value| {peak:.6g} exceeds {dtype} ({action})")
    for name, nan, inf in report.non_finite:
        print(f"  {name}: {nan} NaN, {inf} inf (kept: --on-range ignore)")
    for entry in report.underflow:
        print(underflow_line(*entry))
    if in_place:
        print(f"  in place: kept the model weights ({count} tensors, now {args.dtype})")
        if was_torch_file:  # same name, another format: say it
            print(f"  in place: {args.output} is now a safetensors file, not a torch.save one: "
                  "torch.load no longer reads it (mixprec and safetensors do)")  # fmt: skip
    # Not only in place: a new file leaves out the same (an optimizer's masters among it).
    for what in report.dropped or (["nothing (the input held weights only)"] if in_place else []):
        print(f"  dropped: {what}")
    return 0


def _holds(path: str) -> str:
    """What the existing file ``path`` holds, read from the safetensors header alone."""
    from safetensors import safe_open

    try:
        with safe_open(path, "pt") as opened:
            metadata, count = opened.metadata() or {}, len(opened.keys())
        header = json.loads(metadata["mixprec"]) if "mixprec" in metadata else None
    except Exception:  # not safetensors (torch.save, anything else), or a malformed header
        return NOT_SAFETENSORS
    if not isinstance(header, dict):
        return f"a safetensors file of {count} tensors"
    keys = {"optimizer": "optimizer", "trainer": "trainer_state", "RNG": "rng"}
    parts = [what for what, key in keys.items() if header.get(key)]
    listed = " and ".join([", ".join(parts[:-1]), parts[-1]] if len(parts) > 1 else parts)
    state = f" with {listed} state" if parts else ""
    return f"a mixprec checkpoint{state}"
