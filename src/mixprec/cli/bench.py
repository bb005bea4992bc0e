"""``mixprec bench``: time mixprec's modes against float32 and plain ``torch.autocast`` in
one run, or find each mode's largest batch within a memory budget.

The bench package is imported when the command runs, not when the CLI loads: ``info``,
``inspect`` and ``convert`` do not pay for it. While it works, a tqdm bar on stderr shows
its progress; stdout holds only the results.
"""

from __future__ import annotations

import argparse
import math
import sys
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, NoReturn

import torch

from mixprec._atomic import write_text_atomically
from mixprec._errors import ArgumentError
from mixprec._step_profile import GAIN_THRESHOLD
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
MEMORY_HINT = "--small, or another workload"  # said where an allocation fails
BATCH_LIMIT = 1 << 16  # --batch-limit's default


#: The help's last part, in place of the lists of modes and workloads (``_BenchHelp``).
_LISTS = "(the modes and workloads)"


class _BenchHelp(argparse.RawDescriptionHelpFormatter):
    """Help that lists every mode and bundled workload with what it trains, below the
    options. The lists are built when help is shown, so that parsing a command line does
    not import the bench package; their lines are kept as written."""

    def add_text(self, text: str | None) -> None:
        super().add_text(_mode_lists() if text == _LISTS else text)


def _mode_lists() -> str:
    import textwrap

    from mixprec.bench.modes import ALL_MODES, FLOAT8_MODES, MODE_HELP, MODES
    from mixprec.bench.workloads import DEFAULT_WORKLOADS, WORKLOAD_HELP

    def entry(name: str, text: str) -> str:
        return textwrap.fill(f"  {name:<27} {text}", 78, subsequent_indent=" " * 30)

    return "\n".join(
        ["modes (--modes; each also as MODE+compile):"]
        + [entry(m, MODE_HELP[m] + ("" if m in MODES else " [opt-in]")) for m in ALL_MODES]
        + [entry("default:", f"all but the opt-in ones ({', '.join(FLOAT8_MODES)} need "
                 "mixprec[float8])"), "",
           "workloads (or module:function, a function returning a mixprec.bench.Workload):"]
        + [entry(w, WORKLOAD_HELP[w]) for w in WORKLOAD_HELP]
        + [entry("default:", " ".join(DEFAULT_WORKLOADS))]
    )  # fmt: skip


# The timing run's options and their defaults (refused beside --max-batch when changed).
_TIMING = {"repeats": 5, "steps": 3, "min_round_ms": 100.0, "warmup": 2}


