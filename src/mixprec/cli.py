"""Command-line interface: a thin argparse layer over the library.

``mixprec info`` reports what mixprec sees on this machine and what ``auto`` picks.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

import torch

import mixprec
from mixprec._dtypes import probe_hardware
from mixprec.levels import resolve_level
from mixprec.policy import Policy


def _info(_: argparse.Namespace) -> int:
    hw = probe_hardware()
    policy = Policy("auto")
    print(f"mixprec {mixprec.__version__}, torch {torch.__version__}")
    print(f"hardware: {hw.detail} (fast bfloat16: {hw.bf16_fast}, fast float16: {hw.fp16_fast})")
    print(f"auto policy: {policy.name} ({policy})")
    print(f"  because: {policy.reason}")
    print(f"auto level for it: {resolve_level('auto', policy)}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="mixprec", description=mixprec.__doc__)
    parser.add_argument("--version", action="version", version=mixprec.__version__)
    commands = parser.add_subparsers(dest="command", required=True)
    info = commands.add_parser("info", help="what mixprec sees on this machine")
    info.set_defaults(run=_info)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args.run(args))


if __name__ == "__main__":
    sys.exit(main())
