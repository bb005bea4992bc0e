"""``benchmarks/peer_case.py``, the script behind docs/benchmarks.md's page-fault table:
both sides of every case run, and a run prints and records its figures."""

from __future__ import annotations

import importlib.util
import re
import sys

import pytest

from tests.conftest import ROOT


@pytest.fixture(scope="module")
def peer_case():
    spec = importlib.util.spec_from_file_location("peer_case", ROOT / "benchmarks" / "peer_case.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("case", ["mlp64-sgd", "mlp64-adamw", "cnn-sgd"])
@pytest.mark.parametrize("side", ["default", "autocast"])
def test_both_sides_of_a_case_step(peer_case, side, case):
    step = peer_case.make_step(side, case, compiled=False)
    step()
    step()


def test_a_run_prints_and_appends_its_figures(peer_case, monkeypatch, tmp_path, capsys):
    out = tmp_path / "ms.txt"
    argv = ["peer_case.py", "default", "mlp64-adamw", "--steps", "5", "--out", str(out)]
    monkeypatch.setattr(sys, "argv", argv)
    peer_case.main()
    printed = capsys.readouterr().out.strip()
    match = re.fullmatch(
        r"default mlp64-adamw eager: (\d+\.\d\d) ms a step, (\d+) page faults a step", printed
    )
    assert match is not None, printed
    assert float(match.group(1)) > 0
    assert float(out.read_text()) == pytest.approx(float(match.group(1)), abs=0.01)


def test_a_case_it_does_not_have_is_refused(peer_case, monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", ["peer_case.py", "default", "lm"])
    with pytest.raises(SystemExit):
        peer_case.main()
    assert "invalid choice: 'lm'" in capsys.readouterr().err
