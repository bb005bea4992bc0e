"""MindSpore automatic mixed precision, in PyTorch: ``auto_mixed_precision(net, "O2")``,
``to_float``, a hand-written loss-scaled step, ``build_train_network`` and
``Model(amp_level="O2", loss_scale_manager=...).train(epochs, dataset, [LossMonitor])``.

    python examples/mindspore_style.py --epochs 3

1. A manual loop: ``scaler.scale(loss)``, gradients, ``all_finite(grads)``, then
   ``scaler.unscale(grads)`` and an optimizer step when finite (skip otherwise), and
   ``scaler.adjust(is_finite)``, with a MindSpore ``DynamicLossScaler(scale_value=2**10,
   scale_factor=2, scale_window=50)``.
2. ``mp.build_train_step`` (``build_train_network``) with a fixed loss scale.
3. ``mp.Trainer(...).train(epochs, loader, callbacks=[mp.LossMonitor(20)])`` (``Model.train``).
All three at level O2 under ``mixed_float16``, on scikit-learn's digits.
"""

from __future__ import annotations

import argparse
import statistics
from typing import Any

import numpy
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import mixprec as mp


def network(hidden: int) -> nn.Sequential:
    """The guide's ``Network``: Flatten → Dense(512) → ReLU → Dense(512) → ReLU → Dense(10),
    with a smaller ``hidden`` (float16 matrix products are slow on a CPU)."""
    model = mp.models.mlp(input_shape=(8, 8), hidden=hidden)
    assert isinstance(model, nn.Sequential)
    return model


def loader(
    x: torch.Tensor, y: torch.Tensor, batch_size: int, seed: int
) -> DataLoader[tuple[torch.Tensor, ...]]:
    g = torch.Generator().manual_seed(seed)
    return DataLoader(TensorDataset(x, y), batch_size=batch_size, shuffle=True, generator=g)


def manual_loop(data: Any, args: argparse.Namespace) -> dict[str, Any]:
    """MindSpore's ``train_step`` with a ``DynamicLossScaler``, written out."""
    (x_train, y_train), (x_test, y_test) = data
    torch.manual_seed(args.seed)
    model = network(args.hidden)
    # MindSpore keeps Parameters in float32; at O2 mixprec stores the Dense weights in
    # float16, so the optimizer gets float32 masters of them (what LossScaleOptimizer does
    # for you in parts 2 and 3). Taken before the casts: the exact float32 initial values.
    masters = [p.detach().clone() for p in model.parameters()]
    model = mp.auto_mixed_precision(model, "mixed_float16", level="O2")
    mp.to_float(model[-1], "float32")  # Cell.to_float: the output layer runs in float32
    params = list(model.parameters())
    print(mp.describe(model), end="\n\n")

    loss_fn = nn.CrossEntropyLoss()
    optimizer = torch.optim.SGD(masters, lr=args.lr, momentum=0.9)
    loss_scaler = mp.DynamicLossScaler(scale_value=2**10, scale_factor=2, scale_window=50)

    epoch_losses, skipped, scales = [], 0, []
    for epoch in range(1, args.epochs + 1):
        model.train()
        losses = []
        for step, (x, y) in enumerate(loader(x_train, y_train, args.batch_size, epoch), 1):
            loss = loss_fn(model(x), y)
            grads = list(torch.autograd.grad(loss_scaler.scale(loss), params))
            is_finite = mp.all_finite(grads)
            if is_finite:
                # unscale returns float32: dividing float16 gradients in float16 would
                # flush the small ones to zero again.
                grads = loss_scaler.unscale(grads)
                for master, grad in zip(masters, grads, strict=True):
                    master.grad = grad
                optimizer.step()
                with torch.no_grad():  # the updated masters back into the float16 weights
                    for p, master in zip(params, masters, strict=True):
                        p.copy_(master)
            else:
                skipped += 1  # overflow: no update at all, the scale halves below
            loss_scaler.adjust(is_finite)
            scales.append(loss_scaler.get_scale())
            losses.append(loss.item())
            if step % args.print_every == 0:  # LossMonitor's line
                print(f"epoch: {epoch} step: {step}, loss is {numpy.float32(loss.item())!s}")
        epoch_losses.append(statistics.fmean(losses))
    model.eval()
    with torch.no_grad():
        accuracy = (model(x_test).argmax(-1) == y_test).float().mean().item()
    print(
        f"manual loop: test accuracy {accuracy:.3f}, loss scale {scales[0]:g} -> "
        f"{scales[-1]:g}, skipped steps {skipped}"
    )
    return {
        "losses": epoch_losses,
        "test_accuracy": accuracy,
        "loss_scale": scales[-1],
        "max_loss_scale": max(scales),
        "skipped_steps": skipped,
    }


