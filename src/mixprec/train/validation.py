"""The data ``fit`` holds out to validate on: the last ``validation_split`` of the samples,
or ``validation_data`` as given (a pair of samples and targets)."""

from __future__ import annotations

import math
from typing import Any

from mixprec._errors import ArgumentError
from mixprec.train.batches import as_tensor
from mixprec.train.warn import warn

__all__ = ["split_validation"]


def split_validation(
    x: Any, y: Any, validation_split: float, validation_data: tuple[Any, Any] | None = None
) -> tuple[Any, Any, tuple[Any, Any] | None]:
    """``(x, y, validation_data)``: the last ``validation_split`` of the samples held out,
    before any shuffling (as Keras does); ``validation_data`` as given where there is no
    split. Given both, ``validation_data`` overrides the split (as in Keras), said in a
    warning."""
    if not 0.0 <= validation_split < 1.0:
        raise ArgumentError(f"validation_split={validation_split!r} is invalid; use [0, 1)")
    if validation_data is not None:
        if not isinstance(validation_data, (tuple, list)) or len(validation_data) != 2:
            got = (
                f"a {type(validation_data).__name__} of {len(validation_data)}"
                if isinstance(validation_data, (tuple, list))
                else f"a {type(validation_data).__name__}"
            )
            raise ArgumentError(
                f"validation_data must be a pair (x_val, y_val), got {got}; a loader of "
                "batches is not taken: evaluate it with trainer.evaluate(loader)"
            )
        if validation_split:
            warn(
                f"fit: validation_split={validation_split!r} is ignored: validation_data is "
                "given, and overrides it (as in Keras); every sample of x trains"
            )
        return x, y, validation_data
    if validation_split and y is None:
        raise ArgumentError("validation_split needs tensors or arrays (x, y), not a loader")
    if not validation_split:
        return x, y, None
    xt, yt = as_tensor(x, "x"), as_tensor(y, "y")
    if xt.dim() == 0 or yt.dim() == 0 or len(xt) != len(yt):
        raise ArgumentError(
            f"fit(x, y): x has {len(xt) if xt.dim() else 0} samples but y has "
            f"{len(yt) if yt.dim() else 0}; they must have one each"
        )
    # Keras' rule: the first floor(n * (1 - split)) samples train (int(n * split) held out
    # is one short where n * split is not exact in binary, e.g. 100 * 0.29).
    n = len(xt)
    cut = math.floor(n * (1.0 - validation_split))
    if cut == n or cut == 0:
        held, kept = n - cut, cut
        raise ArgumentError(
            f"validation_split={validation_split!r} of {n} samples holds out {held} and "
            f"trains on {kept}; each needs at least one sample (a larger or smaller split, or "
            "more data)"
        )
    return xt[:cut], yt[:cut], (xt[cut:], yt[cut:])
