"""Exception types shared by the numerics modules.

``torch.amp.GradScaler`` reports some misuse with ``AssertionError``; mixprec reports it with
``RuntimeError`` (misuse) or ``ValueError`` (bad argument) as the rest of the library does.
These classes derive from both, so code written against either convention keeps working when
``torch.amp.GradScaler`` is swapped for ``mixprec.GradScaler``.
"""

from __future__ import annotations


class MisuseError(RuntimeError, AssertionError):
    """A method was called in the wrong order or state (``RuntimeError``)."""


class ArgumentError(ValueError, AssertionError):
    """An argument has a value outside its valid range (``ValueError``)."""
