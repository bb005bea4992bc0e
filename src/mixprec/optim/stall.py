"""16-bit weights stepped in place (O3: no float32 masters) that stopped moving.

A bfloat16 weight keeps 8 bits: an update below half a unit in its last place (2**-9
relative) rounds away. With a small learning rate every update does, and training stalls
while every step reports itself applied: SGD at lr 1e-4 moved none of 676 weights in 2000
steps (float32 trained), and nothing was said.

The watch compares up to ``SAMPLE`` values of each such weight, spread over it, at the
``START``-th applied step and ``WINDOW`` applied steps later (as the host knows them: a
step decided on the device is not counted), once: one strided copy per weight at each
end and one host read at the second. Weights without a gradient then (frozen, unused)
are left out. Said when fewer than ``MOVED`` of the values changed: a bfloat16
fine-tuning at lr 1e-5 moved 4.3% of its elements (a few near-zero biases), and a watch
of each weight's norm, which those kept changing, said nothing. Not inside
``torch.compile``.
"""

from __future__ import annotations

import torch

from mixprec._dtypes import HALF_DTYPES, dtype_name
from mixprec._warn import warn_at_caller

__all__ = ["StallWatch"]

START, WINDOW = 100, 100  # the first look after START applied steps (past a short
# warmup), the second WINDOW applied steps later
SAMPLE = 4096  # values of each weight compared, spread over it
MOVED = 0.1  # said when fewer of the sampled values than this share changed


class StallWatch:
    """One look at whether the 16-bit weights an optimizer steps in place still move."""

    def __init__(self, params: list[torch.Tensor]) -> None:
        self.params = [p for p in params if p.dtype in HALF_DTYPES]
        self.calls = 0
        self.samples: list[torch.Tensor | None] | None = None
        self.touched: list[torch.Tensor | None] = []  # where the gradient was not 0

    def after_step(self, applied: object) -> None:
        """After a step: ``applied`` is the result's (a step decided on the device, whose
        flag is not read yet, is not counted)."""
        if applied is not True or not self.params or torch.compiler.is_compiling():
            return
        self.calls += 1
        if self.calls == START:
            self.touched = self._touched()
            self.samples = self._sample()
        elif self.calls == START + WINDOW and self.samples is not None:
            self._compare(self.samples, self._sample())

    def _positions(self, t: torch.Tensor) -> torch.Tensor:
        """Up to ``SAMPLE`` values of ``t`` (a weight or its gradient), spread over it."""
        return t.reshape(-1)[:: max(1, t.numel() // SAMPLE)][:SAMPLE]

    def _touched(self) -> list[torch.Tensor | None]:
        """Where each weight's gradient is not 0 now, at the sampled positions (None: no
        gradient, frozen or unused). An embedding table's rows no batch touched do not
        move in float32 either."""
        grads = [p.grad for p in self.params]
        return [
            None if g is None else self._positions(g.to_dense() if g.is_sparse else g) != 0
            for g in grads
        ]

    def _sample(self) -> list[torch.Tensor | None]:
        """The sampled values of each weight where its gradient was not 0 at the first
        look. Values, not norms: a few near-zero elements (biases) always move, so a
        fine-tuning where 4% of the elements moved kept every norm changing."""
        with torch.no_grad():
            return [
                None if mask is None else self._positions(p.detach())[mask].clone()
                for p, mask in zip(self.params, self.touched, strict=True)
            ]

    def _compare(self, before: list[torch.Tensor | None], after: list[torch.Tensor | None]) -> None:
        pairs = [
            (a, b) for a, b in zip(before, after, strict=True) if a is not None and b is not None
        ]
        total = sum(a.numel() for a, _ in pairs)
        if total:
            moved = int(torch.stack([(a != b).sum() for a, b in pairs]).sum())  # one read
            if moved < MOVED * total:
                dtype = dtype_name(self.params[0].dtype)
                warn_at_caller(
                    f"{moved / total:.1%} of the values of the {len(pairs)} {dtype} weights "
                    f"this optimizer updates in place (no float32 masters: O3) changed over "
                    f"{WINDOW} applied steps: most updates are below half a unit in the last "
                    f"place of {dtype} and round away, so training has stalled while every "
                    "step is applied (unless a warmup is still raising the learning rate). "
                    "Use O2 (float32 master weights), mp.CompensatedAdamW (compensated or "
                    "stochastic rounding), or a larger learning rate"
                )
        self.params = []  # looked once: nothing more to hold
