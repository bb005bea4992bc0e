"""The models and batches the 16-bit doctor tests diagnose: one that overflows float16 in
the forward, healthy ones, issue 15 item 4's model whose float32-kept block sends
gradients ``gain`` times larger back into the 16-bit layers before it (issue 31's model at
gain 1e5, with its draws), the bench's MLP with a blow-up injected, and one whose saturated
head's gradients no float16 loss scale fits."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn

import mixprec as mp
from mixprec.doctor.report import ModuleReport

CE = nn.functional.cross_entropy


@contextmanager
def single_thread() -> Iterator[None]:
    """Torch on one thread inside the block, as many as before after it."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


class Scale(nn.Module):
    def __init__(self, factor: float) -> None:
        super().__init__()
        self.factor = factor

    def forward(self, x):
        return x * self.factor


def overflowing(seed: int = 0) -> nn.Module:
    """Multiplies by 1e5 right before a float16 matmul."""
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Linear(16, 32), nn.ReLU(), Scale(1e5), nn.Linear(32, 32), nn.LayerNorm(32),
        nn.ReLU(), nn.Linear(32, 4),
    )  # fmt: skip


def healthy(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 64), nn.LayerNorm(64), nn.ReLU(),
        nn.Linear(64, 4),
    )  # fmt: skip


class Blow(nn.Module):
    """Issue 15 item 4's block input: multiplies by ``gain``."""

    def __init__(self, gain: float) -> None:
        super().__init__()
        self.gain = gain

    def forward(self, x):
        return x * self.gain


def gained(gain: float, seed: int = 0) -> nn.Module:
    """Issue 15 item 4's model: a float32-kept block's gain sends gradients ``gain`` times
    larger back into the 16-bit Linear and ReLU before it."""
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Linear(32, 64), nn.ReLU(), nn.Sequential(Blow(gain), nn.Linear(64, 64)), nn.ReLU(),
        nn.Linear(64, 4),
    )  # fmt: skip


def saturated_head() -> tuple[nn.Module, torch.Tensor, torch.Tensor]:
    """A 16-32-32-4 MLP whose last Linear is x300, and its batch of 16 (the report's
    reproducer): the saturated softmax's gradients, ~1e-13 and below, flush in float16 at
    the head, and the backward's largest (26.5, in '2') back the scale off to 2048, at which
    the small gradients before the head flush too."""
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 4)
    )  # fmt: skip
    with torch.no_grad():
        model[4].weight.mul_(300)
    return model, torch.randn(16, 16), torch.randint(0, 4, (16,))


def wide_batch(seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(64, 32, generator=g), torch.randint(0, 4, (64,), generator=g)


def batch(seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(64, 16, generator=g), torch.randint(0, 4, (64,), generator=g)


def train_applied(model: nn.Module, x, y, scaler=None, steps: int = 30):
    """Adam (float32 training of these models converges; SGD at lr 0.05 diverges to NaN in
    float32 by step 3 whatever the precision): the applied flag of each step, and losses."""
    opt = mp.LossScaleOptimizer(torch.optim.Adam(model.parameters(), lr=1e-3), loss_scaler=scaler)
    flags, losses = [], []
    for _ in range(steps):
        opt.zero_grad()
        loss = CE(model(x), y)
        opt.backward(loss)
        flags.append(opt.step().applied)
        losses.append(loss.item())
    return flags, losses


def issue_batch(seed: int):
    """Issue 31's batch for ``gained(1e5)``: 16 standard normal rows of 32, 4 classes."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(16, 32, generator=g), torch.randint(0, 4, (16,), generator=g)


# Draws of ``issue_batch`` for ``gained(1e5)``. 166-1996: the block's largest output lands
# 0.3-6.5% below float16's max (every seed of 0-1999 whose largest output fell between
# 4.5e4 and 65504); 1: the issue's case, an
# output beyond the max that the ReLU after the block brings back to 6.45e4 (98%); 0 and 2
# ordinary. The step-0 plan (no headroom, no check) applied 1, 22, 15, 7, 4 and 5 of 30
# steps on 1, 166, 483, 1855, 1908 and 1996, with a non-finite forward at the end.
ISSUE_DRAWS = (0, 1, 2, 166, 435, 483, 1155, 1855, 1908, 1996)


def injected_mlp(seed: int = 0) -> nn.Module:
    """The bench's MLP (``mixprec.models.mlp``, 32 -> 64 -> 64 -> 10) with a blow-up injected
    before its hidden Linear: x 1e5, as a layer in raw units would."""
    torch.manual_seed(seed)
    model = mp.models.mlp(32, hidden=64, depth=2, classes=10)
    model[3] = nn.Sequential(Scale(1e5), model[3])
    return model


def follow(report, model: nn.Module, x, y, loss_fn=CE, steps: int = 30) -> tuple[int, bool]:
    """Apply ``report``'s plan as issue 31's user does (its keep list at O2, a
    ``DynamicLossScaler`` started at ``loss_scale_reached``, Adam lr 1e-3) and train
    ``steps`` steps on the batch: the steps applied, and whether the forward after them is
    finite."""
    model = mp.auto_mixed_precision(
        model, "mixed_float16", "O2", keep_float32=report.recommended_keep_float32
    )
    scaler = mp.DynamicLossScaler(init_scale=report.loss_scale_reached)
    opt = mp.LossScaleOptimizer(torch.optim.Adam(model.parameters(), lr=1e-3), loss_scaler=scaler)
    opt.health = None  # a failing plan is what some tests show: no warning about it
    applied = 0
    for _ in range(steps):
        opt.zero_grad()
        opt.backward(loss_fn(model(x), y))
        applied += opt.step().applied
    with torch.no_grad():
        return applied, bool(torch.isfinite(model(x)).all())


def module(name: str, order: int, **figures: Any) -> ModuleReport:
    """A float16 module with unremarkable figures, but for ``figures``."""
    values: dict[str, Any] = {
        "kind": "Linear", "dtype": "float16", "max_input": 1.0, "max_output": 1.0,
        "max_grad": 1e-3, "max_output_mixed": 1.0, "max_grad_mixed": 1e-3,
        "nonfinite_output": 0, "nonfinite_grad": 0, "nonfinite_input": 0,
        "output_underflow": 0.0, "output_subnormal": 0.0, "grad_underflow": 0.0,
        "grad_subnormal": 0.0, "output_rel_error": 1e-4, "grad_rel_error": 1e-3,
        "float32": False, "grad_dtype": "float16", "min_grad": 1e-6,
    }  # fmt: skip
    values.update(figures)
    return ModuleReport(name=name, order=order, **values)
