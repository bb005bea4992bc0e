"""The benchmark's results as a bar chart, drawn on a ``matplotlib.figure.Figure`` (no
pyplot, no backend switch)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TYPE_CHECKING

from mixprec.bench.modes import ALL_MODES, COMPILED
from mixprec.bench.runner import ModeResult

if TYPE_CHECKING:
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


def chart(all_results: dict[str, list[ModeResult]], subtitle: str | None = None) -> Figure:
    """Bar chart of speedups against float32, one group of bars per workload, one colour
    per mode (``mode_colours``) across the groups. float32 is the line at 1, not a bar (its
    speedup is 1 by definition); ``float32+compile`` is a bar. ``subtitle``: a second
    title line, such as the device."""
    from matplotlib.figure import Figure  # no pyplot: no GUI backend, no global figure

    workloads = list(all_results)
    modes = [m for m in dict.fromkeys(r.mode for w in workloads for r in all_results[w])
             if m != "float32"]  # fmt: skip
    colours = mode_colours(modes)
    width = 0.8 / max(len(modes), 1)
    ncol = 1 if len(modes) <= 16 else 2
    fig = Figure(figsize=(max(5.0, 1.6 * len(workloads)) + 2.2 * ncol, 4.8))
    ax = fig.subplots()
    for i, mode in enumerate(modes):
        values = [next((r.speedup for r in all_results[w] if r.mode == mode), math.nan)
                  for w in workloads]  # fmt: skip
        bars = ax.bar([j + i * width for j in range(len(workloads))], values, width,
                      label=mode, color=colours[mode])  # fmt: skip
        if len(modes) <= 4:
            ax.bar_label(bars, fmt="%.2f", fontsize=7, padding=1)
        elif len(modes) <= 10:  # upright, so that neighbours' labels do not overlap
            ax.bar_label(bars, fmt="%.2f", fontsize=6, padding=2, rotation=90)
    ax.axhline(1.0, color="black", lw=1, label="float32 (baseline, 1.0)")
    ax.set_xticks([j + 0.4 - width / 2 for j in range(len(workloads))], workloads)
    ax.set_xlabel("workload")
    ax.set_ylabel("speedup vs float32 (higher is faster)")
    title = "mixprec bench: training-step speed against float32"
    ax.set_title(title + (f"\n{subtitle}" if subtitle else ""), fontsize=10)
    ax.margins(y=0.12)
    ax.legend(fontsize=8, ncol=ncol, loc="upper left", bbox_to_anchor=(1.01, 1.0),
              borderaxespad=0.0)  # fmt: skip
    fig.tight_layout()
    return fig


def plot(all_results: dict[str, list[ModeResult]], path: str, subtitle: str | None = None) -> None:
    """``chart`` written to ``path`` (PNG, 120 dpi)."""
    chart(all_results, subtitle).savefig(path, dpi=120)
