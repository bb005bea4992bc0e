"""Command-line interface: a thin argparse layer over the library.

``mixprec train`` trains a model in mixed precision and in float32 and compares them;
``mixprec info`` reports what mixprec sees on this machine and what ``auto`` picks;
``convert`` and ``inspect`` work on checkpoints, ``doctor`` diagnoses one batch's numerics,
``bench`` times the modes. One module per subcommand; ``parser`` holds ``main``.
"""

from mixprec.cli._common import UsageError
from mixprec.cli.parser import build_parser, main
from mixprec.cli.train import run_training

__all__ = ["UsageError", "build_parser", "main", "run_training"]
