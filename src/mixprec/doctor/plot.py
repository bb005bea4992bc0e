"""The 16-bit doctor's plot (``Report.plot``): per-module value ranges of the float32 run on
a log scale against the 16-bit dtype's limits and the headroom below the max, with each
module's range used (``ModuleReport.range_used``) written along the top, drawn on a
``matplotlib.figure.Figure`` of its own (no ``matplotlib.use``, no pyplot: the user's
backend and figures are left alone).
matplotlib is imported when a plot is drawn, not with mixprec."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch

from mixprec.doctor.headroom import headroom_text, percent

if TYPE_CHECKING:
    from matplotlib.figure import Figure

    from mixprec.doctor.report import Report

__all__ = ["plot_report"]


def plot_report(report: Report, path: str) -> Figure:
    """Draw ``report`` (see ``Report.plot``), save it as a PNG to ``path`` and return it."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.ticker import FuncFormatter, NullLocator
    from matplotlib.transforms import blended_transform_factory

    mods = sorted(report.modules, key=lambda m: m.order)
    info = torch.finfo(getattr(torch, report.compute_dtype))
    # A Figure of its own, no pyplot: the user's backend and pyplot's figures stay as they are.
    fig = Figure(figsize=(max(8.0, 0.45 * len(mods) + 4.0), 5.0))
    FigureCanvasAgg(fig)  # renders without a display, for savefig and canvas.draw()
    ax = fig.add_subplot()
    x = list(range(len(mods)))
    kept = set(report.recommended_keep_float32)
    shaded = [i for i, m in enumerate(mods) if m.name in kept]
    for i in shaded:
        label = "recommended keep_float32" if i == shaded[0] else None
        ax.axvspan(i - 0.45, i + 0.45, color="tab:red", alpha=0.1, lw=0, label=label)
    series = [
        ("max |output|", "o-", "tab:blue", [m.max_output for m in mods]),
        ("max |gradient| (output, input, weights)", "s-", "tab:orange",
         [m.max_backward for m in mods]),
        ("small |gradient| (1st pct.)", "v:", "tab:green", [m.min_grad for m in mods]),
    ]  # fmt: skip
    for label, style, color, values in series:
        # A log axis has no 0: zeros are gaps in the lines, marked in their own lane.
        shown = [v if v > 0 else math.nan for v in values]
        ax.semilogy(x, shown, style, color=color, label=label)
    scale = report.loss_scale
    ax.axhline(info.max, color="red", ls="--", label=f"{report.compute_dtype} max")
    ax.axhline(info.tiny, color="darkorange", ls="--", label=f"{report.compute_dtype} min normal")
    if scale != 1.0:
        ax.axhline(
            info.max / scale,
            color="red",
            ls=":",
            label=f"{report.compute_dtype} max / loss scale {scale:g} (gradients)",
        )
        ax.axhline(
            info.tiny / scale,
            color="darkorange",
            ls=":",
            label=f"min normal / loss scale {scale:g} (gradients)",
        )
    ax.axhline(
        info.max * report.headroom,
        color="red",
        ls="-.",
        lw=0.8,
        label=f"{report.compute_dtype} max x {headroom_text(report.headroom)} (headroom)",
    )
    reached = report.loss_scale_reached
    if reached is not None and reached != scale:
        ax.axhline(
            info.max / reached,
            color="purple",
            ls=":",
            label=f"{report.compute_dtype} max / scale {reached:g} reached",
        )
    # Room along the top for each module's range used: 11% of the axis height, in log space.
    low, high = ax.get_ylim()
    ax.set_ylim(low, high * (high / low) ** 0.12)
    zeros = [
        (what, marker, [i for i, v in enumerate(values) if v == 0])
        for what, marker, values in (
            ("zero output", "o", [m.max_output for m in mods]),
            # None at all, too: a Flatten of the input has nothing to send one to.
            ("zero or no gradient", "x", [m.max_backward for m in mods]),
        )
    ]
    if any(found for _, _, found in zeros):
        # A grey lane below every value: 8% of the axis height, in log space.
        low, high = ax.get_ylim()
        lane = low / (high / low) ** 0.09
        ax.set_ylim(lane, high)
        ax.axhspan(lane, low, color="0.85", lw=0, label="0 (no place on a log axis)")
        # The lane's one tick reads "0"; the log ticks stay above it.
        middle = math.sqrt(lane * low)
        log_format = ax.yaxis.get_major_formatter()
        ax.set_yticks([middle, *(t for t in ax.get_yticks() if low <= t <= high)])
        ax.yaxis.set_major_formatter(
            FuncFormatter(lambda v, pos: "0" if v < low else log_format(v, pos))
        )
        ax.yaxis.set_minor_locator(NullLocator())
        for what, marker, found in zeros:
            if found:
                ax.plot(
                    found,
                    [middle] * len(found),
                    marker,
                    color="black",
                    ls="none",
                    ms=7,
                    label=what,
                )
    # Each module's range used, along the top: how close its closest tensor came to a limit.
    along_top = blended_transform_factory(ax.transData, ax.transAxes)
    for i, m in enumerate(mods):
        edge = m.range_used > report.headroom and not m.float32
        ax.text(
            i, 0.985, percent(m.range_used), transform=along_top, rotation=90, ha="center",
            va="top", fontsize=6, color="tab:red" if edge else "0.4",
        )  # fmt: skip
    ax.plot(
        [], [], ls="none", marker="$\\%$", color="tab:red",
        label=f"range used (top; red: 16-bit, within {headroom_text(report.headroom)} of a limit)",
    )  # fmt: skip
    ax.set_xticks(x, [m.name for m in mods], rotation=60, ha="right", fontsize=7)
    ax.set_xlim(-0.6, len(mods) - 0.4)
    ax.set_xlabel("module (forward execution order)")
    ax.set_ylabel("|value| in the float32 run (gradients unscaled)")
    detail = f"level {report.level}, {report.compute_dtype} compute, loss scale {scale:g}"
    if reached is not None and reached != scale:
        detail += f" (backs off to {reached:g})"
    ax.set_title(
        f"mixprec doctor: {report.model or 'model'} under {report.policy}\n{detail}",
        fontsize=10,
    )
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    return fig
