"""The parser and ``main``: unknown commands, the entry points, the exit status of an
interrupt, and what importing the CLI loads."""

from __future__ import annotations

import subprocess
import sys

import pytest

from mixprec import cli
from mixprec.cli import train


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


def test_ctrl_c_is_one_line_and_exit_130(monkeypatch, capsys):
    def interrupted(args):
        raise KeyboardInterrupt

    # The parser takes each command's ``run`` from its module when main builds it.
    monkeypatch.setattr(train, "run", interrupted)
    assert cli.main(["train"]) == 130
    assert capsys.readouterr().err.strip() == "mixprec train: interrupted"
