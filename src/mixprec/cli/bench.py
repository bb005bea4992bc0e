"""``mixprec bench``: time mixprec's modes against float32 and plain ``torch.autocast`` in
one run, or find each mode's largest batch within a memory budget.

The bench package is imported when the command runs, not when the CLI loads: ``info``,
``inspect`` and ``convert`` do not pay for it.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from mixprec.cli._common import UsageError, choice, float8_rule, float8_sizes, output_file

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
        help="comma-separated, each optionally MODE+compile; default: all but the float8 "
        "ones. float8 (needs mixprec[float8]): O2-fp8 (policy mixed_float8), O2-fp8-rowwise "
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
        "--compile-mode", help="torch.compile mode for +compile modes, e.g. max-autotune"
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
            _workload_function(w)
    _check_device(args.device)
    json_path = output_file("--json", args.json) if args.json else None
    plot_path = output_file("--plot", args.plot, ".png") if args.plot else None
    if args.max_batch is not None and args.max_batch <= 0:
        raise UsageError(f"--max-batch must be a memory budget in MB > 0, got {args.max_batch:g}")
    modes = args.modes.split(",") if args.modes else list(bench.MODES)
    if args.policy is not None:
        # A policy is its O2 mode beside float32 and O2 bfloat16 (or the given --modes).
        policy_mode = bench.mode_for_policy(args.policy)
        if policy_mode is None:
            raise UsageError(f"--policy {args.policy!r} has no bench mode; valid: "
                             f"{', '.join(bench.POLICY_MODES)}")  # fmt: skip
        base_modes = args.modes.split(",") if args.modes else ["float32", "O2-bf16"]
        modes = list(dict.fromkeys([*base_modes, policy_mode]))
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
    for name in ("repeats", "steps"):
        if getattr(args, name) < 1:
            raise UsageError(f"--{name} must be >= 1, got {getattr(args, name)}")
    if args.warmup < 0 or args.min_round_ms < 0:
        raise UsageError(
            f"--warmup and --min-round-ms must be >= 0, got {args.warmup} and {args.min_round_ms}"
        )
    if args.max_batch:
        for w in workloads:
            found = {m: bench.max_batch(w, m, args.max_batch, args.device, args.small,
                                        args.batch_limit, args.outputs_16bit, float8)
                     for m in modes}  # fmt: skip
            base = found.get("float32") or 0
            print(f"workload {w}: largest batch within {args.max_batch:g} MB")
            for m, b in found.items():
                ratio = f" ({b / base:.2f}x float32)" if base else ""
                print(f"  {m:<22} {b:>7d}{ratio}")
        return 0
    results = {}
    for w in workloads:
        results[w] = bench.run(
            w, modes, repeats=args.repeats, steps=args.steps, warmup=args.warmup,
            min_round_ms=args.min_round_ms, outputs_16bit=args.outputs_16bit,
            device=args.device, memory=not args.no_memory, small=args.small,
            compile_mode=args.compile_mode, float8=float8,
        )  # fmt: skip
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


def _bench_subtitle(device: str, small: bool) -> str:
    from mixprec import bench

    shapes = ", --small shapes" if small else ""
    return f"{bench.device_name(device)}, torch {torch.__version__}{shapes}"


def _workload_function(spec: str) -> None:
    """``module:function`` must name an importable callable: a one-line error, else."""
    import importlib

    module, _, func = spec.partition(":")
    try:
        found = getattr(importlib.import_module(module), func, None)
    except ImportError as err:
        raise UsageError(f"workload {spec!r}: cannot import module {module!r} ({err})") from None
    if not callable(found):
        raise UsageError(f"workload {spec!r}: module {module!r} has no function {func!r}")


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
