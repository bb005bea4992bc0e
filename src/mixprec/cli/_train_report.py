"""What ``mixprec train`` prints after its runs: the table, the lines that say why the
mixed run gained what it gained (matmul share of a step, memory by kind), and the plot."""

from __future__ import annotations

from typing import Any

from mixprec._hardware import cpu_16bit_units
from mixprec._step_profile import GAIN_THRESHOLD, no_gain_line, other_work, why_no_gain
from mixprec.levels import resolve_level
from mixprec.policy import Policy

#: What ``math_of`` gives a run whose math is float32 throughout.
FLOAT32_MATH = ("float32",)


def math_of(run: dict[str, Any]) -> tuple[object, ...]:
    """What a run computes, to say when two runs do the same math: float32 at O0 whatever
    the policy, and for a float32 policy; else its policy (dtypes and float8 recipe) and
    level, as O1, O2 and O3 compute with the same dtype but cast, store and step
    different tensors in it."""
    policy = Policy(run["policy"])
    level = resolve_level(run["level"], policy)
    if level == "O0" or policy == Policy("float32"):
        return FLOAT32_MATH
    return (policy, level)


def same_math_text(runs: list[dict[str, Any]]) -> str:
    """What replaces the speed figure where both runs do the same math (``math_of``)."""
    o0 = any(r["level"] == "O0" for r in runs)
    why = " (O0 computes in float32 whatever the policy)" if o0 else ""
    return f"the same math in both runs{why}: the speed column is run-to-run noise"


def _name(run: dict[str, Any]) -> str:
    """A run's name in a line comparing it: "float32" where its math is float32."""
    return "float32" if math_of(run) == FLOAT32_MATH else f"{run['policy']} ({run['level']})"


def _other_work(run: dict[str, Any]) -> str:
    """What a run's step does besides its matmuls: float32 masters where it keeps them
    (``run_training``'s ``masters``; O2 where that is missing), loss scaling for float16."""
    scaled = Policy(run["policy"]).loss_scaling == "dynamic" and run["level"] != "O0"
    return other_work(masters=run.get("masters", run["level"] == "O2"), loss_scaling=scaled)


def explain_speed(runs: list[dict[str, Any]], same_math: bool = False) -> list[str]:
    """Lines that say where the step time goes in each run and, where the mixed run gains
    less than ``GAIN_THRESHOLD``, why: mixed precision speeds up matmuls, so a step that
    spends little of its time in them gains little on any hardware. ``same_math``: both
    runs do the same math (``math_of``): no gain is expected, nor said. The first run is
    named where its math is not float32."""
    lines = []
    for r in runs:
        if r.get("matmul_ms") is not None:
            share = min(r["matmul_ms"] / r["ms_per_step"], 1.0)
            lines.append(
                f"  {r['policy']} ({r['level']}): {r['matmul_ms']:.2f} of {r['ms_per_step']:.2f} "
                f"ms a step in matmuls ({share:.0%})"
            )
    if lines:
        lines.insert(0, "time in matmuls, the work 16-bit math speeds up:")
    if not same_math and len(runs) == 2 and all(r.get("matmul_ms") is not None for r in runs):
        base, mixed = runs
        speedup = base["ms_per_step"] / mixed["ms_per_step"]
        if speedup < GAIN_THRESHOLD:
            reason = why_no_gain(
                base["ms_per_step"],
                mixed["ms_per_step"],
                base_matmul_ms=base["matmul_ms"],
                mixed_matmul_ms=mixed["matmul_ms"],
                base=_name(base),
                rest=_other_work(mixed),
            )
            over = None if _name(base) == "float32" else _name(base)
            lines.append(no_gain_line(speedup, reason, over))
    return lines


def explain_memory(runs: list[dict[str, Any]]) -> list[str]:
    """One line per run: what it keeps per parameter, and what the peak adds beyond that."""
    lines = []
    for r in runs:
        parts = r.get("memory_parts")
        if parts is None:
            continue
        line = f"  {r['policy']} ({r['level']}): {parts}"
        if r.get("peak_mb") is not None and r.get("kept_mb") is not None:
            rest = r["peak_mb"] - r["kept_mb"]
            line += f"; the rest of the peak (activations, kernel workspace): {max(rest, 0):.1f}"
        lines.append(line)
    if lines:
        lines.insert(0, "memory by kind (MB):")
        lines.append(
            "(O2 keeps 16-bit weights plus their float32 masters: 2 more bytes a parameter "
            "than float32, paid back by 16-bit activations once the batch is large)"
        )
    return lines


def probe_line(reason: str, base: dict[str, Any], probe: dict[str, Any]) -> str:
    """``auto`` picked float32: say why, with the mixed_bfloat16 steps timed here."""
    slower = probe["ms_per_step"] / base["ms_per_step"]
    if slower >= 1:
        why = "measured slower" if cpu_16bit_units() else "emulated"  # AVX512-BF16, no AMX
        how = f"{slower:.1f}x slower; 16-bit matmuls are {why} on this CPU"
    else:  # the CPU's flags said no fast bfloat16, and this step says otherwise
        how = f"{1 / slower:.1f}x faster here, although this CPU's flags show no fast bfloat16"
    return (
        f"auto picks float32 here ({reason}): a mixed_bfloat16 step took "
        f"{probe['ms_per_step']:.1f} ms against float32's {base['ms_per_step']:.1f} ms "
        f"({how}), so only float32 trains. --policy mixed_bfloat16 trains the mixed run "
        "anyway."
    )


def table(runs: list[dict[str, Any]]) -> str:
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


def plot(runs: list[dict[str, Any]], path: str) -> None:
    """The runs' train and test loss per epoch, written to ``path`` as a PNG."""
    from matplotlib.figure import Figure  # no pyplot: the user's backend stays as it is
    from matplotlib.ticker import MaxNLocator

    fig = Figure(figsize=(7, 4))
    ax = fig.subplots()
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


def finished_before(runs: list[dict[str, Any]]) -> list[str]:
    """What the runs that finished before one failed reached, and the checkpoints they
    wrote: the failure's report alone left them unsaid (a --save file replaced, unsaid)."""
    lines = []
    for r in runs:
        lines.append(
            f"the {r['policy']} ({r['level']}) run finished before: test accuracy "
            f"{r['test_accuracy']:.3f}, test loss {r['test_loss']:.4f}, "
            f"{r['ms_per_step']:.2f} ms/step"
        )
        if r.get("checkpoint"):
            path, replaced = r["checkpoint"]
            lines.append(f"checkpoint written to {path}" + (" (replaced the file there)"
                                                             if replaced else ""))  # fmt: skip
    return lines
