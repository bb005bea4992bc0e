"""Pure bfloat16 training (level O3): no float32 copy of the weights, and still O2's accuracy.

    python examples/pure_bf16.py

O3 stores every weight in bfloat16 and keeps no float32 masters. With a plain optimizer,
updates smaller than half a bfloat16 unit are rounded away and training falls behind.
``mp.CompensatedAdamW`` computes the update in float32 and applies it with Kahan
compensation (a bfloat16 buffer of what rounding lost) or stochastic rounding (no buffer).
This script trains the digits MLP four ways and prints accuracy and the bytes per
parameter that weights, masters, gradients and optimizer state take.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Iterable
from typing import Any

import torch
import torch.nn.functional as F

import mixprec as mp

Variant = tuple[str, str, str, Callable[[Iterable[Any], float], torch.optim.Optimizer]]

VARIANTS: list[Variant] = [
    ("O2, float32 masters", "mixed_bfloat16", "O2", lambda p, lr: torch.optim.AdamW(p, lr)),
    ("O3, plain AdamW", "bfloat16", "O3", lambda p, lr: torch.optim.AdamW(p, lr)),
    ("O3, Kahan", "bfloat16", "O3", lambda p, lr: mp.CompensatedAdamW(p, lr)),
    ("O3, stochastic rounding", "bfloat16", "O3",
     lambda p, lr: mp.CompensatedAdamW(p, lr, compensation="stochastic")),
]  # fmt: skip


def training_bytes(model: torch.nn.Module, opt: mp.LossScaleOptimizer) -> float:
    """Bytes per parameter held across steps: weights, masters, their gradients, state."""
    params = list(model.parameters())
    count = sum(p.numel() for p in params)
    total = sum(p.numel() * p.element_size() * 2 for p in params)  # weight + its gradient
    total += sum(m.numel() * m.element_size() * 2 for _, m in opt.master_weights())
    for state in opt.state.values():
        total += sum(v.numel() * v.element_size() for v in state.values() if torch.is_tensor(v))
    return total / count


def run(policy: str, level: str, make_opt: Callable[..., Any], args: argparse.Namespace):
    (xt, yt), (xs, ys) = mp.data.load_digits()
    torch.manual_seed(args.seed)
    model = mp.auto_mixed_precision(mp.models.mlp((8, 8), hidden=256), policy, level)
    opt = mp.LossScaleOptimizer(make_opt(model.parameters(), args.lr))
    order = torch.Generator().manual_seed(args.seed + 1)
    for _ in range(args.epochs):
        for idx in torch.randperm(len(xt), generator=order).split(args.batch_size):
            opt.zero_grad()
            opt.backward(F.cross_entropy(model(xt[idx]).float(), yt[idx]))  # loss in float32
            opt.step()
    with torch.no_grad():
        out = model(xs).float()
    loss = F.cross_entropy(out, ys).item()
    accuracy = (out.argmax(1) == ys).float().mean().item()
    return {
        "test_loss": loss,
        "test_accuracy": accuracy,
        "bytes_per_param": training_bytes(model, opt),
    }


def main(argv: list[str] | None = None) -> dict[str, dict[str, float]]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=15)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--lr", type=float, default=3e-4)  # small steps: where rounding bites
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    results = {name: run(policy, level, make, args) for name, policy, level, make in VARIANTS}
    print(f"{'variant':<26} {'test loss':>9} {'accuracy':>8} {'bytes/param':>11}")
    for name, r in results.items():
        print(f"{name:<26} {r['test_loss']:>9.4f} {r['test_accuracy']:>8.3f} "
              f"{r['bytes_per_param']:>11.1f}")  # fmt: skip
    o2, kahan = results["O2, float32 masters"], results["O3, Kahan"]
    print(f"\nO3 + Kahan keeps {kahan['bytes_per_param']:.0f} bytes per parameter against "
          f"O2's {o2['bytes_per_param']:.0f}, with test loss {kahan['test_loss']:.4f} vs "
          f"{o2['test_loss']:.4f}")  # fmt: skip
    return results


if __name__ == "__main__":
    main()
