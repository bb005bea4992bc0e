"""Resolving a ``device`` argument, one rule for the Trainer and the bench; which device
types have autocast."""

from __future__ import annotations

import torch

from mixprec._errors import ArgumentError


def resolve_device(device: str | torch.device) -> torch.device:
    """``"auto"``: the current CUDA device where there is a GPU (under torchrun, the rank's
    own once the process group is set up), else the CPU; anything else as
    ``torch.device`` reads it."""
    if device == "auto":
        if torch.cuda.is_available():
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")
    try:
        return torch.device(device)
    except (RuntimeError, TypeError):  # torch's error lists its device types, not the argument
        raise ArgumentError(
            f"device={device!r} is invalid; valid: 'auto', 'cpu', 'cuda', 'cuda:N' or a "
            "torch.device"
        ) from None


def _ask_torch(device_type: str) -> bool:
    try:
        return bool(torch.amp.is_autocast_available(device_type))  # torch >= 2.4
    except RuntimeError:  # a device type this torch does not know
        return False


#: Device types with autocast, asked of torch at import for every type it names (so that
#: nothing is asked inside compiled code), and for any other type at its first eager use.
#: A lookup, not the probe: dynamo before torch 2.13 cannot trace
#: ``torch._C._is_autocast_available`` and broke every region's graph on it.
AUTOCAST_DEVICES: dict[str, bool] = {
    name: _ask_torch(name)
    for name in (
        "cpu", "cuda", "xpu", "mps", "hpu", "xla", "mtia", "ipu",
        torch._C._get_privateuse1_backend_name(),
    )
}  # fmt: skip


def autocast_available(device_type: str) -> bool:
    """Whether ``torch.autocast`` works on ``device_type``, asked of torch once per type."""
    known = AUTOCAST_DEVICES.get(device_type)
    if known is None:
        known = AUTOCAST_DEVICES[device_type] = _ask_torch(device_type)
    return known