def train_step_builder(data: Any, args: argparse.Namespace) -> dict[str, Any]:
    """``build_train_network(net, opt, loss, level="O2", loss_scale_manager=Fixed...)``."""
    (x_train, y_train), _ = data
    torch.manual_seed(args.seed)
    model = network(args.hidden)
    step = mp.build_train_step(
        model,
        torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9),
        nn.CrossEntropyLoss(),
        policy="mixed_float16",
        level="O2",
        # FixedLossScaleManager: one scale for the whole run. MindSpore applies overflowing
        # updates unless drop_overflow_update=True; mixprec always drops them.
        loss_scaler=mp.StaticLossScaler(scale_value=2**10),
    )
    epoch_losses, skipped = [], 0
    for epoch in range(1, args.epochs + 1):
        losses = []
        for x, y in loader(x_train, y_train, args.batch_size, epoch):
            loss, result = step(x, y)  # result.applied is False on a dropped update
            skipped += int(result.skipped)
            losses.append(loss.item())
        epoch_losses.append(statistics.fmean(losses))
    print(
        f"build_train_step: loss by epoch {' '.join(f'{v:.4f}' for v in epoch_losses)}, "
        f"skipped steps {skipped}"
    )
    return {"losses": epoch_losses, "skipped_steps": skipped}


def model_train(data: Any, args: argparse.Namespace) -> dict[str, Any]:
    """``Model(net, loss_fn, optimizer, metrics, amp_level="O2", loss_scale_manager)``
    then ``train(epochs, dataset, callbacks=[LossMonitor(20)])``."""
    (x_train, y_train), (x_test, y_test) = data
    torch.manual_seed(args.seed)
    model = network(args.hidden)
    trainer = mp.Trainer(
        model,
        nn.CrossEntropyLoss(),
        torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9),
        policy="mixed_float16",
        level="O2",
        loss_scaler=mp.StaticLossScaler(scale_value=2**10),
        metrics=["accuracy"],
    )
    dataset = loader(x_train, y_train, args.batch_size, args.seed)
    history = trainer.train(args.epochs, dataset, callbacks=[mp.LossMonitor(args.print_every)])
    scores = trainer.evaluate(x_test, y_test)
    print(
        f"Trainer.train: test accuracy {scores['accuracy']:.3f}, skipped steps "
        f"{sum(history.history['skipped_steps'])}, loss scale {history.history['loss_scale'][-1]:g}"
    )
    return {
        "losses": history.history["loss"],
        "test_accuracy": scores["accuracy"],
        "skipped_steps": sum(history.history["skipped_steps"]),
        "loss_scale": history.history["loss_scale"][-1],
    }


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description="MindSpore-style amp on the digits.")
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--hidden", type=int, default=64, help="small: float16 is slow on CPU")
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--print-every", type=int, default=20, help="LossMonitor(n)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)

    data = mp.data.load_digits()
    print("== 1. manual loop: scale, all_finite, unscale, adjust")
    manual = manual_loop(data, args)
    print("\n== 2. build_train_step (build_train_network), fixed loss scale 2**10")
    built = train_step_builder(data, args)
    print("\n== 3. Trainer.train with LossMonitor (Model.train)")
    trained = model_train(data, args)
    return {"manual": manual, "build_train_step": built, "trainer": trained}


if __name__ == "__main__":
    main()
