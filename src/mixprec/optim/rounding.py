"""Whether a 16-bit weight is still its float32 master's rounding, or was written since.

Compared in the weight's 16-bit dtype (``narrower``), with a tolerance of two units in the
last place for a weight read back in float32 (``moved``).
"""

from __future__ import annotations

import torch

__all__ = ["moved", "narrower"]


def narrower(now: torch.dtype, stored: torch.dtype) -> torch.dtype:
    """The dtype a weight is compared with its master in: its 16-bit one even when widened
    since (``model.float()``), whose float32 values are still the rounding. Compared in
    float32, every master took its own rounding (2.4e-4 off in bfloat16, no update made)."""
    return stored if now.itemsize > stored.itemsize else now


def moved(weight: torch.Tensor, master: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Where a weight (read in float32) is further from its master than ``dtype``'s
    rounding of it: written since, not rounded (a float16 weight past 65504 is inf beside
    its finite master: no write)."""
    ulp, tiny = torch.finfo(dtype).eps, torch.finfo(dtype).tiny
    return ((weight - master).abs() > 2 * ulp * master.abs() + tiny) & torch.isfinite(weight)
