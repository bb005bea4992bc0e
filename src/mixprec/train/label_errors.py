"""Which "out of bounds" errors of a training step are about its labels.

A loader's labels are first seen inside the loss, where torch's bounds check raises
(``nll_loss``: "Target 7 is out of bounds"; a gather: "index 7 is out of bounds for
dimension 1"). The Trainer names the epoch, the batch and the valid range for those. Any
other "out of bounds" (a model's own indexing: a position table too short for the batch)
passes as torch raised it: rewritten, it blamed labels that were all valid.
"""

from __future__ import annotations

import re
from typing import Any

import torch

__all__ = ["raise_if_about_labels"]

# F.cross_entropy's and mp.cross_entropy's own words: the labels, whatever their value.
_TARGET = re.compile(r"\b[Tt]arget -?\d+ is out of bounds")
# A gather's, or any indexing: the labels only where they hold that index, and it was
# out of bounds along a class dimension (a table's rows, dimension 0, are a model's own).
_INDEX = re.compile(r"\bindex (-?\d+) is out of bounds(?! for dimension 0\b)")


def raise_if_about_labels(err: BaseException, targets: Any, epoch: int, step: int) -> None:
    """Raise a ``ValueError`` naming the batch and the valid labels, from ``err``, where
    ``err`` is about the labels ``targets``; else return (``err`` goes on as it is)."""
    text = str(err)
    if not isinstance(err, (IndexError, RuntimeError)) or "out of bounds" not in text:
        return
    if not _TARGET.search(text):
        found = _INDEX.search(text)
        if not (
            found
            and isinstance(targets, torch.Tensor)
            and not targets.is_floating_point()
            and bool((targets == int(found.group(1))).any())
        ):
            return
    raise ValueError(
        f"epoch {epoch + 1}, batch {step + 1}: {err} (class labels must be in "
        "[0, number of classes), or the loss's ignore_index)"
    ) from err
