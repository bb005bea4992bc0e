"""Warnings from training that point at the user's line.

A warning from deep inside ``Trainer.fit`` (an empty batch, a loss scale that collapsed) is
about the user's call, so its location is the first frame outside the mixprec package,
however many of mixprec's own frames lie between (``train`` calls ``fit``, a callback calls
``evaluate``). ``mixprec._warn`` finds that frame; ``warn`` is its name inside ``train``.
"""

from __future__ import annotations

from mixprec._warn import warn_at_caller as warn

__all__ = ["warn"]
