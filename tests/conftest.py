"""Shared fixtures: small reference models and a deterministic float32 control loop."""

from __future__ import annotations

import copy
import os
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from torch import nn

import mixprec as mp
from mixprec import _averaged_copies
from mixprec.float8 import cpu_kernel_error

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(autouse=True)
def _reset_global_policy():
    """Tests may set the global policy; never let it leak into the next test. Nor the
    copies of one test's models watched for averages kept by hand (a later test's
    compiled step would break its graph to look at them)."""
    mp.set_global_policy(None)
    _averaged_copies.WATCHED.clear()
    yield
    mp.set_global_policy(None)


def subprocess_env(torchrun: bool = False) -> dict[str, str]:
    """The environment of a test's child process: the repository importable ahead of what
    ``PYTHONPATH`` already holds (a source checkout there stays importable). ``torchrun``:
    one thread a rank and the GPUs hidden, as these tests run two ranks on gloo and the CPU
    (under NCCL each rank needs a GPU of its own)."""
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)
    env = {**os.environ, "PYTHONPATH": path}
    if torchrun:
        env.update(OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="")
    return env


class Interrupt(mp.Callback):
    """Stops a run (as a crash would) after applied step ``after``: raised on every rank
    alike under torchrun, each rank counting the same applied steps."""

    def __init__(self, after: int) -> None:
        self.after = after

    def on_train_batch_end(self, step: int, logs: dict) -> None:
        if logs["applied"] and logs["global_step"] == self.after:
            raise KeyboardInterrupt


def make_mlp(seed: int = 0, d_in: int = 32, hidden: int = 64, classes: int = 10) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Linear(d_in, hidden),
        nn.ReLU(),
        nn.Linear(hidden, hidden),
        nn.LayerNorm(hidden),
        nn.ReLU(),
        nn.Linear(hidden, classes),
    )


class TinyTransformer(nn.Module):
    """Token embedding + 2 encoder layers + head: integer inputs and a padding mask."""

    def __init__(self, vocab: int = 50, d: int = 32, classes: int = 4) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        self.pos = nn.Parameter(torch.randn(16, d) * 0.02)
        layer = nn.TransformerEncoderLayer(
            d, nhead=4, dim_feedforward=64, dropout=0.0, batch_first=True
        )
        self.encoder = nn.TransformerEncoder(layer, num_layers=2, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(d)
        self.head = nn.Linear(d, classes)

    def forward(self, tokens: torch.Tensor, pad_mask: torch.Tensor | None = None) -> torch.Tensor:
        h = self.embed(tokens) + self.pos[: tokens.shape[1]]
        h = self.encoder(h, src_key_padding_mask=pad_mask)
        return self.head(self.norm(h).mean(dim=1))


def make_transformer(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return TinyTransformer()


class TiedLM(nn.Module):
    """An embedding and a head tied by assignment (``head.weight = emb.weight``)."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(50, 16)
        self.head = nn.Linear(16, 50, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.emb(x))


def classification_data(n: int = 512, d_in: int = 32, classes: int = 10, seed: int = 1):
    """A learnable task: labels from a fixed random linear teacher."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, d_in, generator=g)
    teacher = torch.randn(d_in, classes, generator=g)
    return x, (x @ teacher).argmax(dim=1)


def token_data(n: int = 256, length: int = 12, vocab: int = 50, classes: int = 4, seed: int = 2):
    """Label = (count of tokens < vocab/2) mod classes: needs attention over the sequence."""
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, vocab, (n, length), generator=g)
    y = (tokens < vocab // 2).sum(dim=1) % classes
    return tokens, y


def train(
    model: nn.Module,
    opt_step: Callable[[torch.Tensor], object],
    batches: list[tuple[tuple[torch.Tensor, ...], torch.Tensor]],
) -> list[float]:
    """Run one pass over ``batches``; ``opt_step(loss)`` does backward + step."""
    losses = []
    for inputs, y in batches:
        loss = nn.functional.cross_entropy(model(*inputs), y)
        losses.append(loss.item())
        opt_step(loss)
    return losses


def batches_of(inputs: tuple[torch.Tensor, ...], y: torch.Tensor, size: int, epochs: int):
    out = []
    g = torch.Generator().manual_seed(3)
    for _ in range(epochs):
        order = torch.randperm(len(y), generator=g)
        for i in range(0, len(y), size):
            idx = order[i : i + size]
            out.append((tuple(t[idx] for t in inputs), y[idx]))
    return out


def float32_losses(model: nn.Module, batches, lr: float = 3e-3) -> list[float]:
    """The control run: plain PyTorch, float32, AdamW."""
    model = copy.deepcopy(model)
    opt = torch.optim.AdamW(model.parameters(), lr=lr)

    def step(loss: torch.Tensor) -> None:
        opt.zero_grad()
        loss.backward()
        opt.step()

    return train(model, step, batches)


def mixed_losses(model: nn.Module, batches, policy: str, level: str, lr: float = 3e-3):
    model = mp.auto_mixed_precision(copy.deepcopy(model), policy=policy, level=level)
    opt = mp.LossScaleOptimizer(torch.optim.AdamW(model.parameters(), lr=lr))
    results = []

    def step(loss: torch.Tensor) -> None:
        opt.zero_grad()
        opt.backward(loss)
        results.append(opt.step())

    return train(model, step, batches), results, model, opt


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Skip, with torch's reason, the tests marked ``float8`` (they run float8 matmuls on CPU
    tensors, on a machine with a GPU too) where this CPU has no float8 matmul, and those
    marked ``float8_rowwise`` also where it takes per-tensor scales only."""
    rowwise = [i for i in items if i.get_closest_marker("float8_rowwise") is not None]
    tensorwise = [i for i in items if i.get_closest_marker("float8") is not None] + rowwise
    for marked, kind in ((tensorwise, "float8"), (rowwise, "rowwise float8")):
        why = cpu_kernel_error(rowwise=marked is rowwise) if marked else None
        if why is not None:
            skip = pytest.mark.skip(reason=f"no {kind} matmul on this CPU: torch._scaled_mm: {why}")
            for item in marked:
                item.add_marker(skip)
            return


def interrupt_copy_back(monkeypatch, opt, at: int) -> None:
    """Ctrl-C in the ``at``-th copy of ``opt``'s float32 masters into the 16-bit weights:
    after the inner optimizer stepped them (a LossScaleOptimizer, or a Trainer's)."""
    half, real, seen = opt._weights.half, torch._foreach_copy_, [0]

    def copy_(dst, src, *args, **kwargs):
        if len(dst) and dst[0] is half[0]:
            seen[0] += 1
            if seen[0] == at:
                raise KeyboardInterrupt
        return real(dst, src, *args, **kwargs)

    monkeypatch.setattr(torch, "_foreach_copy_", copy_)
