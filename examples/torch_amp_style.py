"""PyTorch ``torch.autocast`` + ``GradScaler`` loop, with ``mp.GradScaler`` dropped in.

    python examples/torch_amp_style.py --epochs 4

1. The usual float16 autocast loop (``scaler.scale(loss).backward()``, ``unscale_`` for
   clipping, ``step``, ``update``) is run twice from the same weights on the same batches:
   with ``torch.amp.GradScaler("cpu")`` and with ``mp.GradScaler("cpu")``, the only changed
   line. Loss scales, skipped steps and parameters come out bitwise identical.
2. The same training written with mixprec's own pieces: ``auto_mixed_precision`` (no
   autocast block in the loop) and a ``LossScaleOptimizer`` (scaling, unscaling, clipping,
   skipping and the scale update in ``backward`` and ``step``).
"""

from __future__ import annotations

import argparse
import copy
import statistics
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

import mixprec as mp

Data = tuple[tuple[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]


def batches(data: Data, args: argparse.Namespace, epoch: int) -> list[torch.Tensor]:
    """Batch indices of one epoch; the same in every run."""
    (x_train, _), _ = data
    order = torch.Generator().manual_seed(args.seed * 1000 + epoch)
    return list(torch.randperm(len(x_train), generator=order).split(args.batch_size))


def accuracy(model: nn.Module, data: Data, autocast: bool) -> float:
    _, (x_test, y_test) = data
    model.eval()
    # The plain model needs the autocast block; the prepared one brings its own precision.
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.float16, enabled=autocast):
        return float((model(x_test).argmax(-1) == y_test).float().mean())


def train_autocast(
    model: nn.Module, scaler: Any, data: Data, args: argparse.Namespace
) -> dict[str, Any]:
    """The torch.amp recipe, as written in user code; ``scaler`` is either GradScaler."""
    (x_train, y_train), _ = data
    opt = torch.optim.Adam(model.parameters(), lr=args.lr)
    losses, scales, skipped = [], [], 0
    for epoch in range(args.epochs):
        model.train()
        epoch_losses = []
        for idx in batches(data, args, epoch):
            opt.zero_grad()
            with torch.autocast("cpu", dtype=torch.float16):
                loss = F.cross_entropy(model(x_train[idx]), y_train[idx])
            scaler.scale(loss).backward()
            scaler.unscale_(opt)  # real gradients, so that the clipping threshold means 1.0
            nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            before = scaler.get_scale()
            scaler.step(opt)  # skipped when the gradients hold inf/NaN
            scaler.update()
            skipped += int(scaler.get_scale() < before)  # a backoff means this step skipped
            scales.append(scaler.get_scale())
            epoch_losses.append(loss.item())
        losses.append(statistics.fmean(epoch_losses))
    return {"losses": losses, "scales": scales, "skipped_steps": skipped}


def train_mixprec(model: nn.Module, data: Data, args: argparse.Namespace) -> dict[str, Any]:
    """The same training with auto_mixed_precision + LossScaleOptimizer."""
    (x_train, y_train), _ = data
    model = mp.auto_mixed_precision(model, "mixed_float16", args.level)
    scaler = mp.DynamicLossScaler(init_scale=args.init_scale, growth_interval=args.growth_interval)
    opt = mp.LossScaleOptimizer(
        torch.optim.Adam(model.parameters(), lr=args.lr), loss_scaler=scaler, max_grad_norm=1.0
    )
    losses, scales, skipped = [], [], 0
    for epoch in range(args.epochs):
        model.train()
        epoch_losses = []
        for idx in batches(data, args, epoch):
            opt.zero_grad()
            loss = F.cross_entropy(model(x_train[idx]), y_train[idx])  # float16 inside
            opt.backward(loss)
            result = opt.step()
            skipped += int(result.skipped)
            scales.append(opt.loss_scaler.get_scale())
            epoch_losses.append(loss.item())
        losses.append(statistics.fmean(epoch_losses))
    return {"losses": losses, "scales": scales, "skipped_steps": skipped}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description="torch.amp GradScaler vs mp.GradScaler.")
    parser.add_argument("--epochs", type=int, default=4)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--hidden", type=int, default=64, help="small: float16 is slow on CPU")
    parser.add_argument("--lr", type=float, default=2e-3)
    # High enough that float16 gradients overflow at first: the skip and backoff path runs.
    parser.add_argument("--init-scale", type=float, default=2.0**24)
    parser.add_argument("--growth-interval", type=int, default=50)
    parser.add_argument("--level", default="O2", choices=["O1", "O2"])
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)

    data: Data = mp.data.load_digits()
    torch.manual_seed(args.seed)
    base = mp.models.mlp(input_shape=(8, 8), hidden=args.hidden)
    kwargs = {"init_scale": args.init_scale, "growth_interval": args.growth_interval}

    runs: dict[str, dict[str, Any]] = {}
    models: dict[str, nn.Module] = {}
    for name, scaler in (
        ("torch.amp.GradScaler", torch.amp.GradScaler("cpu", **kwargs)),
        ("mp.GradScaler", mp.GradScaler("cpu", **kwargs)),  # the one line that changes
    ):
        models[name] = copy.deepcopy(base)
        runs[name] = train_autocast(models[name], scaler, data, args)
    models["auto_mixed_precision"] = copy.deepcopy(base)
    runs["auto_mixed_precision"] = train_mixprec(models["auto_mixed_precision"], data, args)

    theirs, ours = models["torch.amp.GradScaler"], models["mp.GradScaler"]
    identical = all(
        torch.equal(a, b) for a, b in zip(theirs.parameters(), ours.parameters(), strict=True)
    )
    same_scales = runs["torch.amp.GradScaler"]["scales"] == runs["mp.GradScaler"]["scales"]

    header = f"{'run':<22} {'loss by epoch':<28} {'test acc':>8} {'skipped':>7} {'scale':>8}"
    print(header + "\n" + "-" * len(header))
    for name, r in runs.items():
        r["test_accuracy"] = accuracy(models[name], data, name != "auto_mixed_precision")
        r["final_scale"] = r["scales"][-1]
        epochs = " ".join(f"{v:.4f}" for v in r["losses"])
        print(
            f"{name:<22} {epochs:<28} {r['test_accuracy']:>8.3f} {r['skipped_steps']:>7d} "
            f"{r['final_scale']:>8g}"
        )
    steps = len(runs["mp.GradScaler"]["scales"])
    print(
        f"\nafter {steps} steps, torch.amp.GradScaler vs mp.GradScaler: parameters bitwise "
        f"identical: {identical}; same loss scale at every step: {same_scales}"
    )
    return {
        **runs,
        "bitwise_identical": identical,
        "same_scales": same_scales,
        "steps": steps,
    }


if __name__ == "__main__":
    main()
