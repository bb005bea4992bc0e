"""``Report.plot``: zeros, which a log axis cannot show, are marked in a lane of their own;
the x ticks name each module and its type; outputs and gradients sit in panels of their own,
each with its own thresholds; the max-gradient points are the table's max |grad| column; the
plot is drawn without switching the user's matplotlib backend."""

from __future__ import annotations

import math

import torch
from torch import nn

import mixprec as mp
from tests.doctor.cases import CE, batch


class Zero(nn.Module):
    def forward(self, x):
        return x * 0.0


def test_plot_marks_zero_gradients_instead_of_drawing_them_at_1e_30(tmp_path):
    # Everything before Zero gets an all-zero gradient; Zero's own output is all zero.
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), Zero(), nn.Linear(32, 4))
    x, y = batch()
    report = mp.diagnose(model, x, y, CE)
    by_name = {m.name: m for m in report.modules}
    assert by_name["0"].max_backward == 0 and by_name["2"].max_output == 0
    fig = report.plot(str(tmp_path / "zeros.png"))
    out_ax, ax = fig.axes
    assert "zero output" in out_ax.get_legend_handles_labels()[1]
    labels = ax.get_legend_handles_labels()[1]
    assert {"zero or no gradient", "0 (no place on a log axis)"} <= set(labels)
    lines = {line.get_label(): line for line in ax.get_lines()}
    grads = [float(v) for v in lines["max |grad| (of its output)"].get_ydata()]
    assert math.isnan(grads[0]) and math.isnan(grads[1])  # gaps, not 1e-30
    marks = lines["zero or no gradient"]
    assert list(marks.get_xdata()) == [0, 1]
    low = ax.get_ylim()[0]
    # The marks sit in the lane below every plotted value, whose tick reads "0".
    assert all(v < min(g for g in grads if g == g) for v in marks.get_ydata())
    assert marks.get_ydata()[0] > low
    fig.canvas.draw()
    assert ax.get_yticklabels()[0].get_text() == "0"


def _report_and_figure(tmp_path):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
    x, y = batch()
    report = mp.diagnose(model, x, y, CE, loss_scale=1024.0)
    return report, report.plot(str(tmp_path / "p.png"))


def test_plot_x_ticks_name_each_module_and_its_type(tmp_path):
    report, fig = _report_and_figure(tmp_path)
    mods = sorted(report.modules, key=lambda m: m.order)
    fig.canvas.draw()
    ticks = fig.axes[-1].get_xticklabels()
    assert [t.get_text() for t in ticks] == [f"{m.name} ({m.kind})" for m in mods]
    assert [t.get_text() for t in ticks][:3] == ["0 (Linear)", "1 (ReLU)", "2 (Linear)"]
    assert all(t.get_rotation() > 0 for t in ticks)


def test_plot_draws_gradient_thresholds_only_on_the_gradient_panel(tmp_path):
    report, fig = _report_and_figure(tmp_path)
    info = torch.finfo(torch.float16)
    assert len(fig.axes) == 2
    out_ax, grad_ax = fig.axes
    assert out_ax.get_shared_x_axes().joined(out_ax, grad_ax)

    def levels(ax):
        # Horizontal threshold lines: constant y over the whole axis.
        return {
            float(line.get_ydata()[0])
            for line in ax.get_lines()
            if len(set(line.get_ydata())) == 1 and line.get_xdata()[0] == 0
            and line.get_xdata()[-1] == 1
        }  # fmt: skip

    scaled = {info.max / 1024.0, info.tiny / 1024.0}
    assert scaled <= levels(grad_ax) and not scaled & levels(out_ax)
    assert {info.max, info.max * report.headroom} <= levels(out_ax)
    assert info.max not in levels(grad_ax)
    out_labels = [line.get_label() for line in out_ax.get_lines()]
    assert "max |output|" in out_labels and not any("grad" in s for s in out_labels)


def test_plot_max_gradient_points_are_the_table_max_grad_column(tmp_path):
    report, fig = _report_and_figure(tmp_path)
    mods = sorted(report.modules, key=lambda m: m.order)
    # The text table prints ``max_grad`` under max |grad|.
    assert f"{mods[0].max_grad:>10.3g}" in str(report)
    assert any(m.max_backward != m.max_grad for m in mods)
    lines = {line.get_label(): line for line in fig.axes[1].get_lines()}
    plotted = [float(v) for v in lines["max |grad| (of its output)"].get_ydata()]
    assert plotted == [m.max_grad for m in mods]


def test_plot_leaves_the_matplotlib_backend_and_pyplot_alone(tmp_path, monkeypatch):
    import matplotlib
    import matplotlib.pyplot as plt
    from matplotlib.figure import Figure

    def refuse(*args, **kwargs):
        raise AssertionError("Report.plot switched the user's matplotlib backend")

    monkeypatch.setattr(matplotlib, "use", refuse)
    backend, figures = matplotlib.get_backend(), plt.get_fignums()
    x, y = batch()
    fig = mp.diagnose(nn.Sequential(nn.Linear(16, 4)), x, y, CE).plot(str(tmp_path / "p.png"))
    assert isinstance(fig, Figure) and (tmp_path / "p.png").read_bytes()[:4] == b"\x89PNG"
    assert matplotlib.get_backend() == backend and plt.get_fignums() == figures
