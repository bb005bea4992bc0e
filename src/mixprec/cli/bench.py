"""``mixprec bench``: time mixprec's modes against float32 and plain ``torch.autocast`` in
one run, or find each mode's largest batch within a memory budget.

The bench package is imported when the command runs, not when the CLI loads: ``info``,
``inspect`` and ``convert`` do not pay for it. While it works, a tqdm bar on stderr shows
its progress; stdout holds only the results.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, NoReturn

import torch

from mixprec._errors import ArgumentError
from mixprec.cli._common import (
    UsageError,
    choice,
    float8_rule,
    float8_sizes,
    output_file,
    plot_file,
)

if TYPE_CHECKING:
    from tqdm import tqdm

    from mixprec.float8 import Float8Options

HELP = "time mixprec's modes against float32 and torch.autocast in one run"


def add_arguments(sub: argparse.ArgumentParser) -> None:
    """The options of ``mixprec bench``."""
    sub.add_argument(
        "workload", nargs="*",
        help="mlp-b64, mlp-b8192, lm-d512, cnn, lm-d2048 (d=2048, for GPUs) or "
        "module:function (default: the first four)",
    )  # fmt: skip
    sub.add_argument(
        "--modes",
        help="comma-separated, each optionally MODE+compile, each once; default: all but the "
        "float8 ones. float8 (needs mixprec[float8]): O2-fp8 (policy mixed_float8), O2-fp8-rowwise "
        "(mixed_float8_rowwise), O2-fp8-rowwise_with_gw_hp (mixed_float8_rowwise_with_gw_hp)",
    )  # fmt: skip
    sub.add_argument(
        "--policy", metavar="POLICY",
        help="add the policy's O2 mode (mixed_float8: O2-fp8) beside float32 and O2-bf16, or "
        "beside --modes",
    )  # fmt: skip
    sub.add_argument("--repeats", type=int, default=5)
    sub.add_argument("--steps", type=int, default=3, help="steps per timed round, at least")
    sub.add_argument(
        "--min-round-ms", type=float, default=100.0,
        help="more steps per round where the fastest mode would take less (default 100)",
    )  # fmt: skip
    sub.add_argument("--warmup", type=int, default=2)
    sub.add_argument("--device", default="auto")
    sub.add_argument("--no-memory", action="store_true", help="skip peak-memory runs")
    sub.add_argument(
        "--small", action="store_true",
        help="tiny sizes, for tests (lm-d2048 keeps d=2048: one block, 2 x 64 tokens)",
    )  # fmt: skip
    sub.add_argument(
        "--max-batch", type=float, metavar="MB",
        help="instead of timing: the largest batch per mode within this peak-memory budget",
    )  # fmt: skip
    sub.add_argument("--batch-limit", type=int, default=1 << 16, help="for --max-batch")
    sub.add_argument(
        "--outputs-16bit", action="store_true",
        help="the models return their compute dtype (policy output=compute) to a loss that "
        "computes in float32 from it, such as mixprec.cross_entropy: saves memory",
    )  # fmt: skip
    sub.add_argument(
        "--compile", action="store_true",
        help="add each mode under torch.compile (MODE+compile), compile time reported apart",
    )  # fmt: skip
    sub.add_argument(
        "--compile-mode",
        help="torch.compile mode for +compile modes: default, reduce-overhead, max-autotune "
        "or max-autotune-no-cudagraphs",
    )
    sub.add_argument(
        "--float8-min-features", metavar="N|torchao",
        help="float8 modes convert Linear layers with both dims >= N, or by torchao's H100 "
        "size thresholds (default: every block Linear of the LMs, torchao's elsewhere)",
    )  # fmt: skip
    sub.add_argument("--json", metavar="FILE")
    sub.add_argument("--plot", metavar="FILE.png")


def run(args: argparse.Namespace) -> int:
    """Check every option, then time the workloads' modes (or search their largest batch)."""
    from mixprec import bench

    workloads = args.workload or list(bench.DEFAULT_WORKLOADS)
    for w in workloads:
        if ":" not in w:
            choice("workload", w, list(bench.WORKLOADS))
        else:
            _user_workload(w, args.small)
    _check_device(args.device)
    json_path = output_file("--json", args.json) if args.json else None
    plot_path = plot_file("--plot", args.plot) if args.plot else None
    if args.max_batch is not None and args.max_batch <= 0:
        raise UsageError(f"--max-batch must be a memory budget in MB > 0, got {args.max_batch:g}")
    given = _listed_modes(args.modes)
    modes = given or list(bench.MODES)
    if args.policy is not None:
        # A policy is its O2 mode beside float32 and O2 bfloat16 (or the given --modes).
        policy_mode = bench.mode_for_policy(args.policy)
        if policy_mode is None:
            raise UsageError(f"--policy {args.policy!r} has no bench mode; valid: "
                             f"{', '.join(bench.POLICY_MODES)}")  # fmt: skip
        modes = list(dict.fromkeys([*(given or ["float32", "O2-bf16"]), policy_mode]))
    for m in modes:
        base = m.removesuffix(bench.COMPILED)
        if bench.mode_for_policy(base) is not None:
            raise UsageError(
                f"unknown mode {base!r}; modes are levels with a precision: policy {base!r} "
                f"is mode {bench.mode_for_policy(base)!r} (valid: {', '.join(bench.ALL_MODES)})"
            )
        choice("mode", base, list(bench.ALL_MODES))
    try:
        bench.require_float8(modes)
    except ImportError as err:
        raise UsageError(f"--modes {','.join(m for m in modes if bench.is_float8_mode(m))}: "
                         f"{err}") from err  # fmt: skip
    float8 = float8_sizes(args.float8_min_features)
    if args.compile:
        modes = bench.with_compiled(modes)
    if args.compile_mode is not None and args.compile_mode not in bench.compile_modes():
        raise UsageError(f"--compile-mode {args.compile_mode!r} is not a torch.compile mode; "
                         f"valid: {', '.join(bench.compile_modes())}")  # fmt: skip
    for name in ("repeats", "steps"):
        if getattr(args, name) < 1:
            raise UsageError(f"--{name} must be >= 1, got {getattr(args, name)}")
    if args.warmup < 0 or args.min_round_ms < 0:
        raise UsageError(
            f"--warmup and --min-round-ms must be >= 0, got {args.warmup} and {args.min_round_ms}"
        )
    if args.max_batch:
        _max_batches(args, workloads, modes, float8)
        return 0
    results = {}
    units = bench.run_units(modes, args.repeats, not args.no_memory)
    with _progress_bar(units * len(workloads), "run") as bar:
        for w in workloads:
            results[w] = bench.run(
                w, modes, repeats=args.repeats, steps=args.steps, warmup=args.warmup,
                min_round_ms=args.min_round_ms, outputs_16bit=args.outputs_16bit,
                device=args.device, memory=not args.no_memory, small=args.small,
                compile_mode=args.compile_mode, float8=float8, progress=_advance(bar, w),
            )  # fmt: skip
            with bar.external_write_mode(file=sys.stdout):
                print(bench.table(w, results[w]), end="\n\n", flush=True)
    print("ms/step: median over interleaved rounds; vs f32: median of each round's float32 "
          "ms / mode ms (higher is faster); peak MB: tensor memory of the mode's training "
          "alone in a fresh process (allocator peak); on CUDA float32 runs without TF32; "
          "MFU: model TFLOP/s over the GPU's data-sheet peak for the mode's matmul dtype "
          "(bfloat16 for fp8 modes)")  # fmt: skip
    if any(bench.is_float8_mode(m) for m in modes):
        rule = ("the workload's rule: lm-* every Linear of the blocks, the others torchao's "
                "H100 size thresholds" if float8 is None else float8_rule(float8))  # fmt: skip
        print(f"fp8: Linear layers converted to float8 / Linear layers in the model ({rule}; "
              "the output head stays bfloat16)")  # fmt: skip
    for note in bench.notes(modes, args.device):
        print(f"note: {note}")
    if json_path:
        Path(json_path).write_text(bench.to_json(results, args.outputs_16bit, args.device))
        print(f"results written to {json_path}")
    if plot_path:
        bench.plot(results, plot_path, _bench_subtitle(args.device, args.small))
        print(f"chart written to {plot_path}")
    return 0


