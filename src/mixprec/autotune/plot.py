"""A plan's chart (``plot_plan``): one small panel per layer, its time alone against its
relative error for each measured candidate dtype, the chosen dtype circled. Drawn on a
``matplotlib.figure.Figure`` of its own (no ``matplotlib.use``, no pyplot: the user's
backend and figures are left alone); matplotlib is imported only here, when asked for."""

from __future__ import annotations

import math
import os
from typing import TYPE_CHECKING, Any

from mixprec._errors import ArgumentError
from mixprec.autotune.plan import SHORT, Plan

if TYPE_CHECKING:
    from matplotlib.figure import Figure

__all__ = ["plot_plan"]

#: float32's error is 0 by definition: drawn at this floor of the log scale.
_FLOOR = 1e-8
_COLOURS = {"float32": "tab:blue", "bfloat16": "tab:orange", "float16": "tab:green",
            "float8": "tab:red"}  # fmt: skip


def plot_plan(plan: Plan, path: str | os.PathLike[str] | None = None) -> Figure:
    """The chart of ``plan`` (see the module docstring); saved to ``path`` if given."""
    from matplotlib.figure import Figure

    rows = [r for r in plan.layers if r.times]
    if not rows:
        raise ArgumentError("plot_plan: the plan has no measured layers (a hand-made plan?)")
    cols = min(4, len(rows))
    lines = math.ceil(len(rows) / cols)
    fig = Figure(figsize=(3.2 * cols, 2.4 * lines + 1.0), layout="constrained")
    axes = fig.subplots(lines, cols, squeeze=False)
    for ax, row in zip(axes.flat, rows, strict=False):
        for dtype, seconds in row.times.items():
            if dtype not in row.errors:  # timed only, to leave it out: no point to draw
                continue
            err = max(row.errors[dtype], _FLOOR)
            err = err if math.isfinite(err) else 1.0
            ax.scatter(seconds * 1e3, err, color=_COLOURS[dtype], label=SHORT[dtype], zorder=3)
            if dtype == row.dtype:
                ax.scatter(seconds * 1e3, err, s=220, facecolors="none", edgecolors="black",
                           linewidths=1.5, zorder=4)  # fmt: skip
        if plan.error_budget:
            ax.axhline(plan.error_budget, color="grey", linestyle="--", linewidth=0.8)
        ax.set_yscale("log")
        ax.set_title(f"{row.name} ({row.kind}): {SHORT[row.dtype]}", fontsize=9)
        ax.tick_params(labelsize=7)
    for ax in list(axes.flat)[len(rows) :]:
        ax.set_visible(False)
    fig.supxlabel("time of the layer alone, forward + backward (ms)")
    fig.supylabel("relative error vs float32")
    seen: dict[str, Any] = {}
    for ax in axes.flat:
        for handle, label in zip(*ax.get_legend_handles_labels(), strict=True):
            seen.setdefault(label, handle)
    title = "circled: chosen; dashed: error budget; float32 at the floor"
    fig.legend(list(seen.values()), list(seen), loc="outside upper center", ncols=len(seen),
               title=title, fontsize=8)  # fmt: skip
    if path is not None:
        fig.savefig(path)
    return fig
