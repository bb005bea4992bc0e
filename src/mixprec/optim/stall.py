"""16-bit weights stepped in place (O3: no float32 masters) that stopped moving.

A bfloat16 weight keeps 8 bits: an update below half a unit in its last place (2**-9
relative) rounds away. With a small learning rate every update does, and training stalls
while every step reports itself applied: SGD at lr 1e-4 moved none of 676 weights in 2000
steps (float32 trained), and nothing was said.

The watch compares each such weight's norm (in float64) at the ``START``-th applied step
and ``WINDOW`` applied steps later (as the host knows them: a step decided on the device
is not counted), once: one
norm per weight at each end and one host read at the second. Weights without a gradient
then (frozen, unused) are left out. Said when none moved. Not inside ``torch.compile``.
"""

from __future__ import annotations

import torch

from mixprec._dtypes import HALF_DTYPES, dtype_name
from mixprec._warn import warn_at_caller

__all__ = ["StallWatch"]

START, WINDOW = 100, 100  # the first look after START applied steps (past a short
# warmup), the second WINDOW applied steps later


class StallWatch:
    """One look at whether the 16-bit weights an optimizer steps in place still move."""

    def __init__(self, params: list[torch.Tensor]) -> None:
        self.params = [p for p in params if p.dtype in HALF_DTYPES]
        self.calls = 0
        self.norms: torch.Tensor | None = None

    def after_step(self, applied: object) -> None:
        """After a step: ``applied`` is the result's (a step decided on the device, whose
        flag is not read yet, is not counted)."""
        if applied is not True or not self.params or torch.compiler.is_compiling():
            return
        self.calls += 1
        if self.calls == START:
            self.norms = self._norms()
        elif self.calls == START + WINDOW and self.norms is not None:
            self._compare(self.norms, self._norms())

    def _norms(self) -> torch.Tensor:
        """Each weight's norm accumulated in float64: one element moved by one unit in the
        last place changes it (a 16-bit norm missed thousands of moved elements)."""
        with torch.no_grad():
            norms = [
                torch.linalg.vector_norm(p.detach(), dtype=_wide(p.device)) for p in self.params
            ]
            graded = torch.tensor([p.grad is not None for p in self.params], device=norms[0].device)
            return torch.stack(norms).where(graded, float("nan"))

    def _compare(self, before: torch.Tensor, after: torch.Tensor) -> None:
        looked = ~(before.isnan() | after.isnan())
        still = int((before == after)[looked].sum())
        count = int(looked.sum())
        if count and still == count:
            dtype = dtype_name(self.params[0].dtype)
            warn_at_caller(
                f"none of the {count} {dtype} weights this optimizer updates in place (no "
                f"float32 masters: O3) changed over {WINDOW} applied steps: each update is "
                f"below half a unit in the last place of {dtype} and rounds away, so "
                "training has stalled while every step is applied (unless a warmup is still "
                "raising the learning rate). Use O2 (float32 master weights), "
                "mp.CompensatedAdamW (compensated or stochastic rounding), or a larger "
                "learning rate"
            )
        self.params = []  # looked once: nothing more to hold


def _wide(device: torch.device) -> torch.dtype:
    return torch.float32 if device.type == "mps" else torch.float64  # MPS has no float64
