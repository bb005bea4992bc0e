"""Calling a model on a batch, one rule for the Trainer and the doctors."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn


def call(model: nn.Module, inputs: Any) -> torch.Tensor:
    """``model(*inputs)`` for a tuple or list of inputs, else ``model(inputs)``."""
    return model(*inputs) if isinstance(inputs, (tuple, list)) else model(inputs)  # type: ignore[no-any-return]
