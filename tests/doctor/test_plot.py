"""``Report.plot``: zeros, which a log axis cannot show, are marked in a lane of their own;
the plot is drawn without switching the user's matplotlib backend."""

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
    ax = fig.axes[0]
    labels = ax.get_legend_handles_labels()[1]
    assert {"zero or no gradient", "zero output", "0 (no place on a log axis)"} <= set(labels)
    lines = {line.get_label(): line for line in ax.get_lines()}
    grads = [float(v) for v in lines["max |gradient| (output, input, weights)"].get_ydata()]
    assert math.isnan(grads[0]) and math.isnan(grads[1])  # gaps, not 1e-30
    marks = lines["zero or no gradient"]
    assert list(marks.get_xdata()) == [0, 1]
    low = ax.get_ylim()[0]
    # The marks sit in the lane below every plotted value, whose tick reads "0".
    assert all(v < min(g for g in grads if g == g) for v in marks.get_ydata())
    assert marks.get_ydata()[0] > low
    fig.canvas.draw()
    assert ax.get_yticklabels()[0].get_text() == "0"


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
