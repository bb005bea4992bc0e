"""The 16-bit doctor's plot (``Report.plot``): per-module value ranges of the float32 run on
a log scale, in two panels sharing the x axis: forward outputs against the 16-bit dtype's
limits and the headroom below the max, and gradients against the same limits divided by
the loss scale (the backward holds the gradient times the scale), so each value is read
against its own thresholds. Each module's range used (``ModuleReport.range_used``) is
written along the top; the x ticks name each module and its type. The max-gradient points
are ``ModuleReport.max_grad``, the field the text table prints as max |grad|. It is drawn on
a ``matplotlib.figure.Figure`` of its own (no ``matplotlib.use``, no pyplot: the user's
backend and figures are left alone).
matplotlib is imported when a plot is drawn, not with mixprec."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch

from mixprec.doctor.headroom import headroom_text, percent

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

    from mixprec.doctor.report import ModuleReport, Report

__all__ = ["plot_report", "tick_label"]

# Series: (label, line style, colour, values); zero lanes: (label, marker, values).
_Series = list[tuple[str, str, str, list[float]]]
_Zeros = list[tuple[str, str, list[float]]]


def tick_label(module: ModuleReport) -> str:
    """The x tick of one module: its name and type, e.g. ``"0.fc (Linear)"``."""
    return f"{module.name or '(model)'} ({module.kind})"


def _tick_fontsize(count: int) -> float:
    """Smaller tick labels for many modules, so they stay apart."""
    return 7.0 if count <= 30 else max(4.0, 7.0 - (count - 30) / 20)


def _draw_series(ax: Axes, series: _Series) -> None:
    x = list(range(len(series[0][3])))
    for label, style, color, values in series:
        # A log axis has no 0: zeros are gaps in the lines, marked in their own lane.
        shown = [v if v > 0 else math.nan for v in values]
        ax.semilogy(x, shown, style, color=color, label=label)


def _zero_lane(ax: Axes, zeros: _Zeros) -> None:
    """Marks zeros (which a log axis cannot show) in a grey lane below every value."""
    from matplotlib.ticker import FuncFormatter, NullLocator

    found = [(what, marker, [i for i, v in enumerate(vs) if v == 0]) for what, marker, vs in zeros]
    if not any(at for _, _, at in found):
        return
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
    for what, marker, at in found:
        if at:
            ax.plot(at, [middle] * len(at), marker, color="black", ls="none", ms=7, label=what)


def _shade_kept(axes: list[Axes], report: Report, mods: list[ModuleReport]) -> None:
    kept = set(report.recommended_keep_float32)
    shaded = [i for i, m in enumerate(mods) if m.name in kept]
    for ax in axes:
        for i in shaded:
            label = "recommended keep_float32" if i == shaded[0] else None
            ax.axvspan(i - 0.45, i + 0.45, color="tab:red", alpha=0.1, lw=0, label=label)


def _output_panel(ax: Axes, report: Report, mods: list[ModuleReport]) -> None:
    """Forward outputs against the 16-bit limits as they are, the headroom line and each
    module's range used along the top."""
    from matplotlib.transforms import blended_transform_factory

    dtype = report.compute_dtype
    info = torch.finfo(getattr(torch, dtype))
    _draw_series(ax, [("max |output|", "o-", "tab:blue", [m.max_output for m in mods])])
    ax.axhline(info.max, color="red", ls="--", label=f"{dtype} max")
    ax.axhline(info.tiny, color="darkorange", ls="--", label=f"{dtype} min normal")
    ax.axhline(
        info.max * report.headroom,
        color="red",
        ls="-.",
        lw=0.8,
        label=f"{dtype} max x {headroom_text(report.headroom)} (headroom)",
    )
    # Room along the top for each module's range used: 11% of the axis height, in log space.
    low, high = ax.get_ylim()
    ax.set_ylim(low, high * (high / low) ** 0.12)
    _zero_lane(ax, [("zero output", "o", [m.max_output for m in mods])])
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
    ax.set_ylabel("|output| (float32 run)")


def _gradient_panel(ax: Axes, report: Report, mods: list[ModuleReport]) -> None:
    """Gradients (unscaled) against the 16-bit limits divided by the loss scale."""
    dtype = report.compute_dtype
    info = torch.finfo(getattr(torch, dtype))
    scale = report.loss_scale
    series = [
        # ``max_grad``: the same field as the text table's max |grad| column.
        ("max |grad| (of its output)", "s-", "tab:orange", [m.max_grad for m in mods]),
        ("small |gradient| (1st pct.)", "v:", "tab:green", [m.min_grad for m in mods]),
    ]
    _draw_series(ax, series)
    ax.axhline(info.max / scale, color="red", ls=":", label=f"{dtype} max / loss scale {scale:g}")
    ax.axhline(
        info.tiny / scale,
        color="darkorange",
        ls=":",
        label=f"{dtype} min normal / loss scale {scale:g}",
    )
    reached = report.loss_scale_reached
    if reached is not None and reached != scale:
        ax.axhline(
            info.max / reached,
            color="purple",
            ls=":",
            label=f"{dtype} max / scale {reached:g} reached",
        )
    # None at all, too: a Flatten of the input has nothing to send one to.
    _zero_lane(ax, [("zero or no gradient", "x", [m.max_grad for m in mods])])
    ax.set_ylabel("|gradient| (float32 run, unscaled)")


def plot_report(report: Report, path: str) -> Figure:
    """Draw ``report`` (see ``Report.plot``), save it as a PNG to ``path`` and return it.
    ``fig.axes`` is ``[outputs, gradients]``."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    mods = sorted(report.modules, key=lambda m: m.order)
    # A Figure of its own, no pyplot: the user's backend and pyplot's figures stay as they are.
    fig = Figure(figsize=(max(8.0, 0.45 * len(mods) + 4.0), 8.0))
    FigureCanvasAgg(fig)  # renders without a display, for savefig and canvas.draw()
    out_ax, grad_ax = fig.subplots(2, 1, sharex=True)
    _shade_kept([out_ax, grad_ax], report, mods)
    _output_panel(out_ax, report, mods)
    _gradient_panel(grad_ax, report, mods)
    grad_ax.set_xticks(
        list(range(len(mods))),
        [tick_label(m) for m in mods],
        rotation=60,
        ha="right",
        rotation_mode="anchor",
        fontsize=_tick_fontsize(len(mods)),
    )
    grad_ax.set_xlim(-0.6, len(mods) - 0.4)
    grad_ax.set_xlabel("module (type), in forward execution order")
    scale, reached = report.loss_scale, report.loss_scale_reached
    detail = f"level {report.level}, {report.compute_dtype} compute, loss scale {scale:g}"
    if reached is not None and reached != scale:
        detail += f" (backs off to {reached:g})"
    out_ax.set_title(
        f"mixprec doctor: {report.model or 'model'} under {report.policy}\n{detail}",
        fontsize=10,
    )
    for ax in (out_ax, grad_ax):
        ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    return fig
