"""``mixprec autotune``: its options, checked before any model is built or measured."""

from __future__ import annotations

import pytest

from mixprec import cli
from mixprec.cli import autotune


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--check-steps", "1"], "--check-steps must be an int >= 2, got 1"),
        (["--check-steps", "0"], "--check-steps must be an int >= 2, got 0"),
        (["--workload", "mlp-b64", "--small", "--seed", "-1"],
         "--seed must be an int in [0, 2**63), got -1"),
        (["--workload", "mlp-b64", "--small", "--seed", str(2**70)],
         f"--seed must be an int in [0, 2**63), got {2**70}"),
        (["--seed", "-1"], "--seed must be an int in [0, 2**63), got -1"),
    ],
)  # fmt: skip
def test_autotune_refuses_a_bad_value_before_any_work(argv, message, monkeypatch, capsys):
    """--check-steps 1 passed the CLI's check (>= 1) and failed after everything was built,
    naming the API's check_steps=; --seed with --workload was not checked at all (a huge
    one ended in "Overflow when unpacking long long")."""
    monkeypatch.setattr(autotune, "_problem", lambda args: pytest.fail("work started"))
    assert cli.main(["autotune", "--time-budget", "5", *argv]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err == f"mixprec autotune: error: {message}\n"
