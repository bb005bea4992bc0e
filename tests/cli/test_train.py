"""``mixprec train``: both runs, their table, plot and checkpoints, and its error exits."""

from __future__ import annotations

import re

import pytest

from mixprec import cli
from mixprec.cli import train
from mixprec.policy import Policy


def rows(out: str) -> dict[str, list[str]]:
    table = {}
    for line in out.splitlines():
        m = re.match(r"^(\w+) \((O\d)\)\s+(.*)$", line)
        if m:
            table[m.group(1)] = m.group(3).split()
    return table


def test_train_with_defaults_on_digits(capsys):
    """The main job: both runs reach 0.95 and agree within one point."""
    assert cli.main(["train", "--quiet", "--in-process", "--policy", "mixed_bfloat16"]) == 0
    out = capsys.readouterr().out
    table = rows(out)
    acc32, acc16 = float(table["float32"][0]), float(table["mixed_bfloat16"][0])
    assert acc32 >= 0.95 and acc16 >= 0.95
    assert abs(acc32 - acc16) <= 0.01
    assert table["float32"][3] == "1.00x" and table["mixed_bfloat16"][3].endswith("x")
    assert "mixed_bfloat16: test accuracy" in out


def test_train_in_subprocesses_with_plot_and_save(tmp_path, capsys):
    plot = tmp_path / "loss.png"
    args = ["train", "--epochs", "2", "--quiet", "--policy", "mixed_float16", "--level", "O1",
            "--plot", str(plot), "--save", str(tmp_path / "ckpt")]  # fmt: skip
    assert cli.main(args) == 0
    out = capsys.readouterr().out
    assert set(rows(out)) == {"float32", "mixed_float16"}
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == [
        "baseline.safetensors",
        "mixed.safetensors",
    ]


def test_train_synthetic_without_comparison(capsys):
    assert cli.main(["train", "--data", "synthetic", "--epochs", "1", "--compare", "none",
                     "--quiet", "--in-process"]) == 0  # fmt: skip
    assert len(rows(capsys.readouterr().out)) == 1


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--model", "resnet"], "unknown model 'resnet'; valid: mlp, cnn"),
        (["--data", "cifar"], "unknown data 'cifar'; valid: digits, mnist:DIR, synthetic"),
        (["--policy", "mixed_bf16"], "unknown policy 'mixed_bf16'; valid: float32"),
        (["--level", "O5"], "unknown level 'O5'; valid: O0, O1, O2, O3, auto"),
        (["--compare", "fp64"], "unknown compare 'fp64'"),
        (["--epochs", "0"], "--epochs must be >= 1, got 0"),
        (["--model", "cnn", "--data", "synthetic"], "model 'cnn' needs image data"),
        (["--data", "mnist:/nonexistent"], "is not a directory"),
    ],
)
def test_train_errors_exit_2_with_one_line(args, message, capsys):
    assert cli.main(["train", "--quiet", "--in-process", *args]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("mixprec train: error: ") and message in err
    assert len(err.splitlines()) == 1


def test_train_and_bench_compile(capsys):
    assert cli.main(["train", "--data", "synthetic", "--epochs", "1", "--compare", "none",
                     "--quiet", "--in-process", "--compile",
                     "--policy", "mixed_bfloat16"]) == 0  # fmt: skip
    assert len(rows(capsys.readouterr().out)) == 1
    assert cli.main(["bench", "mlp-b64", "--small", "--modes", "float32", "--compile",
                     "--no-memory", "--repeats", "1", "--steps", "1", "--warmup", "1",
                     "--min-round-ms", "0"]) == 0  # fmt: skip
    out = capsys.readouterr().out
    assert "float32+compile" in out and "compile s" in out
    assert cli.main(["bench", "mlp-b64", "--modes", "O9+compile"]) == 2
    assert "unknown mode 'O9'" in capsys.readouterr().err


def test_main_job_trains_bfloat16_where_auto_picks_float32(monkeypatch):
    """On a CPU without fast 16-bit math `auto` is float32: the main job would train float32
    twice, so it trains bfloat16 and says why, whatever this machine has."""
    float32_here = Policy("float32")
    object.__setattr__(float32_here, "reason", "CPU without AVX512-BF16 or AMX")
    # ``_mixed_run_policy`` looks ``Policy`` up in the train module, where it is patched.
    monkeypatch.setattr(train, "Policy", lambda name: float32_here)
    policy, note = train._mixed_run_policy("auto")
    assert policy == "mixed_bfloat16"
    assert note is not None and "auto picks float32 here (CPU without AVX512-BF16" in note
    assert "emulated" in note
    assert train._mixed_run_policy("float16") == ("float16", None)  # asked for: as asked
    monkeypatch.setattr(train, "Policy", lambda name: Policy("mixed_bfloat16"))
    assert train._mixed_run_policy("auto") == ("auto", None)  # auto is mixed: as it is


def test_identical_configurations_are_not_a_speed_result(capsys):
    assert cli.main(["train", "--data", "synthetic", "--epochs", "1", "--quiet", "--in-process",
                     "--policy", "float32", "--compare", "float32"]) == 0  # fmt: skip
    out = capsys.readouterr().out
    assert "the same configuration twice: the speed column is run-to-run noise" in out
    assert "x the speed" not in out


def test_policy_strings_of_the_library_are_accepted(capsys):
    """`--policy` takes the library's policy strings (`params=...,compute=...`)."""
    policy = "params=float32,compute=bfloat16,output=float32"
    assert cli.main(["train", "--data", "synthetic", "--epochs", "1", "--quiet", "--in-process",
                     "--compare", "none", "--policy", policy]) == 0  # fmt: skip
    assert "mixed_bfloat16" in capsys.readouterr().out  # the preset those dtypes make
    assert cli.main(["train", "--quiet", "--in-process", "--policy", "params=float32,x=1"]) == 2
    assert "bad entry 'x=1'" in capsys.readouterr().err


def test_plot_without_suffix_says_the_file_it_wrote(tmp_path, capsys):
    target = tmp_path / "curves"
    assert cli.main(["train", "--data", "synthetic", "--epochs", "2", "--compare", "none",
                     "--quiet", "--in-process", "--plot", str(target)]) == 0  # fmt: skip
    assert f"loss curves written to {target}.png" in capsys.readouterr().out
    assert (tmp_path / "curves.png").stat().st_size > 0 and not target.exists()


def test_an_error_in_the_worker_process_is_one_line_exit_2(capsys):
    """Each run trains in a worker process: its error comes back as the same one line."""
    assert cli.main(["train", "--quiet", "--model", "cnn", "--data", "synthetic",
                     "--compare", "none", "--epochs", "1"]) == 2  # fmt: skip
    err = capsys.readouterr().err.strip()
    assert err.startswith("mixprec train: error: model 'cnn' needs image data")
    assert len(err.splitlines()) == 1
