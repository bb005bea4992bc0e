"""One side of the case-by-case comparison in docs/benchmarks.md, in a process of its own.

Trains one case with mixprec's default (``default``: ``auto_mixed_precision`` +
``LossScaleOptimizer``) or with plain ``torch.autocast(bfloat16)`` and an ordinary
optimizer step (``autocast``), and prints the median ms a step over 5 blocks after 10
warm-up steps, and the minor page faults a step.
Run the two sides in turn, each in a fresh process, so that neither inherits the other's
allocator state (docs/benchmarks.md, "Page faults on CPU")::

    python benchmarks/peer_case.py default mlp8192-adamw
    python benchmarks/peer_case.py autocast mlp8192-adamw
"""

from __future__ import annotations

import argparse
import resource
import statistics
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

import mixprec as mp

CASES = ("mlp64-sgd", "mlp64-adamw", "mlp8192-adamw", "cnn-sgd")


def build(case: str) -> tuple[nn.Module, torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    if case.startswith("mlp"):
        batch = 8192 if case.startswith("mlp8192") else 64
        model: nn.Module = nn.Sequential(
            nn.Linear(784, 512), nn.ReLU(), nn.Linear(512, 512), nn.ReLU(), nn.Linear(512, 10)
        )
        return model, torch.randn(batch, 784), torch.randint(0, 10, (batch,))
    model = nn.Sequential(
        nn.Conv2d(3, 32, 3, padding=1), nn.BatchNorm2d(32), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(32, 64, 3, padding=1), nn.BatchNorm2d(64), nn.ReLU(), nn.MaxPool2d(2),
        nn.Flatten(), nn.Linear(64 * 8 * 8, 10),
    )  # fmt: skip
    return model, torch.randn(64, 3, 32, 32), torch.randint(0, 10, (64,))


def make_step(side: str, case: str, compiled: bool) -> Callable[[], None]:
    model, x, y = build(case)
    opt: torch.optim.Optimizer
    if case.endswith("sgd"):
        opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    else:
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    if side == "default":
        model = mp.auto_mixed_precision(model, policy="auto")
        lso = mp.LossScaleOptimizer(opt)
    forward = torch.compile(model) if compiled else model

    def mixprec_step() -> None:
        lso.backward(F.cross_entropy(forward(x), y))
        lso.step()
        lso.zero_grad()

    def autocast_step() -> None:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = F.cross_entropy(forward(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()

    return mixprec_step if side == "default" else autocast_step


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("side", choices=("default", "autocast"))
    parser.add_argument("case", choices=CASES)
    parser.add_argument("--compile", action="store_true", help="torch.compile the model")
    parser.add_argument("--steps", type=int, default=0, help="timed steps (default: by case)")
    parser.add_argument("--out", help="append the median ms a step to this file")
    args = parser.parse_args()
    step = make_step(args.side, args.case, args.compile)
    steps = args.steps or (60 if args.case.startswith("mlp8192") else 600)
    block = max(steps // 5, 1)
    for _ in range(10):
        step()
    times, faults = [], []
    for _ in range(5):
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        start = time.perf_counter()
        for _ in range(block):
            step()
        times.append(1000 * (time.perf_counter() - start) / block)
        faults.append((resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before) / block)
    ms = statistics.median(times)
    if args.out:
        with open(args.out, "a") as f:
            f.write(f"{ms:.3f}\n")
    mode = "compiled" if args.compile else "eager"
    print(f"{args.side} {args.case} {mode}: {ms:.2f} ms a step, "
          f"{statistics.median(faults):.0f} page faults a step")  # fmt: skip


if __name__ == "__main__":
    main()
