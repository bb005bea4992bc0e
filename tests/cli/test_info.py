"""``mixprec info``."""

from __future__ import annotations

import argparse

import pytest
import torch

from mixprec import _hardware, cli
from mixprec.bench.faults import allocator
from mixprec.cli import info
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


@pytest.fixture
def no_cpu_flags(monkeypatch):
    """A machine without /proc/cpuinfo flags (macOS, Windows): the probe asks oneDNN, whose
    answer the test sets. The cached probes are cleared before and after."""
    _hardware.probe_hardware.cache_clear()
    monkeypatch.setattr(_hardware, "_cpu_flags", frozenset)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    yield lambda answer: monkeypatch.setattr(
        torch.ops.mkldnn, "_is_mkldnn_bf16_supported", lambda: answer, raising=False
    )
    _hardware.probe_hardware.cache_clear()


@pytest.mark.parametrize("onednn", [False, True])
def test_info_says_what_onednn_answered_without_cpu_flags(no_cpu_flags, onednn, capsys):
    """It printed "oneDNN bf16 support reported" where oneDNN reported none."""
    no_cpu_flags(onednn)
    assert info.run(argparse.Namespace()) == 0
    hardware = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("hardware:"))
    said = "reports bf16 support" if onednn else "reports no bf16 support"
    assert hardware == (
        f"hardware: CPU (no CPU flags to read; oneDNN {said}) (fast bfloat16: {onednn}, "
        "fast float16: False)"
    )