def add_arguments(sub: argparse.ArgumentParser) -> None:
    """The options of ``mixprec bench``, each with its default; below them, every mode and
    bundled workload with what it trains."""
    sub.description = (
        "Time mixprec's modes against float32 and plain torch.autocast in one process,\n"
        "in interleaved rounds; 'vs f32' and 'vs autocast' are the medians of each\n"
        "round's ratios."
    )
    sub.formatter_class = _BenchHelp
    sub.epilog = _LISTS
    sub.add_argument(
        "workload", nargs="*",
        help="bundled workloads (listed below) or module:function (default: mlp-b64 "
        "mlp-b8192 lm-d512 cnn)",
    )  # fmt: skip
    sub.add_argument(
        "--modes",
        help="comma-separated modes (listed below), each optionally MODE+compile, each once "
        "(default: all but the opt-in ones)",
    )  # fmt: skip
    sub.add_argument(
        "--policy", metavar="POLICY",
        help="add the policy's O2 mode (mixed_float8: O2-fp8) beside float32 and O2-bf16, or "
        "beside --modes",
    )  # fmt: skip
    sub.add_argument("--repeats", type=int, default=_TIMING["repeats"],
                     help="timed rounds per mode, interleaved (default: %(default)s)")  # fmt: skip
    sub.add_argument(
        "--steps", type=int, default=_TIMING["steps"],
        help="steps per timed round, at least; more where --min-round-ms needs them "
        "(default: %(default)s)",
    )  # fmt: skip
    sub.add_argument(
        "--min-round-ms", type=float, default=_TIMING["min_round_ms"], metavar="MS",
        help="more steps per round where the fastest mode would take less (default: "
        "%(default)g)",
    )  # fmt: skip
    sub.add_argument(
        "--warmup", type=int, default=_TIMING["warmup"],
        help="untimed steps per mode before the rounds, at least 2 (default: %(default)s)",
    )  # fmt: skip
    sub.add_argument(
        "--device", default="auto",
        help="auto, cpu, cuda or cuda:N (default: %(default)s: CUDA where it is)",
    )  # fmt: skip
    sub.add_argument("--no-memory", action="store_true",
                     help="skip the peak-memory runs (one fresh process per mode)")  # fmt: skip
    sub.add_argument(
        "--small", action="store_true",
        help="tiny sizes, for tests (lm-d2048 keeps d=2048: one block, 2 x 64 tokens)",
    )  # fmt: skip
    sub.add_argument(
        "--max-batch", type=float, metavar="MB",
        help="instead of timing: the largest batch per mode within this peak-memory budget",
    )  # fmt: skip
    # Default None: given without --max-batch, it is refused, not ignored.
    sub.add_argument(
        "--batch-limit", type=int, metavar="N",
        help=f"the largest batch --max-batch tries (default: {BATCH_LIMIT})",
    )  # fmt: skip
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
        "or max-autotune-no-cudagraphs (default: torch.compile's default)",
    )
    sub.add_argument(
        "--float8-min-features", metavar="N|torchao",
        help="float8 modes convert Linear layers with both dims >= N, or by torchao's H100 "
        "size thresholds (default: every block Linear of the LMs, torchao's elsewhere)",
    )  # fmt: skip
    sub.add_argument("--json", metavar="FILE",
                     help="write the results, the device and the notes as JSON")  # fmt: skip
    sub.add_argument("--plot", metavar="FILE.png",
                     help="write a bar chart of the speedups against float32")  # fmt: skip


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
    json_path = output_file("--json", args.json) if args.json is not None else None
    plot_path = plot_file("--plot", args.plot) if args.plot is not None else None
    if args.max_batch is not None and not (math.isfinite(args.max_batch) and args.max_batch > 0):
        raise UsageError(
            f"--max-batch must be a memory budget in MB, a finite number > 0, got "
            f"{args.max_batch:g}"
        )
    if args.batch_limit is not None and args.max_batch is None:
        raise UsageError(f"--batch-limit {args.batch_limit} caps the batches --max-batch tries; "
                         "give --max-batch too, or leave --batch-limit out")  # fmt: skip
    if args.batch_limit is None:
        args.batch_limit = BATCH_LIMIT
    if args.batch_limit < 1:
        raise UsageError(f"--batch-limit must be >= 1, got {args.batch_limit}")
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
    if float8 is not None and not any(bench.is_float8_mode(m) for m in modes):
        raise UsageError(
            f"--float8-min-features {args.float8_min_features} applies to float8 modes "
            f"({', '.join(bench.FLOAT8_MODES)}); "
            f"the modes to run ({', '.join(modes)}) have none: give one in --modes, or "
            "--policy mixed_float8"
        )
    if args.compile:
        modes = bench.with_compiled(modes)
    if args.compile_mode is not None and args.compile_mode not in bench.compile_modes():
        raise UsageError(f"--compile-mode {args.compile_mode!r} is not a torch.compile mode; "
                         f"valid: {', '.join(bench.compile_modes())}")  # fmt: skip
    if args.compile_mode is not None and not any(m.endswith(bench.COMPILED) for m in modes):
        raise UsageError(
            f"--compile-mode {args.compile_mode} applies to compiled modes; give --compile, "
            f"or MODE{bench.COMPILED} in --modes"
        )
    for name in ("repeats", "steps"):
        if getattr(args, name) < 1:
            raise UsageError(f"--{name} must be >= 1, got {getattr(args, name)}")
    if args.warmup < 0 or not (math.isfinite(args.min_round_ms) and args.min_round_ms >= 0):
        raise UsageError(
            f"--warmup must be >= 0 and --min-round-ms a finite number >= 0, got "
            f"{args.warmup} and {args.min_round_ms:g}"
        )
    if args.max_batch:
        # The timing run's options, given with the search: they were ignored, unsaid.
        given = [name for name, default in _TIMING.items() if getattr(args, name) != default]
        if args.no_memory:
            given.append("no_memory")
        if given:
            shown = ", ".join("--" + name.replace("_", "-") for name in given)
            raise UsageError(
                f"{shown} applies to the timing run; --max-batch searches batch sizes (one "
                "step per probe, in a fresh process): leave it out, or leave out --max-batch"
            )
        if json_path or plot_path:
            raise UsageError(
                "--json and --plot write the timing run's results; --max-batch searches batch "
                "sizes and prints them: give one or the other"
            )
        _max_batches(args, workloads, modes, float8)
        return 0
    results = {}
    units = bench.run_units(modes, args.repeats, not args.no_memory)
    print(f"mixprec bench on {bench.device_description(args.device)}, torch {torch.__version__}",
          end="\n\n", flush=True)  # fmt: skip
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
          "alone in a fresh process (allocator peak); on CUDA float32 runs without TF32 "
          "(float32-tf32 with it); MFU: model TFLOP/s over the GPU's data-sheet peak for the "
          "mode's matmul dtype (bfloat16 for fp8 modes, TF32 for float32-tf32)")  # fmt: skip
    if any(r.vs_autocast is not None for rs in results.values() for r in rs):
        print("vs autocast: the same against plain torch.autocast in the mode's 16-bit dtype, "
              "run the same way (eager, or +compile): bf16 with a plain optimizer step and no "
              "GradScaler, fp16 with torch.amp.GradScaler")  # fmt: skip
    if any(r.no_gain for rs in results.values() for r in rs):
        print(f"buys little: a 16-bit mode below {GAIN_THRESHOLD:g}x float32, with the reason "
              "measured here (matmul time by torch.profiler, the only part 16-bit math speeds "
              "up)")  # fmt: skip
    if any(bench.is_float8_mode(m) for m in modes):
        rule = ("the workload's rule: lm-* every Linear of the blocks, the others torchao's "
                "H100 size thresholds" if float8 is None else float8_rule(float8))  # fmt: skip
        print(f"fp8: Linear layers converted to float8 / Linear layers in the model ({rule}; "
              "the output head stays bfloat16)")  # fmt: skip
    for note in bench.notes(modes, args.device):
        print(f"note: {note}")
    if json_path:
        write_text_atomically(json_path, bench.to_json(results, args.outputs_16bit, args.device))
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

                found[m] = bench.max_batch(
                    w,
                    m,
                    args.max_batch,
                    args.device,
                    args.small,
                    args.batch_limit,
                    args.outputs_16bit,
                    float8,
                    progress=probed,
                    compile_mode=args.compile_mode,
                )
                bar.update(1)
            base = found.get("float32") or 0
            with bar.external_write_mode(file=sys.stdout):
                print(f"workload {w}: largest batch within {args.max_batch:g} MB")
                for m, b in found.items():
                    # At the cap the search stopped, not the budget: a larger batch may
                    # fit, and a ratio with it would be a guess.
                    capped = args.batch_limit in (b, base)
                    ratio = f" ({b / base:.2f}x float32)" if base and not capped else ""
                    if b == args.batch_limit:
                        print(f"  {m:<22} {f'>= {b}':>7} (reached --batch-limit)", flush=True)
                    else:
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
    """The device and its 16-bit features (``device_description``), and torch's version."""
    from mixprec import bench

    shapes = ", --small shapes" if small else ""
    return f"{bench.device_description(device)}, torch {torch.__version__}{shapes}"