def _max_batches(
    args: argparse.Namespace,
    workloads: Sequence[str],
    modes: Sequence[str],
    float8: Float8Options | None,
) -> None:
    """``--max-batch``: each mode's largest batch within the budget, a table per workload.
    The progress bar steps once per workload and mode; its postfix names each probe."""
    from mixprec import bench

    with _progress_bar(len(workloads) * len(modes), "mode") as bar:
        for w in workloads:
            found = {}
            for m in modes:

                def probed(batch: int, fits: bool, where: str = f"{w} {m}") -> None:
                    bar.set_postfix_str(f"{where}: batch {batch} {'fits' if fits else 'too big'}")

                found[m] = bench.max_batch(w, m, args.max_batch, args.device, args.small,
                                           args.batch_limit, args.outputs_16bit, float8,
                                           progress=probed)  # fmt: skip
                bar.update(1)
            base = found.get("float32") or 0
            with bar.external_write_mode(file=sys.stdout):
                print(f"workload {w}: largest batch within {args.max_batch:g} MB")
                for m, b in found.items():
                    ratio = f" ({b / base:.2f}x float32)" if base else ""
                    print(f"  {m:<22} {b:>7d}{ratio}", flush=True)


def _progress_bar(total: int, unit: str) -> tqdm[NoReturn]:
    """The bar on stderr that ``run`` advances while it works (stdout keeps the results)."""
    from tqdm import tqdm

    return tqdm(total=total, desc="bench", unit=unit, file=sys.stderr, leave=True)


