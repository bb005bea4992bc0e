"""``mixprec info``: what mixprec sees on this machine, and what ``auto`` picks there."""

from __future__ import annotations

import argparse

import torch

from mixprec._hardware import probe_hardware
from mixprec._version import __version__
from mixprec.bench.faults import allocator
from mixprec.levels import resolve_level
from mixprec.policy import Policy

HELP = "what mixprec sees on this machine"


def add_arguments(sub: argparse.ArgumentParser) -> None:
    """``mixprec info`` takes no options."""


def run(_: argparse.Namespace) -> int:
    """Print the versions, the hardware probe, the ``auto`` policy and level with why, and
    the C allocator (whether it keeps freed memory: page faults on CPU)."""
    hw = probe_hardware()
    policy = Policy("auto")
    print(f"mixprec {__version__}, torch {torch.__version__}")
    print(f"hardware: {hw.detail} (fast bfloat16: {hw.bf16_fast}, fast float16: {hw.fp16_fast})")
    print(f"auto policy: {policy.name} ({policy})")
    print(f"  because: {policy.reason}")
    print(f"auto level for it: {resolve_level('auto', policy)}")
    print(f"allocator: {allocator()}")
    return 0
