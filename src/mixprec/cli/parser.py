"""The ``mixprec`` command line: its argparse parser and ``main``.

Each subcommand lives in its own module with ``HELP``, ``add_arguments(sub)`` and
``run(args) -> int`` (and, optionally, ``EPILOG``: text ``--help`` shows after the options);
this module lists them, in the order ``mixprec --help`` shows, and turns their errors into
one line on stderr and an exit status.
"""

from __future__ import annotations

import argparse
import importlib
import re
import sys
from collections.abc import Sequence

from mixprec import distributed
from mixprec._version import __version__
from mixprec.cli import autotune, bench, convert, doctor, info, inspect, train
from mixprec.cli._common import Terminated, UsageError, sigterm_raises
from mixprec.cli._train_worker import WorkerEndedError

COMMANDS = {
    "train": train,
    "convert": convert,
    "inspect": inspect,
    "doctor": doctor,
    "bench": bench,
    "autotune": autotune,
    "info": info,
}


class HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """Each option's help followed by ``(default: VALUE)``, as argparse's
    ``ArgumentDefaultsHelpFormatter`` writes it, but only where there is a value to show:
    not for flags (``False``), for options without a default (``None``), or for help that
    states its default itself. The description and epilog keep their line breaks."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help
        if (
            text is None
            or "default" in text
            or action.default is None
            or action.default is False  # a flag (0 is a default to show)
            or action.default == argparse.SUPPRESS
            or (not action.option_strings and action.nargs not in ("?", "*"))
        ):
            return text
        return f"{text} (default: %(default)s)"


def build_parser() -> argparse.ArgumentParser:
    """The parser of every subcommand; each sets ``run`` to its module's ``run``, looked up
    when the parser is built."""
    # The package's docstring is the description; read here, as the package imports no CLI.
    description = importlib.import_module("mixprec").__doc__
    parser = argparse.ArgumentParser(prog="mixprec", description=description)
    parser.add_argument("--version", action="version", version=__version__)
    commands = parser.add_subparsers(dest="command", required=True)
    for name, module in COMMANDS.items():
        sub = commands.add_parser(
            name, help=module.HELP, description=f"mixprec {name}: {module.HELP}.",
            epilog=getattr(module, "EPILOG", None), formatter_class=HelpFormatter,
        )  # fmt: skip
        module.add_arguments(sub)
        sub.set_defaults(run=module.run)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line ``argv`` (``sys.argv[1:]`` by default); return the exit status:
    0, 2 for a bad value or path (one line on stderr), 1 when a worker process ended
    without a result (killed, or exited), 130 when interrupted by SIGINT (Ctrl-C), 143 by
    SIGTERM; a command stops its worker processes before it returns either."""
    args = build_parser().parse_args(argv)
    try:
        with sigterm_raises():
            return int(args.run(args))
    except (UsageError, OSError, ValueError) as err:  # OSError: a path that went bad mid-run
        print(f"mixprec {args.command}: error: {err}", file=sys.stderr)
        return 2
    except WorkerEndedError as err:  # killed (the OOM killer's SIGKILL): nothing of ours to show
        print(f"mixprec {args.command}: error: {err}", file=sys.stderr)
        return 1
    except (MemoryError, RuntimeError) as err:  # other RuntimeErrors are bugs: traceback
        said = _out_of_memory(err)
        if said is None:
            raise
        hint = getattr(COMMANDS[args.command], "MEMORY_HINT", None)
        print(f"mixprec {args.command}: error: out of memory: {said}"
              + (f"; {hint} may fit" if hint else ""), file=sys.stderr)  # fmt: skip
        return 2
    except KeyboardInterrupt:
        print(f"mixprec {args.command}: interrupted", file=sys.stderr)
        return 130
    except Terminated:
        print(f"mixprec {args.command}: interrupted (SIGTERM)", file=sys.stderr)
        return 143
    finally:
        # Under torchrun: leave the process group cleanly (gloo aborts the process otherwise);
        # no barrier, as another rank may have failed.
        distributed.shutdown(wait=False)


# What torch's allocators say when an allocation fails (CPU, CUDA, MPS, XPU).
_NO_MEMORY = re.compile(r"can't allocate memory|cannot allocate memory|out of memory", re.I)


def _out_of_memory(err: BaseException) -> str | None:
    """The first line of an allocation failure's message (without the C++ assertion's
    ``[enforce fail at ...]`` prefix); ``None`` for any other error."""
    text = str(err).strip()
    # torch's OutOfMemoryError (CUDA's, since 2.5 torch's own) says "out of memory" too.
    if not (isinstance(err, MemoryError) or _NO_MEMORY.search(text)):
        return None
    first = (text.splitlines() or [""])[0]
    first = re.sub(r"^\[enforce fail at [^\]]*\][^.]*\.\s*", "", first)  # and its condition
    return first or f"{type(err).__name__} (no size given)"
