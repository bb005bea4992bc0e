"""``mixprec info``."""

from __future__ import annotations

from mixprec import cli
from mixprec.policy import Policy


def test_info_reports_auto_policy_and_reason(capsys):
    assert cli.main(["info"]) == 0
    out = capsys.readouterr().out
    policy = Policy("auto")
    assert f"auto policy: {policy.name} ({policy})" in out
    assert f"because: {policy.reason}" in out
