"""``mixprec autotune``: a bench workload and a user's ``module:function`` model, the JSON
and the chart; ``plot_plan`` draws on a Figure of its own."""

from __future__ import annotations

import sys
import textwrap

import matplotlib
import pytest

import mixprec as mp
from mixprec import cli
from mixprec.autotune import LayerChoice, Plan
from mixprec.autotune.plot import plot_plan

FAST = ["--candidates", "float32,bfloat16", "--time-budget", "20", "--check-steps", "3"]


def test_workload_prints_the_plan_and_writes_json_and_chart(tmp_path, capsys):
    json_path, png = tmp_path / "plan.json", tmp_path / "plan.png"
    # The real timer on the real workload: a budget of 2 s bounds it (what is left unmeasured
    # stays float32, which the table says).
    argv = ["autotune", "--workload", "mlp-b64", *FAST, "--time-budget", "2"]
    assert cli.main([*argv, "--json", str(json_path), "--plot", str(png)]) == 0
    out = capsys.readouterr()
    assert out.out.startswith("plan: level ") and "\n5  " in out.out
    assert "training check: " in out.out and f"plan written to {json_path}" in out.out
    assert "autotune" in out.err  # the tqdm bar, on stderr
    plan = mp.Plan.load(json_path)
    assert list(plan.dtypes) == ["1", "3", "5"]  # the three Linear layers of the MLP
    assert png.stat().st_size > 0


def test_user_model_spec(tmp_path, monkeypatch, capsys):
    (tmp_path / "autotune_user_models.py").write_text(
        textwrap.dedent("""
        from torch import nn

        def net():
            return nn.Sequential(nn.Flatten(), nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 10))
        """)
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    argv = ["autotune", "--model", "autotune_user_models:net", "--data", "digits",
            "--batch-size", "64", *FAST]  # fmt: skip
    assert cli.main(argv) == 0
    out = capsys.readouterr().out
    assert [line.split()[0] for line in out.splitlines()[3:5]] == ["1", "3"]
    sys.modules.pop("autotune_user_models", None)


def test_bad_spec_and_candidates_are_one_line(capsys):
    assert cli.main(["autotune", "--model", "no_such_module_xyz:net"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--model 'no_such_module_xyz:net'" in err[0]
    # A name that is no model is refused, not tuned as the CNN.
    assert cli.main(["autotune", "--model", "resnet"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "resnet" in err[0] and "mlp" in err[0]
    assert cli.main(["autotune", "--workload", "mlp-b64", "--candidates", "int8"]) == 2
    assert "candidates holds 'int8'" in capsys.readouterr().err


def test_plot_draws_on_its_own_figure(tmp_path):
    backend = matplotlib.get_backend()
    row = LayerChoice("fc", "Linear", "bfloat16", {"float32": 2e-3, "bfloat16": 1e-3},
                      {"float32": 0.0, "bfloat16": 3e-3})  # fmt: skip
    fig = plot_plan(Plan((row,), error_budget=0.05), tmp_path / "p.png")
    assert (tmp_path / "p.png").stat().st_size > 0
    ax = fig.axes[0]
    assert ax.get_title() == "fc (Linear): bf16" and ax.get_yscale() == "log"
    assert len(ax.collections) == 3  # two candidates and the circle round the chosen one
    assert matplotlib.get_backend() == backend


@pytest.mark.parametrize(
    ("options", "said"),
    [
        (["--workload", "mlp-b64", "--small", "--model", "cnn", "--data", "synthetic"],
         "--model, --data apply to --model/--data; --workload mlp-b64 brings its own"),
        (["--workload", "mlp-b64", "--batch-size", "7"], "--batch-size apply to --model/--data"),
        (["--small"], "--small picks a workload's tiny version; give --workload too"),
        (["--data", "synthetic", "--batch-size", "0"], "--batch-size must be >= 1, got 0"),
        (["--workload", "mlp-b64", "--small", "--candidates", ""],
         "--candidates '' names no dtype; valid:"),
        (["--error-budget", "-1"], "--error-budget must be a number >= 0, got -1"),
        (["--time-budget", "nan"], "--time-budget must be a finite number >= 0, got nan"),
        (["--check-steps", "-3"], "--check-steps must be an int >= 2, got -3"),
    ],
)  # fmt: skip
def test_options_that_do_not_apply_are_refused_not_ignored(options, said, capsys):
    assert cli.main(["autotune", *options]) == 2
    assert said in capsys.readouterr().err
