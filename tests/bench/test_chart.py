"""The benchmark's chart: one bar and one colour per mode, written as PNG."""

from __future__ import annotations

from mixprec import bench


def result(mode: str, speedup: float) -> bench.ModeResult:
    return bench.ModeResult(mode, "O2", 1.0, 1.0, speedup, 1.0, None)


def test_chart_lists_each_mode_once_in_a_colour_of_its_own():
    """Issue 15: float32 was a bar and the baseline line (two legend entries), and the
    eleventh mode took the first one's colour (matplotlib's cycle has ten)."""
    modes = bench.with_compiled(list(bench.ALL_MODES))  # all 32: the most a chart can have
    all_results = {w: [result(m, 1.0 if m == "float32" else 1.5 + i / 10)
                       for i, m in enumerate(modes)]
                   for w in ("mlp-b64", "lm-d512")}  # fmt: skip
    fig = bench.chart(all_results, "CPU, torch 2")
    ax = fig.axes[0]
    labels = [text.get_text() for text in ax.get_legend().get_texts()]
    assert len(labels) == len(set(labels)) == len(modes)
    assert sorted(lb for lb in labels if lb.startswith("float32")) == [
        "float32 (baseline, 1.0)", "float32+compile", "float32-checked",
        "float32-checked+compile"]  # fmt: skip
    colours = [tuple(c.patches[0].get_facecolor()) for c in ax.containers]
    assert len(colours) == len(set(colours)) == len(modes) - 1  # float32 is the line
    for container in ax.containers:  # a mode keeps its colour in every workload
        assert len({tuple(p.get_facecolor()) for p in container.patches}) == 1
    assert ax.get_title().startswith("mixprec bench") and "CPU, torch 2" in ax.get_title()
    assert ax.get_xlabel() == "workload" and "speedup vs float32" in ax.get_ylabel()
    # A mode and its compiled twin: one hue, dark and light; alone, the dark shade.
    pair = bench.mode_colours(["O2-bf16", "O2-bf16+compile"])
    assert pair["O2-bf16"] != pair["O2-bf16+compile"]
    assert bench.mode_colours(["O2-bf16+compile"])["O2-bf16+compile"] == pair["O2-bf16"]


def test_plot_writes_the_chart(tmp_path):
    path = tmp_path / "b.png"
    bench.plot({"lm-d512": [result("float32", 1.0), result("O2-fp8", 0.1)]}, str(path))
    assert path.read_bytes()[:4] == b"\x89PNG"
