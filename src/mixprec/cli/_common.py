"""What every subcommand shares: the usage error, choice and output-path checks, and the
``--float8-min-features`` option.

Every check here runs before any work, so that a bad value costs the user one line and exit
status 2, not a training run that fails at its end.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

from mixprec._dtypes import closest
from mixprec.float8 import Float8Options
from mixprec.policy import NAMES, Policy

# float8 policies in `mixprec train`: torchao's H100 thresholds convert none of the small
# models' layers, so every Linear whose dims float8 takes is converted (the head stays).
TRAIN_FLOAT8_MIN_FEATURES = 16


class UsageError(Exception):
    """A bad command-line value: reported on one line, exit status 2."""


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
            raise UsageError(str(err)) from None
        return
    choice(kind, value, [*NAMES, *extra])


def output_file(option: str, path: str, suffix: str | None = None) -> str:
    """Check, before any work, that ``path`` can be written; return the path that will be
    (matplotlib adds ``.png`` to a name without a suffix)."""
    target = Path(path)
    if suffix and not target.suffix:
        target = target.with_name(target.name + suffix)
    if target.is_dir():
        raise UsageError(f"{option} {path!r} is a directory; give a file path")
    _check_parent(option, path, target.parent)
    return str(target)


def output_dir(option: str, path: str) -> str:
    """Check that ``path`` is, or can be made, a writable directory."""
    target = Path(path)
    if target.exists() and not target.is_dir():
        raise UsageError(f"{option} {path!r} is an existing file; give a directory")
    parent = target
    while not parent.exists() and parent != parent.parent:
        parent = parent.parent
    _check_parent(option, path, parent)
    return path


def _check_parent(option: str, path: str, parent: Path) -> None:
    if not parent.is_dir():
        what = "is not a directory" if parent.exists() else "does not exist"
        raise UsageError(f"{option} {path!r}: {str(parent)!r} {what}")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise UsageError(f"{option} {path!r}: cannot write in {str(parent)!r} (permission denied)")


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
