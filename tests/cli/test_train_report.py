"""``mixprec train``'s lines after the table: when two runs do the same math, the ms/step
figure, and the "buys little" line against a baseline that is not float32."""

from __future__ import annotations

import pytest

from mixprec import cli
from mixprec.cli import _train_report as report
from mixprec.cli import train
from mixprec.train.callbacks import History

SMALL = ["--hidden", "64", "--data", "synthetic", "--epochs", "1", "--quiet", "--in-process"]


@pytest.mark.parametrize(
    "args",
    [
        ["--policy", "bfloat16", "--compare", "mixed_bfloat16"],  # O3 against O2
        ["--policy", "mixed_bfloat16", "--level", "O1", "--compare", "mixed_bfloat16"],  # O1, O2
    ],
)
def test_one_policy_at_two_levels_is_not_the_same_math(args, capsys):
    """The same compute dtype at O1, O2 and O3 was said to be "the same math in both runs
    (O0 computes in float32 whatever the policy)", and the speed figure dropped as noise."""
    assert cli.main(["train", *SMALL, *args]) == 0
    out = capsys.readouterr().out
    assert "the same math" not in out and "O0 computes" not in out
    assert "x the speed" in out


def test_the_same_math_names_o0_only_where_a_run_is_at_o0():
    o2 = {"policy": "mixed_bfloat16", "level": "O2"}
    assert report.math_of(o2) == report.math_of(dict(o2))  # one configuration twice
    assert report.same_math_text([o2, o2]) == (
        "the same math in both runs: the speed column is run-to-run noise"
    )
    o0 = {**o2, "level": "O0"}
    float32 = {"policy": "float32", "level": "O0"}
    assert report.math_of(o0) == report.math_of(float32)  # O0 computes in float32
    assert "(O0 computes in float32 whatever the policy)" in report.same_math_text([float32, o0])
    for other in ({**o2, "level": "O1"}, {"policy": "bfloat16", "level": "O3"},
                  {"policy": "mixed_float16", "level": "O2"}, float32):  # fmt: skip
        assert report.math_of(other) != report.math_of(o2), other


def test_ms_per_step_is_the_median_of_an_even_number_of_epochs(monkeypatch):
    """Two epochs at 113.6 and 152.1 ms a step were reported as 152.1 (the upper middle)."""
    epochs = iter([113.6, 152.1])

    class Timed(History):
        def on_epoch_end(self, epoch, logs):
            super().on_epoch_end(epoch, {**logs, "ms_per_step": next(epochs)})

    monkeypatch.setattr(train, "History", Timed)
    monkeypatch.setattr(train, "matmul_ms", lambda step, device: 0.0)  # no profile needed
    config = {"model": "mlp", "data": "synthetic", "epochs": 2, "seed": 0, "hidden": 16,
              "batch_size": 256, "lr": 1e-3, "save": None, "verbose": 0, "compile": False,
              "float8_min_features": None, "label": "mixed", "policy": "float32",
              "level": "auto"}  # fmt: skip
    assert train.run_training(config)["ms_per_step"] == pytest.approx((113.6 + 152.1) / 2)


def test_buys_little_names_the_baseline_and_only_what_the_run_does():
    """Against an O2 baseline the line said "float32's"; an O1 run (no masters) was said to
    spend its step on "float32 masters"."""
    o2 = {"policy": "mixed_bfloat16", "level": "O2", "ms_per_step": 10.0, "matmul_ms": 8.0,
          "masters": True}  # fmt: skip
    o1 = {"policy": "mixed_bfloat16", "level": "O1", "ms_per_step": 9.5, "matmul_ms": 2.0,
          "masters": False}  # fmt: skip
    assert report.explain_speed([o2, o1])[-1] == (
        "mixed precision buys little over mixed_bfloat16 (O2) here (1.05x): its matmuls took "
        "2.00 ms against mixed_bfloat16 (O2)'s 8.00, but the rest of its step (casts, "
        "optimizer) took 7.50 ms against mixed_bfloat16 (O2)'s 2.00"
    )
    float32 = {"policy": "float32", "level": "O0", "ms_per_step": 10.0, "matmul_ms": 8.0}
    fp16 = {"policy": "mixed_float16", "level": "O2", "ms_per_step": 9.5, "matmul_ms": 2.0,
            "masters": True}  # fmt: skip
    assert report.explain_speed([float32, fp16])[-1] == (
        "mixed precision buys little here (1.05x): its matmuls took 2.00 ms against float32's "
        "8.00, but the rest of its step (casts, float32 masters, loss scaling, optimizer) took "
        "7.50 ms against float32's 2.00"
    )
