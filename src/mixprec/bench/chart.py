"""The benchmark's results as a bar chart, drawn on a ``matplotlib.figure.Figure`` (no
pyplot, no backend switch)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TYPE_CHECKING

from mixprec.bench.modes import ALL_MODES, COMPILED
from mixprec.bench.runner import ModeResult

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure


def mode_colours(modes: Sequence[str]) -> dict[str, tuple[float, ...]]:
    """A distinct colour for each of ``modes`` (``MODE`` and ``MODE+compile`` alike).

    Each mode without its suffix gets a hue, in ``ALL_MODES`` order: tab20's ten, then
    tab20b's five and tab20c's five. Where both ``MODE`` and ``MODE+compile`` are in
    ``modes``, the eager one takes the hue's dark shade and the compiled one its light
    shade, so that the pair reads as one; alone, either takes the dark shade. 20 hues x 2
    shades: every mode and its compiled twin at once get different colours."""
    from matplotlib import colormaps

    # Called with i: colour i. (dark, light): tab20 pairs its shades; tab20b and tab20c
    # have four shades a hue, dark to light.
    tab20, tab20b, tab20c = colormaps["tab20"], colormaps["tab20b"], colormaps["tab20c"]
    shades = [(tab20(2 * i), tab20(2 * i + 1)) for i in range(10)]
    shades += [(cmap(4 * i + 1), cmap(4 * i + 3)) for cmap in (tab20b, tab20c) for i in range(5)]
    known = list(ALL_MODES)
    bases = sorted(
        {m.removesuffix(COMPILED) for m in modes},
        key=lambda b: (known.index(b) if b in known else len(known), b),
    )
    colours: dict[str, tuple[float, ...]] = {}
    for mode in modes:
        base = mode.removesuffix(COMPILED)
        dark, light = shades[bases.index(base) % len(shades)]
        paired = base in modes and base + COMPILED in modes
        colours[mode] = tuple(
            float(c) for c in (light if paired and mode.endswith(COMPILED) else dark)
        )
    return colours


#: The legend entry of the whiskers: the spread of a mode's speedup over the rounds.
WHISKERS = "lowest to highest round"


def chart(all_results: dict[str, list[ModeResult]], subtitle: str | None = None) -> Figure:
    """Bar chart of speedups against float32, one group of bars per workload, one colour
    per mode (``mode_colours``) across the groups. float32 is the line at 1, not a bar (its
    speedup is 1 by definition); ``float32+compile`` is a bar. ``subtitle``: a second
    title line, such as the device.

    Every bar carries its value: upright, and smaller past 10 modes, where each group also
    widens with its bars so that the labels fit. Where a result holds the rounds' lowest and
    highest ratios (``speedup_min``, ``speedup_max``), a black whisker spans them: the
    spread between rounds, which on a shared machine is often wider than a mode's lead."""
    from matplotlib.figure import Figure  # no pyplot: no GUI backend, no global figure

    workloads = list(all_results)
    modes = [m for m in dict.fromkeys(r.mode for w in workloads for r in all_results[w])
             if m != "float32"]  # fmt: skip
    colours = mode_colours(modes)
    width = 0.8 / max(len(modes), 1)
    ncol = 1 if len(modes) <= 16 else 2
    group = max(1.6, 0.13 * len(modes))  # inches a workload: 0.13 a bar fits an upright label
    fig = Figure(figsize=(max(5.0, group * len(workloads)) + 2.2 * ncol, 4.8))
    ax = fig.subplots()
    upright = len(modes) > 4  # so that neighbours' labels do not overlap
    font = 7 if not upright else 6 if len(modes) <= 10 else 5
    whisker_label = WHISKERS
    for i, mode in enumerate(modes):
        xs = [j + i * width for j in range(len(workloads))]
        found = [next((r for r in all_results[w] if r.mode == mode), None) for w in workloads]
        values = [r.speedup if r is not None else math.nan for r in found]
        ax.bar(xs, values, width, label=mode, color=colours[mode])
        if _whiskers(ax, xs, found, whisker_label, capsize=2 if upright else 3):
            whisker_label = "_nolegend_"  # one legend entry for all the whiskers
        for x, r in zip(xs, found, strict=True):
            if r is None or not math.isfinite(r.speedup):
                continue
            top = max(r.speedup, r.speedup_max if r.speedup_max is not None else r.speedup)
            ax.annotate(f"{r.speedup:.2f}", (x, top), xytext=(0, 2), textcoords="offset points",
                        ha="center", va="bottom", fontsize=font,
                        rotation=90 if upright else 0)  # fmt: skip
    ax.axhline(1.0, color="black", lw=1, label="float32 (baseline, 1.0)")
    ax.set_xticks([j + 0.4 - width / 2 for j in range(len(workloads))], workloads)
    ax.set_xlabel("workload")
    ax.set_ylabel("speedup vs float32 (higher is faster)")
    title = "mixprec bench: training-step speed against float32"
    ax.set_title(title + (f"\n{subtitle}" if subtitle else ""), fontsize=10)
    ax.margins(y=0.2 if upright else 0.12)  # room above the bars for their labels
    handles, labels = ax.get_legend_handles_labels()
    order = sorted(range(len(labels)), key=lambda i: labels[i] == WHISKERS)  # whiskers last
    ax.legend([handles[i] for i in order], [labels[i] for i in order], fontsize=8, ncol=ncol,
              loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0.0)  # fmt: skip
    fig.tight_layout()
    return fig


def _whiskers(
    ax: Axes, xs: list[float], found: list[ModeResult | None], label: str, capsize: float
) -> bool:
    """A whisker from each result's lowest to its highest round ratio, at ``xs``; whether
    any result held them."""
    spread = [
        (x, r.speedup, r.speedup_min, r.speedup_max)
        for x, r in zip(xs, found, strict=True)
        if r is not None and r.speedup_min is not None and r.speedup_max is not None
    ]
    if not spread:
        return False
    below = [median - low for _, median, low, _ in spread]
    above = [high - median for _, median, _, high in spread]
    ax.errorbar([s[0] for s in spread], [s[1] for s in spread], yerr=[below, above], fmt="none",
                ecolor="black", elinewidth=0.7, capsize=capsize, label=label)  # fmt: skip
    return True


def plot(all_results: dict[str, list[ModeResult]], path: str, subtitle: str | None = None) -> None:
    """``chart`` written to ``path`` (PNG, 120 dpi)."""
    chart(all_results, subtitle).savefig(path, dpi=120)
