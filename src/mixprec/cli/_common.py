"""What every subcommand shares: the usage error, choice and output-path checks, the
``--float8-min-features`` option, and SIGTERM as an exception.

Every check here runs before any work, so that a bad value costs the user one line and exit
status 2, not a training run that fails at its end.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
from collections.abc import Iterator, Sequence
from pathlib import Path
from types import FrameType

from mixprec._dtypes import closest
from mixprec.float8 import Float8Options
from mixprec.policy import NAMES, Policy

# float8 policies in `mixprec train`: torchao's H100 thresholds convert none of the small
# models' layers, so every Linear whose dims float8 takes is converted (the head stays).
TRAIN_FLOAT8_MIN_FEATURES = 16


class UsageError(Exception):
    """A bad command-line value: reported on one line, exit status 2."""


class Terminated(BaseException):
    """SIGTERM arrived while a command ran. Like ``KeyboardInterrupt`` for SIGINT it unwinds
    the command, which stops its worker processes on the way, to one line and exit status
    143 (128 + SIGTERM). A ``BaseException``, so that no ``except Exception`` swallows it."""


@contextlib.contextmanager
def sigterm_raises() -> Iterator[None]:
    """While the block runs, SIGTERM raises ``Terminated`` in the main thread; the previous
    handler is back afterwards. A SIGTERM that is ignored, or handled outside Python, stays
    so; off the main thread, where no handler can be set, nothing changes."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.getsignal(signal.SIGTERM)
    if previous is None or previous == signal.SIG_IGN:
        yield
        return
    signal.signal(signal.SIGTERM, _raise_terminated)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def _raise_terminated(signum: int, frame: FrameType | None) -> None:
    raise Terminated


def choice(kind: str, value: str, valid: Sequence[str]) -> str:
    """``value`` if it is one of ``valid``; else a usage error that lists them and the
    closest match."""
    if value in valid:
        return value
    hint = closest(value, list(valid))
    raise UsageError(
        f"unknown {kind} {value!r}; valid: {', '.join(valid)}"
        + (f" (closest: {hint!r})" if hint else "")
    )


def policy_option(kind: str, value: str, extra: Sequence[str] = ()) -> None:
    """A preset name, or the ``params=...,compute=...,output=...`` string the library takes."""
    if "=" in value:
        try:
            Policy(value)
        except ValueError as err:
            raise UsageError(f"--{kind} {value!r}: {err}") from None
        return
    choice(kind, value, [*NAMES, *extra])


def output_file(option: str, path: str, suffix: str | None = None) -> str:
    """Check, before any work, that ``path`` can be written; return the path that will be
    (matplotlib adds ``.png`` to a name without a suffix). A directory, or a path that ends
    in a separator, is refused as it is given: ``DIR`` is not taken for ``DIR.png``. So is
    an empty path (not taken for "no output") and a device, pipe or socket, which the
    atomic write would replace with a regular file."""
    valid = f"a {suffix} file path" if suffix else "a file path"
    if not path:
        raise UsageError(f"{option} {path!r} is empty; give {valid}")
    target = Path(path)
    if target.is_dir() or path.endswith(("/", os.sep)):
        raise UsageError(f"{option} {path!r} is a directory; give {valid}")
    if suffix and not target.suffix:
        target = target.with_name(target.name + suffix)
    problem = in_the_way(target)
    if problem:
        shown = f"{option} {path!r}" + (f": {str(target)!r}" if str(target) != path else "")
        raise UsageError(f"{shown} {problem}; give {valid}")
    _check_parent(option, path, target.parent, valid)
    return str(target)


def in_the_way(path: Path) -> str | None:
    """What makes the existing ``path`` no file to write (``"is a directory"``, ``"is not a
    regular file ..."``); ``None`` where it is one, or does not exist."""
    if path.is_dir():
        return "is a directory"
    if path.exists() and not path.is_file():
        return "is not a regular file (a device, pipe or socket)"
    return None


def plot_file(option: str, path: str) -> str:
    """``output_file`` for a plot: also a suffix that matplotlib writes (``.png`` added to a
    name without one), checked before the work whose result it plots."""
    target = output_file(option, path, ".png")
    from matplotlib.backend_bases import FigureCanvasBase  # only when a plot is asked for

    formats = FigureCanvasBase.get_supported_filetypes()
    if Path(target).suffix[1:].lower() not in formats:
        raise UsageError(
            f"{option} {path!r}: matplotlib cannot write {Path(target).suffix!r} files; give "
            f"a .png file path (or {', '.join('.' + f for f in sorted(formats) if f != 'png')})"
        )
    return target


def output_dir(option: str, path: str) -> str:
    """Check that ``path`` is, or can be made, a writable directory; an empty path is
    refused, not taken for "no output" or the current directory."""
    if not path:
        raise UsageError(f"{option} {path!r} is empty; give a directory")
    target = Path(path)
    if target.exists() and not target.is_dir():
        raise UsageError(f"{option} {path!r} is an existing file; give a directory")
    parent = target
    while not parent.exists() and parent != parent.parent:
        parent = parent.parent
    _check_parent(option, path, parent)
    return path


def _check_parent(option: str, path: str, parent: Path, valid: str | None = None) -> None:
    """``parent`` is a directory this process can write in; else a usage error that names
    the option, its value, what is wrong and, where ``valid`` says it, what is valid."""
    if not parent.is_dir():
        what = "is not a directory" if parent.exists() else "does not exist"
        hint = f"; give {valid} in an existing directory" if valid else ""
        raise UsageError(f"{option} {path!r}: {str(parent)!r} {what}{hint}")
    if not os.access(parent, os.W_OK | os.X_OK):
        hint = f"; give {valid} in a writable directory" if valid else ""
        raise UsageError(
            f"{option} {path!r}: cannot write in {str(parent)!r} (permission denied){hint}"
        )


def float8_sizes(value: str | None) -> Float8Options | None:
    """``--float8-min-features``: ``None`` (each workload's rule), ``torchao`` (torchao's
    size thresholds) or N (both dims >= N)."""
    if value is None:
        return None
    if value == "torchao":
        return Float8Options()
    try:
        n = int(value)
    except ValueError:
        n = 0
    if n < 1:
        raise UsageError(f"--float8-min-features must be an int >= 1 or 'torchao', got {value!r}")
    return Float8Options(min_features=n)


def train_float8(value: str | None) -> Float8Options:
    """The float8 layer rule of `mixprec train` and `doctor`: ``--float8-min-features``, by
    default ``TRAIN_FLOAT8_MIN_FEATURES``."""
    return float8_sizes(value) or Float8Options(min_features=TRAIN_FLOAT8_MIN_FEATURES)


def float8_rule(options: Float8Options) -> str:
    """How ``options`` picks the Linear layers it converts, as the output's notes say it."""
    if options.min_features is None:
        return "torchao's H100 size thresholds"
    return f"both dims >= {options.min_features} (--float8-min-features)"
