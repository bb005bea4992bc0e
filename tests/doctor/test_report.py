"""The 16-bit doctor's report: its JSON form, and the plot ``Report.plot`` draws of it."""

from __future__ import annotations

import json

import mixprec as mp
from tests.doctor.cases import CE, batch, overflowing


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
    assert ax.get_xlabel() == "module (forward execution order)"
    labels = ax.get_legend_handles_labels()[1]
    assert "recommended keep_float32" in labels and not any("zero" in t for t in labels)
