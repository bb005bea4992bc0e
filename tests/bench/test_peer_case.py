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


def _assert_trains(step, model) -> None:
    """Two steps leave every weight finite and move at least one."""
    before = [p.detach().clone() for p in model.parameters()]
    step()
    step()
    after = list(model.parameters())
    assert all(torch.isfinite(p).all() for p in after)
    assert any(not torch.equal(a, b) for a, b in zip(after, before, strict=True))


@pytest.mark.parametrize("case", ["mlp64-sgd", "mlp64-adamw", "mlp8192-adamw", "cnn-sgd"])
@pytest.mark.parametrize("side", ["default", "autocast", "o1", "bf16"])
def test_every_side_of_every_case_trains(peer_case, side, case):
    step, model = peer_case.make_step(side, case)
    _assert_trains(step, model)


def test_the_lm_case_is_the_bench_lm_d512(peer_case):
    # Not trained here: its bfloat16 steps take seconds where bfloat16 is emulated.
    from mixprec.bench.workloads import get_workload

    model, x, y, loss_fn = peer_case.build("lm-adamw")
    work = get_workload("lm-d512")
    bench_model = work.make_model()
    assert [p.shape for p in model.parameters()] == [p.shape for p in bench_model.parameters()]
    assert torch.equal(x, work.batch[0]) and torch.equal(y, work.batch[1])
    logits = torch.randn(8, 256, 8192)
    torch.testing.assert_close(loss_fn(logits, y), work.loss_fn(logits, y))


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
    with pytest.raises(SystemExit) as raised:
        peer_case.main()
    assert raised.value.code == 2  # argparse's usage error
    assert "invalid choice: 'lm'" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("argv", "error"),
    [
        (["autocast", "mlp64-sgd", "--keep-grad-buffers"],
         "--keep-grad-buffers is for the default and o1 sides, not autocast"),
        (["bf16", "mlp64-sgd", "--output-bf16"],
         "--output-bf16 is for the default and o1 sides, not bf16"),
        (["autocast", "mlp64-sgd", "--plain-loss"], "--plain-loss is for lm-adamw, not mlp64-sgd"),
    ],
)  # fmt: skip
def test_an_option_for_another_side_or_case_is_refused(peer_case, monkeypatch, capsys, argv, error):
    monkeypatch.setattr(sys, "argv", ["peer_case.py", *argv])
    with pytest.raises(SystemExit) as raised:
        peer_case.main()
    assert raised.value.code == 2  # argparse's usage error
    assert error in capsys.readouterr().err


@pytest.mark.parametrize(
    ("side", "options"),
    [("default", {}), ("default", {"output_bf16": True}), ("o1", {}), ("bf16", {}),
     ("autocast", {}), ("autocast", {"plain_loss": True}), ("default", {"plain_loss": True})],
)  # fmt: skip
def test_the_lm_case_trains_on_every_side(peer_case, monkeypatch, side, options):
    # The bench's small LM (d=64, one layer): the same code path, steps fast enough to run
    # where bfloat16 is emulated.
    from mixprec.bench.workloads import get_workload

    monkeypatch.setattr(peer_case, "get_workload", lambda name: get_workload(name, small=True))
    step, model = peer_case.make_step(side, "lm-adamw", **options)
    _assert_trains(step, model)


def test_the_plain_lm_loss_is_mixprecs_next_token_loss(peer_case):
    # The same targets (token i+1 at position i) and the same positions (the last ignored);
    # 16-bit logits outside autocast are read in float32.
    from mixprec.models import lm_loss

    logits, tokens = torch.randn(2, 5, 11), torch.randint(0, 11, (2, 5))
    torch.testing.assert_close(peer_case._plain_lm_loss(logits, tokens), lm_loss(logits, tokens))
    half = peer_case._plain_lm_loss(logits.bfloat16(), tokens)
    assert half.dtype == torch.float32


@pytest.mark.parametrize("side", ["default", "o1"])
def test_bfloat16_outputs_come_back_in_bfloat16(peer_case, side):
    _, model = peer_case.make_step(side, "mlp64-sgd", output_bf16=True)
    assert model(torch.randn(3, 784)).dtype == torch.bfloat16
    _, model = peer_case.make_step(side, "mlp64-sgd")
    assert model(torch.randn(3, 784)).dtype == torch.float32


def test_the_o2_side_is_mixprec_at_o2_in_bfloat16_whatever_auto_picks(peer_case):
    """The side the figures of a CPU where auto now picks float32 were measured with."""
    from mixprec.levels import applied

    step, model = peer_case.make_step("o2", "mlp64-sgd")
    prepared = applied(model)
    assert (prepared.policy.name, prepared.level) == ("mixed_bfloat16", "O2")
    _assert_trains(step, model)
