"""Warnings located at the user's line: the first frame outside the mixprec package (and
torch's ``Module.__call__``, through which a model's forward is reached).

A warning raised deep inside mixprec (``Trainer.fit`` -> the train step -> ``levels``) is
about the user's call, however many of mixprec's own frames lie between. A fixed
``stacklevel`` names a mixprec file whenever that depth changes, so the level is counted
here, frame by frame, for every subpackage to share.
"""

from __future__ import annotations

import os
import sys
import warnings

import torch.nn.modules.module

__all__ = ["caller_stacklevel", "warn_at_caller"]

#: The mixprec package's folder, with a trailing separator (``mixprec_extra/`` is not in it).
_PACKAGE = os.path.dirname(os.path.realpath(__file__)) + os.sep


#: torch's ``Module.__call__`` machinery: a warning from a region's forward is about the
#: user's ``model(x)`` line above it, not about torch's file.
_MODULE_CALL = os.path.realpath(torch.nn.modules.module.__file__)


#: torch's dynamo: the eager part of a compiled function (``torch.compile(opt.step)``) runs
#: beneath its frames, and a warning there is about the caller of the compiled function.
#: (Its folder by path: importing dynamo costs most of a second, so it is not imported here.)
_TORCH = os.path.dirname(os.path.realpath(torch.__file__))
_DYNAMO = os.path.join(_TORCH, "_dynamo") + os.sep
#: torch's module call, the wrapper of a function run eagerly (torch._disable_dynamo), the
#: wrappers of an optimizer's step (its hooks; a learning-rate scheduler's count), and the
#: backward's calls into the engine (a hook of mixprec's runs beneath the user's backward).
_TORCH_CALLS = {
    _MODULE_CALL,
    os.path.join(_TORCH, "_compile.py"),
    os.path.join(_TORCH, "optim", "optimizer.py"),
    os.path.join(_TORCH, "optim", "lr_scheduler.py"),
    os.path.join(_TORCH, "_tensor.py"),
    os.path.join(_TORCH, "autograd", "__init__.py"),
    os.path.join(_TORCH, "autograd", "graph.py"),
}


def _in_package(filename: str) -> bool:
    # "<stdin>" or "<string>" resolve to no file of the package.
    path = os.path.realpath(filename)
    return path.startswith(_PACKAGE) or path in _TORCH_CALLS or path.startswith(_DYNAMO)


def caller_stacklevel() -> int:
    """The ``stacklevel`` that locates a ``warnings.warn`` made by the function calling this
    one at the first frame outside mixprec (level 1 is that function, 2 its caller, ...)."""
    level, frame = 1, sys._getframe(1)
    while frame.f_back is not None and _in_package(frame.f_code.co_filename):
        frame = frame.f_back
        level += 1
    return level


def warn_at_caller(message: str, category: type[Warning] = UserWarning) -> None:
    """``warnings.warn(message, category)`` located at the first caller outside mixprec."""
    warnings.warn(message, category, stacklevel=caller_stacklevel())