def _advance(bar: tqdm[NoReturn], workload: str) -> Callable[[str], None]:
    """``bench.run``'s progress callback: one step of ``bar``, naming what was done."""

    def advance(done: str) -> None:
        bar.set_postfix_str(f"{workload} {done}", refresh=False)
        bar.update(1)

    return advance


def _listed_modes(value: str | None) -> list[str] | None:
    """``--modes``: ``None`` where it is not given; else its names, each once, in order. A
    name given twice runs once, with a note on stderr; an empty list or name is refused."""
    from mixprec import bench

    if value is None:
        return None
    names = [name.strip() for name in value.split(",")]
    if not all(names):
        what = "is empty" if not any(names) else "has an empty mode name"
        raise UsageError(
            f"--modes {value!r} {what}; give comma-separated modes, each optionally "
            f"{bench.COMPILED!r}, from: {', '.join(bench.ALL_MODES)}"
        )
    unique = list(dict.fromkeys(names))
    repeated = [name for name in unique if names.count(name) > 1]
    if repeated:
        print(f"mixprec bench: note: --modes names {', '.join(repeated)} more than once; "
              "each mode runs once", file=sys.stderr)  # fmt: skip
    return unique


def _bench_subtitle(device: str, small: bool) -> str:
    from mixprec import bench

    shapes = ", --small shapes" if small else ""
    return (
        f"{bench.device_name(device)}, {bench.bf16_support(device)}, torch {torch.__version__}"
        f"{shapes}"
    )


def _user_workload(spec: str, small: bool) -> None:
    """``module:function`` must name a function that returns a ``Workload`` when called with
    no arguments: checked, by calling it, before any work; a one-line error, else."""
    from mixprec import bench

    try:
        bench.get_workload(spec, small)
    except ArgumentError as err:
        raise UsageError(str(err)) from None


def _check_device(device: str) -> None:
    if device == "auto":
        return
    try:
        parsed = torch.device(device)
    except RuntimeError:
        raise UsageError(
            f"--device {device!r} is not a device; valid: auto, cpu, cuda, cuda:N"
        ) from None
    if parsed.type == "cuda" and not torch.cuda.is_available():
        raise UsageError(f"--device {device!r}: CUDA is not available on this machine")
