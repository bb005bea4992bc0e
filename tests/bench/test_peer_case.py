"""``benchmarks/peer_case.py``, the script behind docs/benchmarks.md's page-fault table:
every side of every case trains, and a run prints and records its figures."""

from __future__ import annotations

import importlib.util
import re
import sys

import pytest
import torch

from tests.conftest import ROOT


@pytest.fixture(scope="module")
def peer_case():
    spec = importlib.util.spec_from_file_location("peer_case", ROOT / "benchmarks" / "peer_case.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("case", ["mlp64-sgd", "mlp64-adamw", "mlp8192-adamw", "cnn-sgd"])
@pytest.mark.parametrize("side", ["default", "autocast", "o1", "bf16"])
def test_every_side_of_every_case_trains(peer_case, side, case):
    step, model = peer_case.make_step(side, case)
    before = [p.detach().clone() for p in model.parameters()]
    step()
    step()
    after = list(model.parameters())
    assert all(torch.isfinite(p).all() for p in after)
    assert any(not torch.equal(a, b) for a, b in zip(after, before, strict=True))


def test_a_run_prints_and_appends_its_figures(peer_case, monkeypatch, tmp_path, capsys):
    out = tmp_path / "ms.txt"
    argv = ["peer_case.py", "default", "mlp64-adamw", "--steps", "5", "--out", str(out)]
    monkeypatch.setattr(sys, "argv", argv)
    peer_case.main()
    printed = capsys.readouterr().out.strip()
    faults = "-" if sys.platform == "win32" else r"\d+"
    match = re.fullmatch(
        rf"default mlp64-adamw eager: (\d+\.\d\d) ms a step, ({faults}) page faults a step",
        printed,
    )
    assert match is not None, printed
    assert float(match.group(1)) > 0
    assert float(out.read_text()) == pytest.approx(float(match.group(1)), abs=0.01)


def test_a_case_it_does_not_have_is_refused(peer_case, monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", ["peer_case.py", "default", "lm"])
    with pytest.raises(SystemExit):
        peer_case.main()
    assert "invalid choice: 'lm'" in capsys.readouterr().err


def test_keep_grad_buffers_is_refused_for_a_side_without_mixprec(peer_case, monkeypatch, capsys):
    argv = ["peer_case.py", "autocast", "mlp64-sgd", "--keep-grad-buffers"]
    monkeypatch.setattr(sys, "argv", argv)
    with pytest.raises(SystemExit):
        peer_case.main()
    err = capsys.readouterr().err
    assert "--keep-grad-buffers is for the default and o1 sides, not autocast" in err
