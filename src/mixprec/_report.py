"""What the two doctors (``doctor``, ``float8_doctor``) share: taking the float32 model
they diagnose, calling it on a batch (as the Trainer does), drawing the same random numbers
in every pass over it, and writing reports as JSON."""

from __future__ import annotations

import contextlib
import json
import math
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn

from mixprec.levels import applied


def call(model: nn.Module, inputs: Any) -> torch.Tensor:
    """``model(*inputs)`` for a tuple or list of inputs, else ``model(inputs)``."""
    return model(*inputs) if isinstance(inputs, (tuple, list)) else model(inputs)  # type: ignore[no-any-return]


@contextlib.contextmanager
def same_draws() -> Iterator[Callable[[], None]]:
    """Yields ``rewind``: a doctor calls it before each pass over the batch, so that every
    pass draws the same random numbers (dropout masks) and the runs compare like for like.
    On exit the generators are as the caller left them: a diagnosis does not change the
    training run that follows it. CUDA's are saved where CUDA is initialised already (a
    model or batch on a GPU has done it); initialising it only to save them would cost a
    CPU-only run a CUDA context."""
    cpu = torch.get_rng_state()
    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else None

    def rewind() -> None:
        torch.set_rng_state(cpu)
        if cuda is not None:
            torch.cuda.set_rng_state_all(cuda)

    try:
        yield rewind
    finally:
        rewind()


def float32_model(model: Any, who: str) -> nn.Module:
    """The float32 model behind ``model``: the module inside a ``torch.compile`` wrapper
    (the doctors' hooks run eagerly, with a warning); refused if already prepared."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"{who}(model=...) needs an nn.Module, got {type(model).__name__}")
    module: nn.Module = model
    original = getattr(module, "_orig_mod", None)  # torch.compile's OptimizedModule
    if isinstance(original, nn.Module):
        warnings.warn(
            f"{who} runs the model eagerly (its hooks do not compile): it uses the module "
            "inside torch.compile's wrapper; the figures are eager mode's",
            UserWarning,
            stacklevel=3,
        )
        module = original
    if applied(module) is not None:
        raise ValueError(f"{who} needs the float32 model, before auto_mixed_precision")
    return module


def _json_safe(value: Any) -> Any:
    """JSON has no inf/NaN: they become strings ("inf", "nan")."""
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, dict):
        return {k: _json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_json_safe(v) for v in value]
    return value


def to_json(data: dict[str, Any], **kwargs: Any) -> str:
    return json.dumps(_json_safe(data), **kwargs)
