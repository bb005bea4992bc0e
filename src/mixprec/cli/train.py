"""``mixprec train``: train a model in mixed precision and in a baseline policy, and compare
their accuracy, speed and memory.

Each run trains in a fresh process by default, so that its peak memory is its own; that
worker never outlives the command (``_train_worker``).
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import time
from pathlib import Path
from typing import Any

import torch

from mixprec import distributed
from mixprec._step_profile import matmul_ms, memory_parts
from mixprec.checkpoint import save_checkpoint
from mixprec.cli import _train_report as report
from mixprec.cli._common import (
    TRAIN_FLOAT8_MIN_FEATURES,
    UsageError,
    float8_rule,
    float8_sizes,
    in_the_way,
    output_dir,
    plot_file,
    policy_option,
    train_float8,
)
from mixprec.cli._model_options import (
    SPEC_HELP,
    add_model_options,
    build_model,
    check_model_options,
    classes_of,
    is_spec,
    load_data,
)
from mixprec.cli._train_worker import in_subprocess
from mixprec.float8 import layer_counts
from mixprec.levels import applied, auto_mixed_precision, resolve_level
from mixprec.policy import Policy
from mixprec.train import Trainer
from mixprec.train.batches import to_device
from mixprec.train.callbacks import History

HELP = "train a model in mixed precision and compare it with float32"
EPILOG = SPEC_HELP  # what --model and --data module:function must name
MEMORY_HINT = "a smaller --hidden or --batch-size"  # said where an allocation fails

# The main job's defaults: a step whose matmuls dominate (64 -> 2048 -> 2048 -> 10 at batch
# 256 is ~6.6 GFLOP a step), so that the precision of the matmuls decides its speed. At width
# 512 and batch 64 a step is ~0.1 GFLOP, mostly optimizer and Python, and no precision
# speeds it up.
DEFAULT_HIDDEN = 2048
DEFAULT_BATCH = 256
DEFAULT_EPOCHS = 20
OPTIMIZER = "torch.optim.Adam(fused=True)"
# Steps a probe run times where auto picks float32 (emulated 16-bit math is slow).
PROBE_STEPS = 4


def add_arguments(sub: argparse.ArgumentParser) -> None:
    """The options of ``mixprec train``."""
    add_model_options(sub, policy="auto", batch_size=DEFAULT_BATCH)
    sub.add_argument(
        "--hidden", type=int, default=None, metavar="N",
        help=f"the MLP's width (--model mlp only) (default: {DEFAULT_HIDDEN})",
    )  # fmt: skip
    sub.add_argument(
        "--epochs", type=int, default=DEFAULT_EPOCHS, metavar="N", help="passes over the data"
    )
    sub.add_argument("--lr", type=float, default=1e-3, help="Adam's learning rate")
    sub.add_argument(
        "--compare", default="float32", metavar="POLICY",
        help="the baseline policy trained beside --policy, or 'none'",
    )  # fmt: skip
    sub.add_argument("--plot", metavar="FILE.png", help="write the loss curves of both runs")
    sub.add_argument(
        "--save", metavar="DIR",
        help="save each run's final trainer state as DIR/baseline.safetensors and "
        "DIR/mixed.safetensors (replacing earlier ones, which the output says)",
    )  # fmt: skip
    sub.add_argument("--quiet", action="store_true", help="no progress output")
    sub.add_argument(
        "--compile", action="store_true", help="torch.compile each run's forward and loss"
    )
    sub.add_argument(
        "--in-process", action="store_true", help="no subprocess per run (peak memory is shared)"
    )
    sub.add_argument(
        "--float8-min-features", metavar="N|torchao",
        help="float8 policies convert Linear layers with both dims >= N (default "
        f"{TRAIN_FLOAT8_MIN_FEATURES}: the small models' layers), or by torchao's H100 size "
        "thresholds",
    )  # fmt: skip


def run_training(config: dict[str, Any]) -> dict[str, Any]:
    """One training run; executed in a fresh process so that its peak memory is its own."""
    torch.manual_seed(config["seed"])
    splits = load_data(config["data"], config["seed"])
    (x_train, y_train), (x_test, y_test) = splits
    probe = config.get("probe_steps")
    if probe:  # a few steps only, to time them
        x_train, y_train = (
            x_train[: probe * config["batch_size"]],
            y_train[: probe * config["batch_size"]],
        )
        config = {**config, "epochs": 1}
    model = build_model(
        config["model"], x_train, classes_of(splits), config.get("hidden", 512), config["data"]
    )
    policy: str | None = config["policy"]
    float8_layers = None
    chosen = Policy(config["policy"])
    if chosen.float8_recipe is not None and resolve_level(config["level"], chosen) != "O0":
        # float8 options are per model: prepare here, then hand the model over prepared
        # (O0 converts no layer: the policy goes to the Trainer as any other).
        options = train_float8(config.get("float8_min_features"))
        auto_mixed_precision(model, config["policy"], config["level"], float8=options)
        converted, considered = layer_counts(model)
        float8_layers = f"{converted} of {considered}"
        policy = None
    # One optimizer implementation in every run, named in the output: torch's fused Adam
    # (one kernel a step for all parameters, float32 masters included).
    optimizer = torch.optim.Adam(model.parameters(), lr=config["lr"], fused=True)
    trainer = Trainer(
        model, "cross_entropy", optimizer, policy=policy, level=config["level"],
        compile=config.get("compile", False),
    )  # fmt: skip
    from mixprec.bench import PeakMemory

    memory = PeakMemory(trainer.device)  # the run's own peak: this process trains once
    history, diverged = History(), None  # the epochs done, also where a step raises
    start = time.perf_counter()
    try:
        trainer.fit(
            x_train, y_train, batch_size=config["batch_size"], epochs=config["epochs"],
            validation_data=(x_test, y_test), verbose=config["verbose"], callbacks=[history],
        )  # fmt: skip
    except FloatingPointError as err:  # float16 weights past 65504: the run diverged
        diverged = str(err).split(". ")[0]  # which weights; the API's advice is left out
    seconds = time.perf_counter() - start
    test = trainer.evaluate(x_test, y_test, batch_size=256)
    checkpoint = None
    if config.get("save") is not None and not probe and distributed.is_main_process():
        path = Path(config["save"]) / f"{config['label']}.safetensors"
        checkpoint = (str(path), path.exists())  # said after the table: written or replaced
        save_checkpoint(path, model, trainer.optimizer, trainer.resume_state())
    done = applied(model)
    parts = memory_parts(model, trainer.optimizer)
    matmul = None
    if not probe and diverged is None:  # a step of a diverged float16 run raises again
        # On the trainer's device (a GPU where there is one), timed there.
        size, device = config["batch_size"], trainer.device
        x1, y1 = to_device(x_train[:size], device), to_device(y_train[:size], device)
        matmul = matmul_ms(lambda: trainer.step(x1, y1), device=str(device))
    return {
        "label": config["label"],
        "policy": done.policy.name if done else config["policy"],
        "level": done.level if done else config["level"],
        "test_accuracy": test["accuracy"],
        "test_loss": test["loss"],
        "final_loss": (history.history.get("loss") or [math.nan])[-1],
        "loss_curve": history.history.get("loss", []),
        "val_loss_curve": history.history.get("val_loss", []),
        # The median over the epochs of each epoch's median step; before an epoch ends (a
        # step raised), the time over the steps taken.
        "ms_per_step": statistics.median(history.history["ms_per_step"])
        if history.epoch
        else 1000 * seconds / max(trainer.global_step, 1),
        "seconds": seconds,
        "skipped_steps": sum(history.history.get("skipped_steps", [])),
        "diverged": diverged,
        "checkpoint": checkpoint,
        "peak_mb": memory.mb(),
        "memory_kind": memory.kind,
        "float8_layers": float8_layers,
        "optimizer": OPTIMIZER,
        "matmul_ms": matmul,
        "memory_parts": parts.describe(),
        "masters": parts.masters > 0,  # what the "buys little" line may name
        # What the peak above the start holds for the parameters: the optimizer state and
        # gradients appear during training; weights and masters exist before it starts.
        "kept_mb": (parts.optimizer_state + parts.gradients) / 2.0**20,
    }


def run(args: argparse.Namespace) -> int:
    """Train the baseline (unless ``--compare none``) and the mixed run; print the table."""
    check_model_options(args)
    if args.compare != "none":
        policy_option("compare", args.compare, extra=["none"])
    if args.epochs < 1:
        raise UsageError(f"--epochs must be >= 1, got {args.epochs}")
    if not (math.isfinite(args.lr) and args.lr > 0):  # 0 trains nothing, inf NaNs every step
        raise UsageError(f"--lr must be a finite number > 0, got {args.lr:g}")
    # Output paths are checked before training, not found unusable after it; an empty one
    # is refused, not taken for "none".
    if args.save is not None:
        output_dir("--save", args.save)
    plot = plot_file("--plot", args.plot) if args.plot is not None else None

    if args.hidden is not None and args.model != "mlp":
        raise UsageError(f"--hidden sets the MLP's width; --model {args.model} has none")
    if args.hidden is not None and args.hidden < 1:
        raise UsageError(f"--hidden must be >= 1, got {args.hidden}")
    float8_sizes(args.float8_min_features)  # a bad value fails before training
    float8_policies = [p for p in (args.policy, args.compare) if _is_float8(p)]
    if args.float8_min_features is not None and not float8_policies:
        raise UsageError(
            f"--float8-min-features applies to float8 policies (mixed_float8...); "
            f"--policy {args.policy} and --compare {args.compare} convert no layer"
        )
    common = {
        "model": args.model, "data": args.data, "epochs": args.epochs, "seed": args.seed,
        "hidden": args.hidden if args.hidden is not None else DEFAULT_HIDDEN,
        "batch_size": args.batch_size, "lr": args.lr, "save": args.save,
        "verbose": 0 if args.quiet else 1, "compile": args.compile,
        "float8_min_features": args.float8_min_features,
    }  # fmt: skip
    under_torchrun = int(os.environ.get("WORLD_SIZE", "1")) > 1
    if (is_spec(args.model) or is_spec(args.data)) and not (args.in_process or under_torchrun):
        # A user's model or data fails here, in one line, not in each run's worker.
        torch.manual_seed(args.seed)
        splits = load_data(args.data, args.seed)
        build_model(args.model, splits[0][0], classes_of(splits), common["hidden"], args.data)
    configs = []
    if args.compare != "none":
        configs.append({**common, "label": "baseline", "policy": args.compare, "level": "auto"})
    mixed_policy, auto_float32 = _mixed_run_policy(args.policy)
    if auto_float32 is not None and (
        args.compare not in ("float32", "none") or args.level.upper() == "O0"
    ):
        # Compared with another policy, auto's float32 is a run of its own, not a probe; at
        # O0 a bfloat16 probe would compute in float32 too.
        mixed_policy, auto_float32 = "auto", None
    mixed = {**common, "label": "mixed", "policy": mixed_policy, "level": args.level}
    if auto_float32 is not None:  # time a few emulated steps only; train float32
        mixed = {**mixed, "label": "probe", "probe_steps": PROBE_STEPS, "verbose": 0}
        if args.compare == "none":
            configs.append({**common, "label": "baseline", "policy": "float32", "level": "auto"})
    configs.append(mixed)
    if args.save is not None:
        _check_save(args.save, [c["label"] for c in configs if not c.get("probe_steps")])

    runs = []
    # Under torchrun every process is one rank: train here, print on rank 0 only.
    say = print if not under_torchrun or os.environ.get("RANK", "0") == "0" else _silent
    for config in configs:
        doing = "timing" if config.get("probe_steps") else "training"
        say(f"{doing} {_run_name(config['policy'], config['level'])} ...", flush=True)
        if under_torchrun and config["verbose"] and os.environ.get("RANK", "0") != "0":
            config = {**config, "verbose": 0}
        try:
            here = args.in_process or under_torchrun
            runs.append(run_training(config) if here else _in_subprocess(config))
        except Exception:
            for line in report.finished_before(runs):  # not lost with the run that failed
                say(line, flush=True)
            raise
    probe = runs.pop() if auto_float32 is not None else None
    say()
    say(report.table(runs))
    say(f"optimizer: {OPTIMIZER} in every run")
    for result in runs:
        if result.get("float8_layers"):
            rule = float8_rule(train_float8(args.float8_min_features))
            say(f"{result['label']} run: float8 in {result['float8_layers']} Linear layers "
                f"({rule}; the output head stays bfloat16)")  # fmt: skip
    say(f"(peak MB: {runs[0]['memory_kind']}; speedup: ms/step of the first row / this row)")
    # By the math each run does: a mixed policy at O0 computes in float32 throughout; the
    # same policy at O1, O2 and O3 does not compute the same.
    same_math = len(runs) == 2 and report.math_of(runs[0]) == report.math_of(runs[1])
    if len(runs) == 2:
        diff = runs[1]["test_accuracy"] - runs[0]["test_accuracy"]
        speed = (
            report.same_math_text(runs)
            if same_math
            else f"{runs[0]['ms_per_step'] / runs[1]['ms_per_step']:.2f}x the speed"
            + (" (float8 matmuls emulated on CPU)" if runs[1].get("float8_layers") else "")
        )
        say(
            f"\n{runs[1]['policy']}: test accuracy {runs[1]['test_accuracy']:.3f} vs "
            f"{runs[0]['policy']} {runs[0]['test_accuracy']:.3f} ({diff:+.3f}), {speed}"
        )
    for line in report.explain_speed(runs, same_math) + report.explain_memory(runs):
        say(line)
    if probe is not None and auto_float32 is not None:
        say(report.probe_line(auto_float32, runs[0], probe))
    if plot and say is print:
        report.plot(runs, plot)
        say(f"loss curves written to {plot}")
    for result in runs:  # --save: what was written, and what it replaced
        if result.get("checkpoint"):
            path, replaced = result["checkpoint"]
            said = " (replaced the file there)" if replaced else ""
            say(f"checkpoint written to {path}{said}")
    # The epoch loss leaves out steps whose loss was not finite, so a run that diverged
    # can show a finite one: its test loss says it, and so does the exit status.
    diverged = [r for r in runs if r.get("diverged") or not math.isfinite(r["test_loss"])]
    for r in diverged:
        reason = r.get("diverged") or (
            f"its test loss is {r['test_loss']} ({r['skipped_steps']} steps skipped for "
            "non-finite values)"
        )
        say(f"{r['policy']} ({r['level']}) diverged: {reason}; a smaller --lr may train")
    return 1 if diverged else 0


def _in_subprocess(config: dict[str, Any]) -> dict[str, Any]:
    """``run_training(config)`` in a fresh process of its own (``_train_worker``)."""
    return in_subprocess(run_training, config)


def _check_save(save: str, labels: list[str]) -> None:
    """Each run's checkpoint in ``--save DIR`` can be written: not found after training."""
    for label in labels:
        path = Path(save) / f"{label}.safetensors"
        problem = in_the_way(path)
        if problem:
            raise UsageError(
                f"--save {save!r}: the {label} run's checkpoint {str(path)!r} {problem}; give "
                "a directory where it can be written"
            )


