"""Resolving a ``device`` argument, one rule for the Trainer and the bench."""

from __future__ import annotations

import torch


def resolve_device(device: str | torch.device) -> torch.device:
    """``"auto"``: CUDA where there is a GPU, else the CPU; anything else as ``torch.device``
    reads it."""
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)
