"""``python -m mixprec``: the command-line interface."""

import sys

from mixprec.cli import main

sys.exit(main())
