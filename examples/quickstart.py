"""Quickstart: train an MLP on scikit-learn's digits in float32 and in mixed precision.

    python examples/quickstart.py --policy mixed_float16 --level O2

Both runs start from the same weights and see the same batches in the same order, so the
difference in the comparison table is the precision alone.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from sklearn.datasets import load_digits
from torch import nn

import mixprec as mp
from mixprec.levels import applied

Data = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]


def load_data(seed: int) -> Data:
    """1797 8x8 digits, pixels scaled to [0, 1], a fixed 80/20 split."""
    digits = load_digits()
    x = torch.tensor(digits.data, dtype=torch.float32) / 16.0
    y = torch.tensor(digits.target, dtype=torch.long)
    order = torch.randperm(len(x), generator=torch.Generator().manual_seed(seed))
    cut = int(0.8 * len(x))
    train, test = order[:cut], order[cut:]
    return x[train], y[train], x[test], y[test]


def make_model(hidden: int, seed: int) -> nn.Module:
    torch.manual_seed(seed)  # the same initial weights for both runs
    return nn.Sequential(
        nn.Linear(64, hidden),
        nn.ReLU(),
        nn.Linear(hidden, hidden),
        nn.ReLU(),
        nn.Linear(hidden, 10),
    )


def train(
    model: nn.Module,
    step: Callable[[torch.Tensor, torch.Tensor], float],
    data: Data,
    args: argparse.Namespace,
) -> dict[str, float]:
    """Run ``step`` over shuffled batches; return final loss, test accuracy and ms/step."""
    x_train, y_train, x_test, y_test = data
    shuffle = torch.Generator().manual_seed(args.seed)  # the same batch order in both runs
    times: list[float] = []
    losses: list[float] = []
    for _ in range(args.epochs):
        model.train()
        losses = []  # keep the last epoch's losses only
        for idx in torch.randperm(len(x_train), generator=shuffle).split(args.batch_size):
            start = time.perf_counter()
            losses.append(step(x_train[idx], y_train[idx]))
            times.append(time.perf_counter() - start)
    model.eval()
    with torch.no_grad():
        accuracy = (model(x_test).argmax(dim=1) == y_test).float().mean().item()
    return {
        "final_loss": statistics.fmean(losses),
        "test_accuracy": accuracy,
        "ms_per_step": 1000 * statistics.median(times),  # the median ignores warm-up steps
    }


def run_float32(data: Data, args: argparse.Namespace) -> dict[str, Any]:
    """The baseline: plain PyTorch, no mixprec."""
    model = make_model(args.hidden, args.seed)
    # fused=True: the kernel LossScaleOptimizer gives the mixed run's AdamW; torch's default
    # on CPU is a per-parameter loop, which made the baseline twice as slow at --hidden 1024.
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, fused=True)

    def step(x: torch.Tensor, y: torch.Tensor) -> float:
        opt.zero_grad()
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        nn.utils.clip_grad_norm_(model.parameters(), 1.0)  # as the mixed run's max_grad_norm
        opt.step()
        return loss.item()

    figures = train(model, step, data, args)
    return {"policy": "float32/O0", **figures, "skipped_steps": 0, "loss_scale": 1.0}


def run_mixed(data: Data, args: argparse.Namespace) -> dict[str, Any]:
    """The same model, init and batches under mixprec's ``policy`` and ``level``."""
    model = mp.auto_mixed_precision(make_model(args.hidden, args.seed), args.policy, args.level)
    # Built after auto_mixed_precision so that it adopts the 16-bit weights and keeps float32
    # masters of them; float16 policies get a dynamic loss scaler here.
    opt = mp.LossScaleOptimizer(
        torch.optim.AdamW(model.parameters(), lr=args.lr), max_grad_norm=1.0
    )

    def step(x: torch.Tensor, y: torch.Tensor) -> float:
        opt.zero_grad()
        loss = F.cross_entropy(model(x), y)  # outputs come back float32
        opt.backward(loss)
        opt.step()  # skips the update (and lowers the scale) when gradients overflowed
        return loss.item()

    figures = train(model, step, data, args)
    print(mp.describe(model), end="\n\n")
    state = opt.loss_scaler.state
    done = applied(model)  # the policy and level that "auto" resolved to
    label = f"{done.policy.name}/{done.level}" if done else f"{args.policy}/{args.level}"
    return {
        "policy": label,
        **figures,
        "skipped_steps": state.skipped_steps,
        "loss_scale": state.scale,
    }


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description="Digits MLP: float32 vs mixed precision.")
    parser.add_argument("--policy", default="mixed_bfloat16")
    parser.add_argument("--level", default="auto")
    parser.add_argument("--epochs", type=int, default=20)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--hidden", type=int, default=256)
    args = parser.parse_args(argv)

    data = load_data(args.seed)
    baseline, mixed = run_float32(data, args), run_mixed(data, args)

    header = f"{'run':<22} {'test acc':>8} {'loss':>7} {'ms/step':>8} {'skipped':>7} {'scale':>8}"
    print(header)
    print("-" * len(header))
    for r in (baseline, mixed):
        print(
            f"{r['policy']:<22} {r['test_accuracy']:>8.3f} {r['final_loss']:>7.4f} "
            f"{r['ms_per_step']:>8.2f} {r['skipped_steps']:>7d} {r['loss_scale']:>8g}"
        )
    diff = mixed["test_accuracy"] - baseline["test_accuracy"]
    print(
        f"\naccuracy: mixed {mixed['test_accuracy']:.3f} vs float32 "
        f"{baseline['test_accuracy']:.3f} (diff {diff:+.3f})"
    )
    return {"float32": baseline, "mixed": mixed, "accuracy_diff": diff}


if __name__ == "__main__":
    main()
