"""The benchmark's chart: one bar and one colour per mode, written as PNG."""

from __future__ import annotations

from mixprec import bench


def result(mode: str, speedup: float) -> bench.ModeResult:
    return bench.ModeResult(mode, "O2", 1.0, 1.0, speedup, 1.0, None)


def test_chart_lists_each_mode_once_in_a_colour_of_its_own():
    """Issue 15: float32 was a bar and the baseline line (two legend entries), and the
    eleventh mode took the first one's colour (matplotlib's cycle has ten)."""
    modes = bench.with_compiled(list(bench.ALL_MODES))  # all 34: the most a chart can have
    all_results = {w: [result(m, 1.0 if m == "float32" else 1.5 + i / 10)
                       for i, m in enumerate(modes)]
                   for w in ("mlp-b64", "lm-d512")}  # fmt: skip
    fig = bench.chart(all_results, "CPU, torch 2")
    ax = fig.axes[0]
    labels = [text.get_text() for text in ax.get_legend().get_texts()]
    assert len(labels) == len(set(labels)) == len(modes)
    assert sorted(lb for lb in labels if lb.startswith("float32")) == [
        "float32 (baseline, 1.0)", "float32+compile", "float32-checked",
        "float32-checked+compile", "float32-tf32", "float32-tf32+compile"]  # fmt: skip
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


def spread(mode: str, speedup: float, low: float, high: float) -> bench.ModeResult:
    return bench.ModeResult(mode, "O2", 1.0, 1.0, speedup, 1.0, None, speedup_min=low,
                            speedup_max=high)  # fmt: skip


def test_chart_keeps_every_value_label_past_ten_modes():
    """Issue 33 item 12: past 10 modes the bars had no value labels."""
    modes = bench.with_compiled(["float32", "O1-bf16", "O2-bf16", "O3-bf16", "auto-bf16",
                                 "torch-autocast-bf16", "torch-autocast-scaler-bf16"])  # fmt: skip
    assert len(modes) == 14  # 13 bars a workload
    workloads = ("mlp-b64", "lm-d512", "cnn")
    all_results = {w: [result(m, 1.0 if m == "float32" else 1.25 + i / 100 + j)
                       for i, m in enumerate(modes)]
                   for j, w in enumerate(workloads)}  # fmt: skip
    ax = bench.chart(all_results).axes[0]
    texts = [t.get_text() for t in ax.texts]
    expected = [f"{r.speedup:.2f}" for r in (all_results[w][i] for i in range(1, 14)
                                             for w in workloads)]  # fmt: skip
    assert sorted(texts) == sorted(expected) and len(texts) == 13 * 3
    assert {t.get_rotation() for t in ax.texts} == {90.0}  # upright: neighbours do not overlap
    assert max(t.get_fontsize() for t in ax.texts) <= 6
    # Few modes: level labels, one a bar, as before.
    few = bench.chart({"mlp-b64": [result("float32", 1.0), result("O2-bf16", 1.8)]}).axes[0]
    assert [(t.get_text(), t.get_rotation()) for t in few.texts] == [("1.80", 0.0)]


def test_chart_draws_each_modes_spread_over_the_rounds():
    """Issue 33 item 12: repeats differ by 7%, and the chart drew no error bars. The whisker
    spans the lowest to the highest round ratio, around the median's bar."""
    from matplotlib.container import ErrorbarContainer

    all_results = {
        "mlp-b64": [spread("float32", 1.0, 1.0, 1.0), spread("O2-bf16", 1.8, 1.7, 1.95),
                    spread("auto", 1.9, 1.75, 2.0)],
        "lm-d512": [spread("float32", 1.0, 1.0, 1.0), spread("O2-bf16", 3.0, 2.8, 3.1),
                    spread("auto", 3.1, 2.9, 3.2)],
    }  # fmt: skip
    fig = bench.chart(all_results, "CPU")
    ax = fig.axes[0]
    whiskers = [c for c in ax.containers if isinstance(c, ErrorbarContainer)]
    assert len(whiskers) == 2  # one a mode, across the workloads
    spans = sorted(
        tuple(round(float(v), 6) for v in segment[:, 1])
        for c in whiskers
        for segment in c.lines[2][0].get_segments()
    )
    assert spans == [(1.7, 1.95), (1.75, 2.0), (2.8, 3.1), (2.9, 3.2)]
    labels = [text.get_text() for text in ax.get_legend().get_texts()]
    assert labels == ["float32 (baseline, 1.0)", "O2-bf16", "auto", "lowest to highest round"]
    # A value label sits above its whisker, not inside it.
    assert {t.get_text(): t.xy[1] for t in ax.texts}["1.80"] == 1.95
