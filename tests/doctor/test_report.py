"""The 16-bit doctor's report: its JSON form, the plot ``Report.plot`` draws of it, and how
close each tensor came to a limit in the text, the JSON and the plot."""

from __future__ import annotations

import json

import mixprec as mp
from tests.doctor.cases import CE, batch, gained, issue_batch, overflowing


def test_report_json_and_plot(tmp_path):
    x, y = batch()
    report = mp.diagnose(overflowing(), x, y, CE)
    data = json.loads(report.to_json())
    assert data["culprits"][0] == "2" and data["policy"] == "mixed_float16"
    assert {m["name"] for m in data["modules"]} >= {"0", "1", "2", "3", "(model)"}
    fig = report.plot(str(tmp_path / "ranges.png"))
    assert (tmp_path / "ranges.png").read_bytes()[:4] == b"\x89PNG"
    ax = fig.axes[0]
    assert "Sequential under mixed_float16" in ax.get_title()
    assert "loss scale 65536" in ax.get_title()
    # Outputs above, gradients below, sharing x: the x label is on the bottom panel.
    assert fig.axes[-1].get_xlabel() == "module (type), in forward execution order"
    labels = ax.get_legend_handles_labels()[1]
    assert "recommended keep_float32" in labels and not any("zero" in t for t in labels)


def test_the_report_says_how_close_each_tensor_came_to_the_limit(tmp_path, one_thread):
    """Issue 31's draw 1855: the block's Linear outputs 99.7% of float16's max, the ReLU after
    it hands the last Linear 94%. Each module says how close it came (as a fraction of the
    range), in the table, the JSON and along the top of the plot, with the headroom."""
    x, y = issue_batch(1855)
    report = mp.diagnose(gained(1e5), x, y, CE)
    by_name = {m.name: m for m in report.modules}
    assert 0.99 < by_name["3"].input_fraction < 1 and 0.9 < by_name["4"].input_fraction < 0.99
    assert by_name["2.0"].output_fraction > 1  # beyond: the block itself
    assert report.headroom == 2.0**-4 and report.at_edge == []
    assert report.recommended_keep_float32 == ["2.0", "2.1", "3", "4"]
    assert any("are 99.7% of float16 max" in r for r in by_name["3"].reasons)
    text = str(report)
    assert " range  flags" in text and " 99.7%  values up to 6.53e+04 are 99.7%" in text
    assert "above 6.25% (headroom 2**-4) is at risk" in text
    assert (
        "checked over 10 Adam(lr=0.001) steps with the plan applied, loss scale from 16: " in text
    )
    data = json.loads(report.to_json())
    three = next(m for m in data["modules"] if m["name"] == "3")
    assert three["input_fraction"] == by_name["3"].input_fraction and "grad_fraction" in three
    assert three["range_used"] == by_name["3"].range_used
    assert data["headroom"] == 0.0625 and data["check"]["passed"] is True
    assert data["check"]["applied"] == data["check"]["steps"] == 10
    ax = report.plot(str(tmp_path / "margin.png")).axes[0]
    labels = ax.get_legend_handles_labels()[1]
    assert "float16 max x 2**-4 (headroom)" in labels
    assert any(t.startswith("range used (top") for t in labels)
    written = [t.get_text() for t in ax.texts]
    assert written[by_name["3"].order] == "99.7%" and len(written) == len(report.modules)
