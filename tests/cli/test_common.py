"""The checks every command shares: bad paths and values exit 2 with one line, before any work."""

from __future__ import annotations

import pytest

from mixprec import cli


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
