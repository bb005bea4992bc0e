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


def test_info_names_the_allocator_and_whether_it_keeps_freed_memory(capsys, monkeypatch):
    # This process's own answer, whatever the machine: the last line, as allocator() says.
    from mixprec.bench.faults import allocator

    assert cli.main(["info"]) == 0
    assert capsys.readouterr().out.splitlines()[-1] == f"allocator: {allocator()}"
    # With both glibc variables set, and a glibc process, it says the heap is kept.
    monkeypatch.setenv("MALLOC_TRIM_THRESHOLD_", "1073741824")
    monkeypatch.setenv("MALLOC_MMAP_THRESHOLD_", "1073741824")
    monkeypatch.setattr("platform.libc_ver", lambda: ("glibc", "2.36"))
    monkeypatch.setattr("mixprec.bench.faults.Path.read_text", lambda self: "")
    assert cli.main(["info"]) == 0
    last = capsys.readouterr().out.splitlines()[-1]
    assert last == "allocator: glibc malloc, heap kept (trim and mmap thresholds set)"
