"""``mixprec info``."""

from __future__ import annotations

from mixprec import cli
from mixprec.bench.faults import allocator
from mixprec.policy import Policy


def test_info_reports_auto_policy_and_reason(capsys):
    assert cli.main(["info"]) == 0
    out = capsys.readouterr().out
    policy = Policy("auto")
    assert f"auto policy: {policy.name} ({policy})" in out
    assert f"because: {policy.reason}" in out


def test_info_names_the_allocator_and_whether_it_keeps_freed_memory(capsys):
    # This process's own answer as its last line (allocator()'s cases: test_faults.py).
    assert cli.main(["info"]) == 0
    assert capsys.readouterr().out.splitlines()[-1] == f"allocator: {allocator()}"
