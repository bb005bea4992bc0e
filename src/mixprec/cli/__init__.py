"""Command-line interface: a thin argparse layer over the library.

``mixprec train`` trains a model in mixed precision and in float32 and compares them;
``mixprec info`` reports what mixprec sees on this machine and what ``auto`` picks.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import multiprocessing
import os
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

import mixprec
from mixprec._dtypes import closest
from mixprec._hardware import probe_hardware
from mixprec.levels import LEVELS, resolve_level
from mixprec.policy import NAMES, Policy

TRAIN_MODELS = ("mlp", "cnn")  # the classification models of mixprec.models
DATA = ("digits", "mnist:DIR", "synthetic")
# float8 policies in `mixprec train`: torchao's H100 thresholds convert none of the small
# models' layers, so every Linear whose dims float8 takes is converted (the head stays).
TRAIN_FLOAT8_MIN_FEATURES = 16


class UsageError(Exception):
    """A bad command-line value: reported on one line, exit status 2."""


def _choice(kind: str, value: str, valid: Sequence[str]) -> str:
    if value in valid:
        return value
    hint = closest(value, list(valid))
    raise UsageError(
        f"unknown {kind} {value!r}; valid: {', '.join(valid)}"
        + (f" (closest: {hint!r})" if hint else "")
    )


def _output_file(option: str, path: str, suffix: str | None = None) -> str:
    """Check, before any work, that ``path`` can be written; return the path that will be
    (matplotlib adds ``.png`` to a name without a suffix)."""
    target = Path(path)
    if suffix and not target.suffix:
        target = target.with_name(target.name + suffix)
    if target.is_dir():
        raise UsageError(f"{option} {path!r} is a directory; give a file path")
    _check_parent(option, path, target.parent)
    return str(target)


def _output_dir(option: str, path: str) -> str:
    """Check that ``path`` is, or can be made, a writable directory."""
    target = Path(path)
    if target.exists() and not target.is_dir():
        raise UsageError(f"{option} {path!r} is an existing file; give a directory")
    parent = target
    while not parent.exists() and parent != parent.parent:
        parent = parent.parent
    _check_parent(option, path, parent)
    return path


def _check_parent(option: str, path: str, parent: Path) -> None:
    if not parent.is_dir():
        what = "is not a directory" if parent.exists() else "does not exist"
        raise UsageError(f"{option} {path!r}: {str(parent)!r} {what}")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise UsageError(f"{option} {path!r}: cannot write in {str(parent)!r} (permission denied)")


def _load(data: str, seed: int) -> tuple[tuple[torch.Tensor, torch.Tensor], ...]:
    if data == "digits":
        return mixprec.data.load_digits(seed=seed)
    if data.startswith("mnist:"):
        return mixprec.data.load_mnist(data.removeprefix("mnist:"))
    if data == "synthetic":
        x, y = mixprec.data.synthetic_classification(n=2048, seed=seed)
        cut = int(0.8 * len(x))
        return (x[:cut], y[:cut]), (x[cut:], y[cut:])
    raise UsageError(f"unknown data {data!r}; valid: {', '.join(DATA)}")


def _build(model: str, x: torch.Tensor, classes: int) -> torch.nn.Module:
    if model == "mlp":
        return mixprec.models.mlp(input_shape=tuple(x.shape[1:]), classes=classes)
    if x.dim() != 3:
        raise UsageError(f"model 'cnn' needs image data (n, H, W); this data is {tuple(x.shape)}")
    return mixprec.models.cnn(in_channels=1, classes=classes)


def run_training(config: dict[str, Any]) -> dict[str, Any]:
    """One training run; executed in a fresh process so that its peak memory is its own."""
    torch.manual_seed(config["seed"])
    (x_train, y_train), (x_test, y_test) = _load(config["data"], config["seed"])
    classes = int(max(y_train.max(), y_test.max())) + 1
    model = _build(config["model"], x_train, classes)
    policy: str | None = config["policy"]
    float8_layers = None
    if Policy(config["policy"]).float8_recipe is not None:
        # float8 options are per model: prepare here, then hand the model over prepared.
        options = _train_float8(config.get("float8_min_features"))
        mixprec.auto_mixed_precision(model, config["policy"], config["level"], float8=options)
        converted, considered = mixprec.float8.layer_counts(model)
        float8_layers = f"{converted} of {considered}"
        policy = None
    optimizer = torch.optim.Adam(model.parameters(), lr=config["lr"])
    trainer = mixprec.Trainer(
        model, "cross_entropy", optimizer, policy=policy, level=config["level"],
        compile=config.get("compile", False),
    )  # fmt: skip
    from mixprec.bench import PeakMemory

    memory = PeakMemory(trainer.device)  # the run's own peak: this process trains once
    start = time.perf_counter()
    history = trainer.fit(
        x_train, y_train, batch_size=config["batch_size"], epochs=config["epochs"],
        validation_data=(x_test, y_test), verbose=config["verbose"],
    )  # fmt: skip
    seconds = time.perf_counter() - start
    test = trainer.evaluate(x_test, y_test, batch_size=256)
    if config.get("save") and mixprec.distributed.is_main_process():
        path = Path(config["save"]) / f"{config['label']}.safetensors"
        mixprec.save_checkpoint(path, model, trainer.optimizer, trainer.resume_state())
    done = mixprec.levels.applied(model)
    return {
        "label": config["label"],
        "policy": done.policy.name if done else config["policy"],
        "level": done.level if done else config["level"],
        "test_accuracy": test["accuracy"],
        "final_loss": history.history["loss"][-1],
        "loss_curve": history.history["loss"],
        "val_loss_curve": history.history["val_loss"],
        "ms_per_step": sorted(history.history["ms_per_step"])[len(history.epoch) // 2],
        "seconds": seconds,
        "skipped_steps": sum(history.history["skipped_steps"]),
        "peak_mb": memory.mb(),
        "memory_kind": memory.kind,
        "float8_layers": float8_layers,
    }


def _table(runs: list[dict[str, Any]]) -> str:
    base = runs[0]["ms_per_step"]
    header = (
        f"{'run':<24} {'test acc':>8} {'loss':>8} {'ms/step':>8} {'speedup':>8} "
        f"{'peak MB':>8} {'skipped':>7}"
    )
    lines = [header, "-" * len(header)]
    for r in runs:
        lines.append(
            f"{r['policy'] + ' (' + r['level'] + ')':<24} {r['test_accuracy']:>8.3f} "
            f"{r['final_loss']:>8.4f} {r['ms_per_step']:>8.2f} {base / r['ms_per_step']:>7.2f}x "
            f"{_mb(r['peak_mb']):>8} {r['skipped_steps']:>7d}"
        )
    return "\n".join(lines)


def _mb(value: float | None) -> str:
    return "-" if value is None else f"{value:.0f}"


def _plot(runs: list[dict[str, Any]], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")  # headless: no display needed
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    fig, ax = plt.subplots(figsize=(7, 4))
    # The runs often overlap closely: the first is drawn wide and pale beneath, the second
    # narrow with markers on top, so that both stay visible where they coincide.
    styles = [
        {"color": "tab:blue", "linewidth": 4.0, "alpha": 0.45},
        {"color": "tab:orange", "linewidth": 1.5, "marker": "o", "markersize": 3},
    ]
    for r, style in zip(runs, styles[-len(runs) :], strict=True):
        epochs = range(1, len(r["loss_curve"]) + 1)
        name = f"{r['policy']} ({r['level']})"
        ax.plot(epochs, r["loss_curve"], label=f"{name} train", **style)  # type: ignore[arg-type]
        ax.plot(epochs, r["val_loss_curve"], "--", label=f"{name} test", **style)  # type: ignore[arg-type]
    ax.set_title("mixprec train: loss per epoch, " + " vs ".join(r["policy"] for r in runs))
    ax.set_xlabel("epoch")
    ax.set_ylabel("loss (log scale)")
    ax.set_yscale("log")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.legend()
    ax.grid(True, alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _policy_option(kind: str, value: str, extra: Sequence[str] = ()) -> None:
    """A preset name, or the ``params=...,compute=...,output=...`` string the library takes."""
    if "=" in value:
        try:
            Policy(value)
        except ValueError as err:
            raise UsageError(str(err)) from None
        return
    _choice(kind, value, [*NAMES, *extra])


def _check_model_options(args: argparse.Namespace) -> None:
    """The options train and doctor share (see ``_model_options``)."""
    _choice("model", args.model, TRAIN_MODELS)
    if args.data not in ("digits", "synthetic") and not args.data.startswith("mnist:"):
        _choice("data", args.data, DATA)
    _policy_option("policy", args.policy)
    if args.level.upper() not in (*LEVELS, "AUTO"):
        _choice("level", args.level, [*LEVELS, "auto"])
    if args.batch_size < 1:
        raise UsageError(f"--batch-size must be >= 1, got {args.batch_size}")


def _train(args: argparse.Namespace) -> int:
    _check_model_options(args)
    if args.compare != "none":
        _policy_option("compare", args.compare, extra=["none"])
    if args.epochs < 1:
        raise UsageError(f"--epochs must be >= 1, got {args.epochs}")
    # Output paths are checked before training, not found unusable after it.
    if args.save:
        _output_dir("--save", args.save)
    plot = _output_file("--plot", args.plot, ".png") if args.plot else None

    common = {
        "model": args.model, "data": args.data, "epochs": args.epochs, "seed": args.seed,
        "batch_size": args.batch_size, "lr": args.lr, "save": args.save,
        "verbose": 0 if args.quiet else 1, "compile": args.compile,
        "float8_min_features": args.float8_min_features,
    }  # fmt: skip
    _float8_sizes(args.float8_min_features)  # a bad value fails before training
    configs = []
    if args.compare != "none":
        configs.append({**common, "label": "baseline", "policy": args.compare, "level": "auto"})
    mixed_policy, note = _mixed_run_policy(args.policy)
    configs.append({**common, "label": "mixed", "policy": mixed_policy, "level": args.level})

    runs = []
    spawn = multiprocessing.get_context("spawn")
    # Under torchrun every process is one rank: train here, print on rank 0 only.
    under_torchrun = int(os.environ.get("WORLD_SIZE", "1")) > 1
    say = print if not under_torchrun or os.environ.get("RANK", "0") == "0" else _silent
    if note:
        say(note, flush=True)
    for config in configs:
        say(f"training {config['policy']} (level {config['level']}) ...", flush=True)
        if args.in_process or under_torchrun:
            if under_torchrun and config["verbose"] and os.environ.get("RANK", "0") != "0":
                config = {**config, "verbose": 0}
            runs.append(run_training(config))
            continue
        with concurrent.futures.ProcessPoolExecutor(1, mp_context=spawn) as pool:
            runs.append(pool.submit(run_training, config).result())
    say()
    say(_table(runs))
    for run in runs:
        if run.get("float8_layers"):
            rule = _float8_rule(_train_float8(args.float8_min_features))
            say(f"{run['label']} run: float8 in {run['float8_layers']} Linear layers "
                f"({rule}; the output head stays bfloat16)")  # fmt: skip
    say(f"(peak MB: {runs[0]['memory_kind']}; speedup: ms/step of the first row / this row)")
    if len(runs) == 2:
        diff = runs[1]["test_accuracy"] - runs[0]["test_accuracy"]
        same = (runs[0]["policy"], runs[0]["level"]) == (runs[1]["policy"], runs[1]["level"])
        speed = (
            "the same configuration twice: the speed column is run-to-run noise"
            if same
            else f"{runs[0]['ms_per_step'] / runs[1]['ms_per_step']:.2f}x the speed"
            + (" (16-bit math emulated on this CPU)" if note else "")
            + (" (float8 matmuls emulated on CPU)" if runs[1].get("float8_layers") else "")
        )
        say(
            f"\n{runs[1]['policy']}: test accuracy {runs[1]['test_accuracy']:.3f} vs "
            f"{runs[0]['policy']} {runs[0]['test_accuracy']:.3f} ({diff:+.3f}), {speed}"
        )
    if plot and say is print:
        _plot(runs, plot)
        say(f"loss curves written to {plot}")
    return 0


def _mixed_run_policy(policy: str) -> tuple[str, str | None]:
    """The policy of the main job's mixed run, and a line to print about it.

    ``auto`` where it picks float32 (a CPU without fast 16-bit math) would train float32
    twice; the main job exists to show mixed precision, so it trains bfloat16 instead and
    says why ``auto`` would not, and what the speed column then measures."""
    if policy.strip().lower() != "auto":
        return policy, None
    chosen = Policy("auto")
    if chosen.is_mixed:
        return policy, None
    return "mixed_bfloat16", (
        f"auto picks float32 here ({chosen.reason}); the mixed run trains mixed_bfloat16 "
        "anyway, to show mixed precision. Its accuracy is what bfloat16 gives on any "
        "hardware; its speed is this CPU's emulated 16-bit math, not a fast 16-bit unit's."
    )


def _silent(*args: Any, **kwargs: Any) -> None:
    """print() on the ranks that stay quiet."""


def _convert(args: argparse.Namespace) -> int:
    _output_file("output", args.output)
    report = mixprec.convert_checkpoint(args.input, args.output, args.dtype, args.on_range)
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


def _inspect(args: argparse.Namespace) -> int:
    tensors, header = mixprec.read_checkpoint(args.checkpoint)
    print(f"{args.checkpoint}: {len(tensors)} tensors")
    for key in ("format_version", "mixprec_version", "torch_version", "policy", "level"):
        if header.get(key) is not None:
            print(f"  {key}: {header[key]}")
    if header.get("masters"):
        print(f"  float32 masters stored for: {', '.join(header['masters'])}")
    trainer = mixprec.checkpoint._unflatten(header.get("trainer_state", {"__dict__": []}), tensors)
    scalars = {k: v for k, v in trainer.items() if not isinstance(v, torch.Tensor)}
    if scalars:
        print(f"  trainer state: {scalars}")
    width = max((len(n) for n in tensors), default=0)
    total = 0
    for name in sorted(tensors):
        t = tensors[name]
        total += t.numel() * t.element_size()
        print(f"  {name:<{width}}  {str(t.dtype).removeprefix('torch.'):<9} {tuple(t.shape)}")
    print(f"  {total / 2**20:.2f} MiB of tensor data")
    return 0


def _doctor(args: argparse.Namespace) -> int:
    """Diagnose one batch of the chosen data with the chosen (untrained) model."""
    _check_model_options(args)
    torch.manual_seed(args.seed)
    json_path = _output_file("--json", args.json) if args.json else None
    plot_path = _output_file("--plot", args.plot, ".png") if args.plot else None
    (x_train, y_train), (_, y_test) = _load(args.data, args.seed)
    classes = int(max(y_train.max(), y_test.max())) + 1
    model = _build(args.model, x_train, classes)
    x, y = x_train[: args.batch_size], y_train[: args.batch_size]
    loss_fn = torch.nn.functional.cross_entropy
    float8 = None
    if Policy(args.policy).float8_recipe is not None:
        if plot_path:
            raise UsageError("--plot: the float8 doctor's report is a table; use --json")
        float8 = _train_float8(None)  # as `mixprec train` converts: the head kept
    report = mixprec.diagnose(model, x, y, loss_fn, args.policy, args.level, float8=float8)
    print(report)
    if json_path:
        Path(json_path).write_text(report.to_json(indent=2))
        print(f"report written to {json_path}")
    if plot_path and isinstance(report, mixprec.Report):
        report.plot(plot_path)
        print(f"ranges plotted to {plot_path}")
    return 0


def _bench(args: argparse.Namespace) -> int:
    from mixprec import bench

    workloads = args.workload or list(bench.DEFAULT_WORKLOADS)
    for w in workloads:
        if ":" not in w:
            _choice("workload", w, list(bench.WORKLOADS))
        else:
            _workload_function(w)
    _check_device(args.device)
    json_path = _output_file("--json", args.json) if args.json else None
    plot_path = _output_file("--plot", args.plot, ".png") if args.plot else None
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
        _choice("mode", base, list(bench.ALL_MODES))
    try:
        bench.require_float8(modes)
    except ImportError as err:
        raise UsageError(f"--modes {','.join(m for m in modes if bench.is_float8_mode(m))}: "
                         f"{err}") from err  # fmt: skip
    float8 = _float8_sizes(args.float8_min_features)
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
                "H100 size thresholds" if float8 is None else _float8_rule(float8))  # fmt: skip
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


def _float8_sizes(value: str | None) -> mixprec.Float8Options | None:
    """``--float8-min-features``: ``None`` (each workload's rule), ``torchao`` (torchao's
    size thresholds) or N (both dims >= N)."""
    if value is None:
        return None
    if value == "torchao":
        return mixprec.Float8Options()
    try:
        n = int(value)
    except ValueError:
        n = 0
    if n < 1:
        raise UsageError(f"--float8-min-features must be an int >= 1 or 'torchao', got {value!r}")
    return mixprec.Float8Options(min_features=n)


def _train_float8(value: str | None) -> mixprec.Float8Options:
    """The float8 layer rule of `mixprec train` and `doctor`: ``--float8-min-features``, by
    default ``TRAIN_FLOAT8_MIN_FEATURES``."""
    return _float8_sizes(value) or mixprec.Float8Options(min_features=TRAIN_FLOAT8_MIN_FEATURES)


def _float8_rule(options: mixprec.Float8Options) -> str:
    if options.min_features is None:
        return "torchao's H100 size thresholds"
    return f"both dims >= {options.min_features} (--float8-min-features)"


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


def _info(_: argparse.Namespace) -> int:
    hw = probe_hardware()
    policy = Policy("auto")
    print(f"mixprec {mixprec.__version__}, torch {torch.__version__}")
    print(f"hardware: {hw.detail} (fast bfloat16: {hw.bf16_fast}, fast float16: {hw.fp16_fast})")
    print(f"auto policy: {policy.name} ({policy})")
    print(f"  because: {policy.reason}")
    print(f"auto level for it: {resolve_level('auto', policy)}")
    return 0


def _model_options(sub: argparse.ArgumentParser, policy: str, batch_size: int) -> None:
    sub.add_argument("--model", default="mlp", help=f"one of {', '.join(TRAIN_MODELS)}")
    sub.add_argument("--data", default="digits", help=f"one of {', '.join(DATA)}")
    sub.add_argument("--policy", default=policy, help=f"one of {', '.join(NAMES)}")
    sub.add_argument("--level", default="auto", help="O0, O1, O2, O3 or auto")
    sub.add_argument("--batch-size", type=int, default=batch_size)
    sub.add_argument("--seed", type=int, default=0)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="mixprec", description=mixprec.__doc__)
    parser.add_argument("--version", action="version", version=mixprec.__version__)
    commands = parser.add_subparsers(dest="command", required=True)

    train = commands.add_parser(
        "train", help="train a model in mixed precision and compare it with float32"
    )
    _model_options(train, policy="auto", batch_size=64)
    train.add_argument("--epochs", type=int, default=20)
    train.add_argument("--lr", type=float, default=1e-3)
    train.add_argument(
        "--compare", default="float32", help="baseline policy to compare with, or 'none'"
    )
    train.add_argument("--plot", metavar="FILE.png", help="write the loss curves of both runs")
    train.add_argument("--save", metavar="DIR", help="save each run's final trainer state")
    train.add_argument("--quiet", action="store_true", help="no progress output")
    train.add_argument(
        "--compile", action="store_true", help="torch.compile each run's forward and loss"
    )
    train.add_argument(
        "--in-process", action="store_true", help="no subprocess per run (peak memory is shared)"
    )
    train.add_argument(
        "--float8-min-features", metavar="N|torchao",
        help="float8 policies convert Linear layers with both dims >= N (default "
        f"{TRAIN_FLOAT8_MIN_FEATURES}: the small models' layers), or by torchao's H100 size "
        "thresholds",
    )  # fmt: skip
    train.set_defaults(run=_train)

    convert = commands.add_parser(
        "convert", help="rewrite a checkpoint's weights as safetensors in one dtype"
    )
    convert.add_argument("input", help="mixprec checkpoint, .safetensors or torch.save file")
    convert.add_argument("output", help="the .safetensors file to write")
    convert.add_argument("--dtype", default="float32", help="float32, bfloat16 or float16")
    convert.add_argument(
        "--on-range", default="error", choices=("error", "clamp", "ignore"),
        help="values beyond the dtype's range: fail (default), saturate, or cast as is; "
        "NaN/inf fail unless 'ignore'",
    )  # fmt: skip
    convert.set_defaults(run=_convert)

    inspect = commands.add_parser("inspect", help="list a checkpoint's tensors and metadata")
    inspect.add_argument("checkpoint")
    inspect.set_defaults(run=_inspect)

    doctor = commands.add_parser(
        "doctor", help="per-layer numerics of one batch in 16 bits against float32"
    )
    _model_options(doctor, policy="mixed_float16", batch_size=256)
    doctor.add_argument("--json", metavar="FILE", help="write the report as JSON")
    doctor.add_argument("--plot", metavar="FILE.png", help="plot per-layer ranges")
    doctor.set_defaults(run=_doctor)

    bench = commands.add_parser(
        "bench", help="time mixprec's modes against float32 and torch.autocast in one run"
    )
    bench.add_argument(
        "workload", nargs="*",
        help="mlp-b64, mlp-b8192, lm-d512, cnn, lm-d2048 (d=2048, for GPUs) or "
        "module:function (default: the first four)",
    )  # fmt: skip
    bench.add_argument(
        "--modes",
        help="comma-separated, each optionally MODE+compile; default: all but the float8 "
        "ones. float8 (needs mixprec[float8]): O2-fp8 (policy mixed_float8), O2-fp8-rowwise "
        "(mixed_float8_rowwise), O2-fp8-rowwise_with_gw_hp (mixed_float8_rowwise_with_gw_hp)",
    )  # fmt: skip
    bench.add_argument(
        "--policy", metavar="POLICY",
        help="add the policy's O2 mode (mixed_float8: O2-fp8) beside float32 and O2-bf16, or "
        "beside --modes",
    )  # fmt: skip
    bench.add_argument("--repeats", type=int, default=5)
    bench.add_argument("--steps", type=int, default=3, help="steps per timed round, at least")
    bench.add_argument(
        "--min-round-ms", type=float, default=100.0,
        help="more steps per round where the fastest mode would take less (default 100)",
    )  # fmt: skip
    bench.add_argument("--warmup", type=int, default=2)
    bench.add_argument("--device", default="auto")
    bench.add_argument("--no-memory", action="store_true", help="skip peak-memory runs")
    bench.add_argument(
        "--small", action="store_true",
        help="tiny sizes, for tests (lm-d2048 keeps d=2048: one block, 2 x 64 tokens)",
    )  # fmt: skip
    bench.add_argument(
        "--max-batch", type=float, metavar="MB",
        help="instead of timing: the largest batch per mode within this peak-memory budget",
    )  # fmt: skip
    bench.add_argument("--batch-limit", type=int, default=1 << 16, help="for --max-batch")
    bench.add_argument(
        "--outputs-16bit", action="store_true",
        help="the models return their compute dtype (policy output=compute) to a loss that "
        "computes in float32 from it, such as mixprec.cross_entropy: saves memory",
    )  # fmt: skip
    bench.add_argument(
        "--compile", action="store_true",
        help="add each mode under torch.compile (MODE+compile), compile time reported apart",
    )  # fmt: skip
    bench.add_argument(
        "--compile-mode", help="torch.compile mode for +compile modes, e.g. max-autotune"
    )
    bench.add_argument(
        "--float8-min-features", metavar="N|torchao",
        help="float8 modes convert Linear layers with both dims >= N, or by torchao's H100 "
        "size thresholds (default: every block Linear of the LMs, torchao's elsewhere)",
    )  # fmt: skip
    bench.add_argument("--json", metavar="FILE")
    bench.add_argument("--plot", metavar="FILE.png")
    bench.set_defaults(run=_bench)

    info = commands.add_parser("info", help="what mixprec sees on this machine")
    info.set_defaults(run=_info)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args.run(args))
    except (UsageError, OSError, ValueError) as err:  # OSError: a path that went bad mid-run
        print(f"mixprec {args.command}: error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"mixprec {args.command}: interrupted", file=sys.stderr)
        return 130
    finally:
        # Under torchrun: leave the process group cleanly (gloo aborts the process otherwise);
        # no barrier, as another rank may have failed.
        mixprec.distributed.shutdown(wait=False)


if __name__ == "__main__":
    sys.exit(main())
