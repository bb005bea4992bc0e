"""Exception types shared by the numerics modules.

``torch.amp.GradScaler`` reports some misuse with ``AssertionError``; mixprec reports it with
``RuntimeError`` (misuse) or ``ArgumentError`` (bad argument) as the rest of the library does.
These classes derive from both, so code written against either convention keeps working when
``torch.amp.GradScaler`` is swapped for ``mixprec.GradScaler``.
"""

from __future__ import annotations

import reprlib


class MisuseError(RuntimeError, AssertionError):
    """A method was called in the wrong order or state (``RuntimeError``)."""


class ArgumentError(ValueError, TypeError, AssertionError):
    """An argument has a value or a type that is not valid. One class for every bad argument,
    so that a caller catches them all alike; it is a ``ValueError`` and a ``TypeError`` both,
    so code that catches either built-in (the usual ``ValueError`` for a bad value,
    ``TypeError`` for a wrong type) keeps working."""


_SHORT = reprlib.Repr()
_SHORT.maxlevel, _SHORT.maxstring, _SHORT.maxother = 3, 40, 40
_SHORT.maxlist = _SHORT.maxdict = _SHORT.maxtuple = 4


def shown(value: object) -> str:
    """``repr(value)`` for an error message, bounded however long or deeply nested the value
    (a hostile checkpoint header's), or "an int of N digits" for an int too long to echo
    (``10**400``, which also overflows float)."""
    if isinstance(value, int) and not isinstance(value, bool) and abs(value) >= 10**40:
        return f"an int of {len(str(abs(value)))} digits"
    text = _SHORT.repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def is_number(value: object) -> bool:
    """A real number (numpy's too), not a bool: ``True`` is no learning rate or scale."""
    import numbers

    return not isinstance(value, bool) and isinstance(value, numbers.Real)


def check_int(name: str, value: object, minimum: int, optional: bool = False) -> None:
    """Raise ``ArgumentError`` unless ``value`` is an int (not a bool) >= ``minimum`` (or,
    ``optional``, None), naming ``name``, the value received and what is valid."""
    if optional and value is None:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ArgumentError(
            f"{name}={shown(value)} is invalid; it must be an int >= {minimum}"
            + " or None" * optional
        )


def check_stream(who: str, name: str, value: object) -> None:
    """Raise ``ArgumentError`` unless ``value`` is None or has ``write`` and ``flush`` (a
    text stream): ``stream="stdout"`` failed at the first line written, mid-``fit``."""
    if value is not None and not all(
        callable(getattr(value, method, None)) for method in ("write", "flush")
    ):
        raise ArgumentError(
            f"{who}({name}={shown(value)}) is invalid; valid: a text stream (with write and "
            "flush) such as sys.stdout, or None"
        )


def check_path(who: str, name: str, value: object, kind: str) -> None:
    """Raise ``ArgumentError`` unless ``value`` is a str or ``os.PathLike`` (``None`` made
    a folder named "None"), and, for ``kind="folder"``, not an existing file; for
    ``kind="file"``, not an existing folder."""
    import os

    if not isinstance(value, (str, os.PathLike)) or isinstance(value, bytes):
        raise ArgumentError(
            f"{who}({name}={shown(value)}) is invalid; valid: a {kind} path (a str or a Path)"
        )
    if os.path.isfile(value) if kind == "folder" else os.path.isdir(value):
        other = "file" if kind == "folder" else "folder"
        raise ArgumentError(f"{who}({name}={str(value)!r}) is a {other}; valid: a {kind} path")


def check_module(who: str, model: object) -> None:
    """Raise ``ArgumentError`` unless ``model`` is an ``nn.Module``, naming ``who``: a state
    dict or ``None`` failed deep inside, as an ``AttributeError``."""
    from torch import nn  # torch is imported by every caller already

    if not isinstance(model, nn.Module):
        raise ArgumentError(f"{who}(model=...) needs an nn.Module, got {type(model).__name__}")