def _user_workload(spec: str, small: bool) -> None:
    """``module:function`` must name a function that returns a ``Workload`` when called with
    no arguments: checked, by calling it, before any work; a one-line error, else."""
    from mixprec import bench

    try:
        bench.get_workload(spec, small)
    except ArgumentError as err:
        raise UsageError(str(err)) from None


def _check_device(device: str) -> None:
    """auto, cpu, cuda or cuda:N, where there is that GPU: the devices the bench measures
    (its timing and memory probes know CPU and CUDA alone)."""
    if device == "auto":
        return
    valid = "valid: auto, cpu, cuda, cuda:N"
    try:
        parsed = torch.device(device)
    except RuntimeError:
        raise UsageError(f"--device {device!r} is not a device; {valid}") from None
    if parsed.type not in ("cpu", "cuda"):
        raise UsageError(f"--device {device!r}: mixprec bench runs on CPU or CUDA only; {valid}")
    if parsed.type == "cuda" and not torch.cuda.is_available():
        raise UsageError(f"--device {device!r}: CUDA is not available on this machine")
    if parsed.type == "cuda" and (parsed.index or 0) >= torch.cuda.device_count():
        raise UsageError(
            f"--device {device!r}: this machine has {torch.cuda.device_count()} CUDA "
            f"device(s); valid: cuda:0 to cuda:{torch.cuda.device_count() - 1}"
        )
