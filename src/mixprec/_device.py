"""Resolving a ``device`` argument, one rule for the Trainer and the bench; which device
types have autocast."""

from __future__ import annotations

import torch


def resolve_device(device: str | torch.device) -> torch.device:
    """``"auto"``: CUDA where there is a GPU, else the CPU; anything else as ``torch.device``
    reads it."""
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


#: Device types with autocast, filled by ``autocast_available``'s first eager call for each.
#: A lookup, not the probe: dynamo before torch 2.13 cannot trace
#: ``torch._C._is_autocast_available`` and broke every region's graph on it.
AUTOCAST_DEVICES: dict[str, bool] = {"cpu": True, "cuda": True}


def autocast_available(device_type: str) -> bool:
    """Whether ``torch.autocast`` works on ``device_type``, asked of torch once per type."""
    known = AUTOCAST_DEVICES.get(device_type)
    if known is None:
        probe = getattr(torch.amp, "is_autocast_available", None)
        known = AUTOCAST_DEVICES[device_type] = bool(probe(device_type)) if probe else False
    return known
