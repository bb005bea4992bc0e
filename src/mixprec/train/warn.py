"""Warnings that point at the user's line.

A warning from deep inside ``Trainer.fit`` (an empty batch, a loss scale that collapsed) is
about the user's call, so its location is the first frame outside the mixprec package,
however many of mixprec's own frames lie between (``train`` calls ``fit``, a callback calls
``evaluate``). A fixed ``stacklevel`` would name ``trainer.py`` whenever that depth changes.
"""

from __future__ import annotations

import os
import sys
import warnings

__all__ = ["warn"]

#: The mixprec package's folder, with a trailing separator (``mixprec_extra/`` is not in it).
_PACKAGE = os.path.dirname(os.path.dirname(os.path.realpath(__file__))) + os.sep


def _in_package(filename: str) -> bool:
    # "<stdin>" or "<string>" resolve to no file of the package.
    return os.path.realpath(filename).startswith(_PACKAGE)


def warn(message: str, category: type[Warning] = UserWarning) -> None:
    """``warnings.warn(message, category)`` located at the first caller outside mixprec."""
    level = 2  # 1 is this function, 2 its caller
    frame = sys._getframe(1)
    while frame.f_back is not None and _in_package(frame.f_code.co_filename):
        frame = frame.f_back
        level += 1
    warnings.warn(message, category, stacklevel=level)
