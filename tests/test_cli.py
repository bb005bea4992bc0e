"""Every CLI command and its error exits."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest

from mixprec import cli
from mixprec.policy import Policy


def test_info_reports_auto_policy_and_reason(capsys):
    assert cli.main(["info"]) == 0
    out = capsys.readouterr().out
    policy = Policy("auto")
    assert f"auto policy: {policy.name} ({policy})" in out
    assert f"because: {policy.reason}" in out


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


def test_unknown_command_exits_2(capsys):
    with pytest.raises(SystemExit) as err:
        cli.main(["frobnicate"])
    assert err.value.code == 2
    assert "invalid choice: 'frobnicate'" in capsys.readouterr().err


def test_console_script_and_module_entry_point():
    done = subprocess.run(
        [sys.executable, "-m", "mixprec", "info"], capture_output=True, text=True, check=True
    )
    assert "auto policy:" in done.stdout
    bad = subprocess.run(
        [sys.executable, "-m", "mixprec", "train", "--model", "nope"],
        capture_output=True,
        text=True,
    )
    assert bad.returncode == 2 and "unknown model 'nope'" in bad.stderr


def test_importing_mixprec_leaves_dynamo_unloaded():
    # torch._dynamo takes ~2 s to import: info, inspect and convert would pay it. (It loads
    # when something compiles, and at torch's first optimizer, whose __init__ loads it.)
    code = (
        "import sys, mixprec, mixprec.cli, mixprec.bench; "
        "print([m for m in sys.modules if m.startswith('torch._dynamo')][:3])"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"


def test_convert_and_inspect(tmp_path, capsys):
    import torch

    import mixprec as mp
    from tests.conftest import make_mlp

    model = mp.auto_mixed_precision(make_mlp(), "mixed_bfloat16", "O2")
    opt = mp.LossScaleOptimizer(torch.optim.Adam(model.parameters()))
    ckpt = mp.save_checkpoint(tmp_path / "c.safetensors", model, opt, {"global_step": 7})
    assert cli.main(["inspect", str(ckpt)]) == 0
    out = capsys.readouterr().out
    assert "policy: params=float32,compute=bfloat16,output=float32" in out
    assert "level: O2" in out and "trainer state: {'global_step': 7}" in out
    assert re.search(r"model/0\.weight\s+float32\s+\(64, 32\)", out)  # the float32 master
    half = tmp_path / "half.safetensors"
    assert cli.main(["convert", str(ckpt), str(half), "--dtype", "bfloat16"]) == 0
    assert "8 tensors in bfloat16 (8 converted from another dtype)" in capsys.readouterr().out
    same = tmp_path / "same.safetensors"
    assert cli.main(["convert", str(ckpt), str(same), "--dtype", "float32"]) == 0
    # Before: "0 tensors converted to float32" after writing 8 (the masters are float32).
    assert "8 tensors in float32 (0 converted from another dtype)" in capsys.readouterr().out
    tensors, _ = mp.read_checkpoint(half)
    assert {t.dtype for t in tensors.values()} == {torch.bfloat16}
    assert sorted(tensors) == [f"model/{k}" for k in sorted(make_mlp().state_dict())]

    big = make_mlp()
    with torch.no_grad():
        big[0].weight[0, 0] = 1e6
    torch.save(big.state_dict(), tmp_path / "big.pt")
    assert cli.main(["convert", str(tmp_path / "big.pt"), str(tmp_path / "o.st"),
                     "--dtype", "float16"]) == 2  # fmt: skip
    err = capsys.readouterr().err
    assert "mixprec convert: error:" in err and "'0.weight' has max |value| 1e+06" in err
    assert cli.main(["convert", str(tmp_path / "big.pt"), str(tmp_path / "o.st"),
                     "--dtype", "float16", "--on-range", "clamp"]) == 0  # fmt: skip
    assert "exceeds float16 (clamp)" in capsys.readouterr().out
    assert cli.main(["inspect", str(tmp_path / "absent")]) == 2
    assert "no such checkpoint file" in capsys.readouterr().err


def test_doctor_command(tmp_path, capsys):
    import json

    out_json, out_png = tmp_path / "r.json", tmp_path / "r.png"
    args = ["doctor", "--policy", "mixed_float16", "--batch-size", "64",
            "--json", str(out_json), "--plot", str(out_png)]  # fmt: skip
    assert cli.main(args) == 0
    out = capsys.readouterr().out
    assert "policy mixed_float16, level O2, loss scale 65536" in out
    assert "healthy: no module at risk in float16" in out
    assert json.loads(out_json.read_text())["culprits"] == []
    assert out_png.read_bytes()[:4] == b"\x89PNG"
    assert cli.main(["doctor", "--policy", "fp8"]) == 2
    assert "unknown policy 'fp8'" in capsys.readouterr().err


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


def test_convert_refuses_nan_by_default_and_lists_it_when_ignored(tmp_path, capsys):
    import torch

    import mixprec as mp
    from tests.conftest import make_mlp

    model = make_mlp()
    with torch.no_grad():
        model[0].weight[0, :3] = torch.tensor([float("nan"), float("inf"), 1.0])
    ckpt = mp.save_checkpoint(tmp_path / "c.safetensors", model)
    out = tmp_path / "half.safetensors"
    assert cli.main(["convert", str(ckpt), str(out), "--dtype", "bfloat16"]) == 2
    assert "'0.weight' (1 NaN, 1 inf)" in capsys.readouterr().err and not out.exists()
    argv = ["convert", str(ckpt), str(out), "--dtype", "bfloat16", "--on-range", "ignore"]
    assert cli.main(argv) == 0
    assert "  0.weight: 1 NaN, 1 inf (kept: --on-range ignore)" in capsys.readouterr().out


def test_bench_float8_mode_says_what_it_converted_and_that_cpu_emulates_it(capsys):
    pytest.importorskip("torchao")
    # torchao's size thresholds convert none of the small MLP's layers: a fast float8 run.
    # --policy adds the policy's mode beside float32 and O2-bf16 (issue 16: `bench --policy`).
    assert cli.main(["bench", "mlp-b64", "--small", "--policy", "mixed_float8",
                     "--float8-min-features", "torchao", "--no-memory", "--repeats", "1",
                     "--steps", "1", "--min-round-ms", "0"]) == 0  # fmt: skip
    out = capsys.readouterr().out
    rows = [line.split()[0] for line in out.splitlines() if line.startswith(("float32 ", "O2-"))]
    assert rows[:3] == ["float32", "O2-bf16", "O2-fp8"]
    assert " fp8 " in out and " 0/3 " in out and "O2-fp8: " in out
    assert "fp8: Linear layers converted to float8 / Linear layers in the model " in out
    assert "(torchao's H100 size thresholds; the output head stays bfloat16)" in out
    assert "note: float8 on CPU is emulated" in out


def test_main_job_trains_bfloat16_where_auto_picks_float32(monkeypatch):
    """Issue 15: on a CPU without fast 16-bit math `auto` is float32, and the main job
    trained float32 twice. It trains bfloat16 and says why, whatever this machine has."""
    float32_here = Policy("float32")
    object.__setattr__(float32_here, "reason", "CPU without AVX512-BF16 or AMX")
    monkeypatch.setattr(cli, "Policy", lambda name: float32_here)
    policy, note = cli._mixed_run_policy("auto")
    assert policy == "mixed_bfloat16"
    assert note is not None and "auto picks float32 here (CPU without AVX512-BF16" in note
    assert "emulated" in note
    assert cli._mixed_run_policy("float16") == ("float16", None)  # asked for: as asked
    monkeypatch.setattr(cli, "Policy", lambda name: Policy("mixed_bfloat16"))
    assert cli._mixed_run_policy("auto") == ("auto", None)  # auto is mixed: as it is


def test_identical_configurations_are_not_a_speed_result(capsys):
    assert cli.main(["train", "--data", "synthetic", "--epochs", "1", "--quiet", "--in-process",
                     "--policy", "float32", "--compare", "float32"]) == 0  # fmt: skip
    out = capsys.readouterr().out
    assert "the same configuration twice: the speed column is run-to-run noise" in out
    assert "x the speed" not in out


def test_policy_strings_of_the_library_are_accepted(capsys):
    """Issue 15 item 9: `--policy params=...,compute=...` was refused."""
    policy = "params=float32,compute=bfloat16,output=float32"
    assert cli.main(["train", "--data", "synthetic", "--epochs", "1", "--quiet", "--in-process",
                     "--compare", "none", "--policy", policy]) == 0  # fmt: skip
    assert "mixed_bfloat16" in capsys.readouterr().out  # the preset those dtypes make
    assert cli.main(["train", "--quiet", "--in-process", "--policy", "params=float32,x=1"]) == 2
    assert "bad entry 'x=1'" in capsys.readouterr().err


@pytest.fixture
def checkpoint_and_file(tmp_path):
    import torch

    import mixprec as mp
    from tests.conftest import make_mlp

    model = mp.auto_mixed_precision(make_mlp(), "mixed_bfloat16", "O2")
    ckpt = mp.save_checkpoint(tmp_path / "c.safetensors", model)
    (tmp_path / "adir").mkdir()
    (tmp_path / "afile").write_text("x")
    torch.manual_seed(0)
    return tmp_path, str(ckpt)


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["convert", "{ckpt}", "{tmp}/adir"], "output '{tmp}/adir' is a directory; give a file"),
        (["convert", "{ckpt}", "{tmp}/afile/x.st"], "'{tmp}/afile' is not a directory"),
        (["convert", "{ckpt}", "{tmp}/no/such/x.st"], "'{tmp}/no/such' does not exist"),
        (["convert", "{tmp}/adir", "{tmp}/x.st"], "'{tmp}/adir' is a directory, not a checkpoint"),
        (["inspect", "{tmp}/adir"], "'{tmp}/adir' is a directory, not a checkpoint file"),
        (["train", "--save", "{tmp}/afile"], "--save '{tmp}/afile' is an existing file"),
        (["train", "--plot", "{tmp}/afile/p.png"], "'{tmp}/afile' is not a directory"),
        (["doctor", "--json", "{tmp}/afile/r.json"], "'{tmp}/afile' is not a directory"),
        (["doctor", "--plot", "{tmp}/afile/r.png"], "'{tmp}/afile' is not a directory"),
        (["doctor", "--batch-size", "0"], "--batch-size must be >= 1, got 0"),
        (["doctor", "--batch-size", "-5"], "--batch-size must be >= 1, got -5"),
        (["bench", "--small", "--json", "{tmp}/afile/b.json"], "'{tmp}/afile' is not a directory"),
        (["bench", "--small", "--plot", "{tmp}/adir.png/x"], "'{tmp}/adir.png' does not exist"),
        (["bench", "nosuchmod:fn"], "cannot import module 'nosuchmod'"),
        (["bench", "os:nosuch"], "module 'os' has no function 'nosuch'"),
        (["bench", "--device", "gpu"], "--device 'gpu' is not a device; valid: auto, cpu, cuda"),
        (["bench", "--max-batch", "-1"], "--max-batch must be a memory budget in MB > 0, got -1"),
        (["bench", "--modes", "mixed_float8"], "policy 'mixed_float8' is mode 'O2-fp8'"),
        (["bench", "--float8-min-features", "0"], "an int >= 1 or 'torchao', got '0'"),
        (["bench", "--float8-min-features", "big"], "an int >= 1 or 'torchao', got 'big'"),
        (["train", "--float8-min-features", "-3"], "an int >= 1 or 'torchao', got '-3'"),
        (["bench", "--policy", "float32"], "--policy 'float32' has no bench mode; valid: mixed_"),
    ],
)
def test_bad_paths_and_values_exit_2_before_any_work(argv, message, checkpoint_and_file, capsys):
    tmp, ckpt = checkpoint_and_file
    argv = [a.format(tmp=tmp, ckpt=ckpt) for a in argv]
    if argv[0] == "train":
        argv += ["--quiet", "--in-process"]
    assert cli.main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"mixprec {argv[0]}: error: ") and message.format(tmp=tmp) in err
    assert len(err.splitlines()) == 1
    assert sorted(p.name for p in tmp.iterdir()) == ["adir", "afile", "c.safetensors"]


@pytest.mark.skipif(
    __import__("torch").cuda.is_available(), reason="checks the refusal on a machine without CUDA"
)
def test_bench_cuda_without_cuda_is_one_line(capsys):
    assert cli.main(["bench", "--small", "--device", "cuda"]) == 2
    assert "--device 'cuda': CUDA is not available" in capsys.readouterr().err


def test_ctrl_c_is_one_line_and_exit_130(monkeypatch, capsys):
    def interrupted(args):
        raise KeyboardInterrupt

    monkeypatch.setattr(cli, "_train", interrupted)
    assert cli.main(["train"]) == 130
    assert capsys.readouterr().err.strip() == "mixprec train: interrupted"


def test_plot_without_suffix_says_the_file_it_wrote(tmp_path, capsys):
    target = tmp_path / "curves"
    assert cli.main(["train", "--data", "synthetic", "--epochs", "2", "--compare", "none",
                     "--quiet", "--in-process", "--plot", str(target)]) == 0  # fmt: skip
    assert f"loss curves written to {target}.png" in capsys.readouterr().out
    assert (tmp_path / "curves.png").stat().st_size > 0 and not target.exists()
