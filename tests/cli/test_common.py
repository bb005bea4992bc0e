"""The checks every command shares: bad paths and values exit 2 with one line, before any work."""

from __future__ import annotations

import os
from pathlib import Path

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
        (
            ["convert", "{tmp}/adir", "{tmp}/x.safetensors"],
            "'{tmp}/adir' is a directory, not a checkpoint",
        ),
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
        (["bench", "--max-batch", "-1"], "a finite number > 0, got -1"),
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


PLOT_PATHS = [
    ("{tmp}/adir", "--plot '{tmp}/adir' is a directory; give a .png file path"),
    ("{tmp}/adir/", "--plot '{tmp}/adir/' is a directory; give a .png file path"),
    ("{tmp}/new/", "--plot '{tmp}/new/' is a directory; give a .png file path"),
    ("{tmp}/no/such/p.png", "'{tmp}/no/such' does not exist; give a .png file path in an exi"),
    ("{tmp}/afile/p.png", "'{tmp}/afile' is not a directory; give a .png file path in an exi"),
    ("{tmp}/p.txt", "--plot '{tmp}/p.txt': matplotlib cannot write '.txt' files; give a .png"),
]


@pytest.mark.parametrize("command", ["train", "doctor"])
@pytest.mark.parametrize(
    ("plot", "message"),
    PLOT_PATHS,
    ids=["dir", "dir-slash", "new-dir-slash", "no-parent", "file-parent", "bad-suffix"],
)
def test_plot_path_is_checked_before_any_work(command, plot, message, checkpoint_and_file, capsys):
    """`--plot DIR` is refused as given, not written as `DIR.png` after the work; so is a path
    that cannot be written or a suffix matplotlib does not write."""
    tmp, _ = checkpoint_and_file
    argv = [command, "--plot", plot.format(tmp=tmp)]
    if command == "train":
        argv += ["--quiet", "--in-process"]
    assert cli.main(argv) == 2
    out, err = capsys.readouterr()
    assert out == ""  # nothing trained or diagnosed
    assert err.startswith(f"mixprec {command}: error: ") and message.format(tmp=tmp) in err
    assert len(err.strip().splitlines()) == 1
    assert sorted(p.name for p in tmp.iterdir()) == ["adir", "afile", "c.safetensors"]


@pytest.mark.parametrize("command", ["train", "doctor"])
def test_plot_in_a_read_only_directory_is_refused_before_any_work(
    command, tmp_path, monkeypatch, capsys
):
    from mixprec.cli import _common

    locked = tmp_path / "locked"
    locked.mkdir()
    # As root every directory is writable: the permission check is made to see a read-only one.
    real_access = os.access
    monkeypatch.setattr(
        _common.os, "access", lambda p, mode: Path(p) != locked and real_access(p, mode)
    )
    argv = [command, "--plot", str(locked / "p.png")]
    assert cli.main([*argv, "--quiet", "--in-process"] if command == "train" else argv) == 2
    out, err = capsys.readouterr()
    assert out == "" and len(err.strip().splitlines()) == 1
    assert f"--plot '{locked}/p.png': cannot write in '{locked}' (permission denied); " in err
    assert "give a .png file path in a writable directory" in err
    assert list(locked.iterdir()) == []


def test_sigterm_is_one_line_and_exit_143_and_the_handler_is_restored(monkeypatch, capsys):
    """In the process that calls `cli.main`: SIGTERM unwinds the command to exit 143, and the
    caller's own SIGTERM handler is back afterwards (and is not called meanwhile)."""
    import signal

    from mixprec.cli import train

    caught: list[int] = []

    def callers_handler(signum, frame):
        caught.append(signum)

    def terminated(args):
        os.kill(os.getpid(), signal.SIGTERM)
        return 0  # not reached: the handler raises as os.kill returns

    monkeypatch.setattr(train, "run", terminated)
    previous = signal.signal(signal.SIGTERM, callers_handler)
    try:
        assert cli.main(["train"]) == 143
        assert signal.getsignal(signal.SIGTERM) is callers_handler and caught == []
    finally:
        signal.signal(signal.SIGTERM, previous)
    assert capsys.readouterr().err.strip() == "mixprec train: interrupted (SIGTERM)"


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["train", "--save", ""], "--save '' is empty; give a directory"),
        (["train", "--plot", ""], "--plot '' is empty; give a .png file path"),
        (["doctor", "--json", ""], "--json '' is empty; give a file path"),
        (["doctor", "--plot", ""], "--plot '' is empty; give a .png file path"),
        (["bench", "mlp-b64", "--small", "--json", ""], "--json '' is empty; give a file path"),
        (
            ["bench", "mlp-b64", "--small", "--plot", ""],
            "--plot '' is empty; give a .png file path",
        ),
        (["autotune", "--json", ""], "--json '' is empty; give a file path"),
        (["autotune", "--plot", ""], "--plot '' is empty; give a .png file path"),
        (["convert", "{ckpt}", ""], "output '' is empty; give a file path"),
    ],
)
def test_an_empty_output_path_is_refused_not_ignored(argv, message, checkpoint_and_file, capsys):
    """`--save ""`, `--json ""` and `--plot ""` were taken as not given: the command ran and
    wrote nothing, without a word."""
    tmp, ckpt = checkpoint_and_file
    argv = [a.format(ckpt=ckpt) for a in argv]
    if argv[0] == "train":
        argv += ["--quiet", "--in-process"]
    assert cli.main(argv) == 2
    out, err = capsys.readouterr()
    assert out == "" and err == f"mixprec {argv[0]}: error: {message}\n"
    assert sorted(p.name for p in tmp.iterdir()) == ["adir", "afile", "c.safetensors"]


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="needs mkfifo")
@pytest.mark.parametrize("option", ["--json", "--plot"])
def test_an_output_that_is_a_fifo_is_refused(option, tmp_path, capsys):
    """A device, pipe or socket at an output path was replaced by the atomic write."""
    import stat

    fifo = tmp_path / ("out.png" if option == "--plot" else "out.json")
    os.mkfifo(fifo)
    assert cli.main(["doctor", option, str(fifo)]) == 2
    valid = "a .png file path" if option == "--plot" else "a file path"
    assert capsys.readouterr().err == (
        f"mixprec doctor: error: {option} {str(fifo)!r} is not a regular file (a device, pipe "
        f"or socket); give {valid}\n"
    )
    assert stat.S_ISFIFO(os.stat(fifo).st_mode)