def _mixed_run_policy(policy: str) -> tuple[str, str | None]:
    """The policy of the main job's mixed run, and the reason when ``auto`` picks float32.

    ``auto`` picks float32 on a CPU without fast 16-bit math, where bfloat16 matmuls are
    emulated: the main job then trains float32 and times a few mixed_bfloat16 steps only,
    to say with a measured figure why it does not train them (``probe_line``)."""
    if policy.strip().lower() != "auto":
        return policy, None
    chosen = Policy("auto")
    if chosen.is_mixed:
        return policy, None
    return "mixed_bfloat16", chosen.reason


def _is_float8(policy: str) -> bool:
    """Whether ``policy`` (an option's text, "none" for --compare) has float8 matmuls."""
    return policy != "none" and Policy(policy).float8_recipe is not None


def _run_name(policy: str, level: str) -> str:
    """The policy and level a run trains in, as the results table names them:
    ``auto -> mixed_bfloat16 (level O2)`` where the option names them differently."""
    resolved = Policy(policy)
    name = f"{resolved.name} (level {resolve_level(level, resolved)})"
    return name if policy.strip().lower() == resolved.name else f"{policy} -> {name}"


def _silent(*args: Any, **kwargs: Any) -> None:
    """print() on the ranks that stay quiet."""
