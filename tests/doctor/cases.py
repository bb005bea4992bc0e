"""The models and batches the 16-bit doctor tests diagnose: one that overflows float16 in
the forward, healthy ones, and issue 15 item 4's model whose float32-kept block sends
gradients ``gain`` times larger back into the 16-bit layers before it."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import nn

import mixprec as mp

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
