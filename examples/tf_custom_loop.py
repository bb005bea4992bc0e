"""Keras/TensorFlow custom training loop with a ``LossScaleOptimizer``, in PyTorch.

    python examples/tf_custom_loop.py --epochs 4

Part 1 is the TF 2 loop under ``mixed_float16``: ``get_scaled_loss`` → gradients of the
scaled loss (``torch.autograd.grad`` plays ``tape.gradient``) → ``get_unscaled_gradients``
→ ``apply_gradients(zip(grads, params))``, on the digits. The same model trained with the
one-call ``opt.backward(loss); opt.step()`` ends with the same weights.

Part 2 is the recommender variant: embedding tables and dense layers are split with
``split_embedding_parameters`` and get their own optimizers (``SparseAdam`` for the sparse
embedding gradients, ``Adam`` for the rest), under one loss scale.
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

POLICY = "mixed_float16"  # float16 compute: the loss scale is real (2**16 to start)


def tf_style_step(
    model: nn.Module,
    opt: mp.LossScaleOptimizer,
    params: list[nn.Parameter],
    x: torch.Tensor,
    y: torch.Tensor,
) -> tuple[float, mp.StepResult]:
    """One step of the Keras custom loop."""
    loss = F.cross_entropy(model(x), y)  # the model's output is float32
    scaled_loss = opt.get_scaled_loss(loss)
    scaled_grads = torch.autograd.grad(scaled_loss, params)
    # Divided by the scale in float32: at O2 the gradients of float16 weights come back
    # float32, as their masters are, so small values do not flush to zero on the way.
    grads = opt.get_unscaled_gradients(scaled_grads)
    # Skipped, with the scale halved, when a gradient holds inf/NaN.
    result = opt.apply_gradients(zip(grads, params, strict=True))
    return loss.item(), result


def one_call_step(
    model: nn.Module, opt: mp.LossScaleOptimizer, x: torch.Tensor, y: torch.Tensor
) -> tuple[float, mp.StepResult]:
    """The same step with mixprec's one-call API."""
    opt.zero_grad()
    loss = F.cross_entropy(model(x), y)
    opt.backward(loss)
    return loss.item(), opt.step()


def part1_digits(args: argparse.Namespace) -> dict[str, Any]:
    (x_train, y_train), (x_test, y_test) = mp.data.load_digits()
    torch.manual_seed(args.seed)
    base = mp.models.mlp(input_shape=(8, 8), hidden=args.hidden)
    runs: dict[str, dict[str, Any]] = {}
    for name in ("keras loop", "one call"):
        model = mp.auto_mixed_precision(copy.deepcopy(base), POLICY, args.level)
        params = list(model.parameters())
        # Keras' LossScaleOptimizer(initial_scale, dynamic_growth_steps), with Keras 3's
        # schedule (no ceiling): a scale high enough that the first steps overflow float16
        # and are skipped while it backs off.
        opt = mp.LossScaleOptimizer(
            torch.optim.Adam(params, lr=args.lr),
            initial_scale=args.initial_scale,
            dynamic_growth_steps=args.growth_steps,
        )
        order = torch.Generator().manual_seed(args.seed)  # the same batches in both runs
        epoch_losses, skipped = [], 0
        for _ in range(args.epochs):
            losses = []
            for idx in torch.randperm(len(x_train), generator=order).split(args.batch_size):
                x, y = x_train[idx], y_train[idx]
                if name == "keras loop":
                    loss, result = tf_style_step(model, opt, params, x, y)
                else:
                    loss, result = one_call_step(model, opt, x, y)
                losses.append(loss)
                skipped += int(result.found_inf)
            epoch_losses.append(statistics.fmean(losses))
        model.eval()
        with torch.no_grad():
            accuracy = (model(x_test).argmax(-1) == y_test).float().mean().item()
        runs[name] = {
            "losses": epoch_losses,
            "test_accuracy": accuracy,
            "loss_scale": opt.loss_scaler.get_scale(),
            "skipped_steps": skipped,
            "weights": [m.detach().clone() for m in opt.master_params()],
        }
        print(
            f"{name:<11} loss by epoch {' '.join(f'{v:.4f}' for v in epoch_losses)}  "
            f"test acc {accuracy:.3f}  scale {opt.loss_scaler.get_scale():g}  skipped {skipped}"
        )
    diff = max(
        (a - b).abs().max().item()
        for a, b in zip(runs["keras loop"]["weights"], runs["one call"]["weights"], strict=True)
    )
    print(f"max |weight difference| keras loop vs one call: {diff:g}")
    for r in runs.values():
        del r["weights"]
    return {**runs["keras loop"], "one_call": runs["one call"], "max_weight_diff": diff}


def click_data(
    n: int, table_sizes: tuple[int, ...], seed: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Synthetic clicks: each id has a hidden score; a sample is clicked when its ids' scores
    add up to more than 0. Learnable, and needs the embeddings to learn it."""
    g = torch.Generator().manual_seed(seed)
    scores = [torch.randn(size, generator=g) for size in table_sizes]
    ids = torch.stack([torch.randint(0, size, (n,), generator=g) for size in table_sizes], 1)
    logit = sum(s[ids[:, j]] for j, s in enumerate(scores))
    return ids, (torch.as_tensor(logit) > 0).float()


def part2_embeddings(args: argparse.Namespace) -> dict[str, Any]:
    tables = (200, 200, 50)
    ids, clicks = click_data(args.samples, tables, args.seed)
    cut = int(0.8 * len(ids))
    torch.manual_seed(args.seed)
    model = mp.models.Recommender(tables, dim=8, hidden=32, sparse=True)  # sparse gradients
    model = mp.auto_mixed_precision(model, POLICY, args.level)
    emb, dense = mp.split_embedding_parameters(model)
    # No loss_scaler given: the float16 model gets a DynamicLossScaler (2**16 to start).
    opt = mp.LossScaleOptimizer(
        [torch.optim.SparseAdam(emb, lr=args.lr * 10), torch.optim.Adam(dense, lr=args.lr)]
    )
    order = torch.Generator().manual_seed(args.seed)
    epoch_losses, skipped, sparse = [], 0, False
    for _ in range(args.epochs):
        losses = []
        for idx in torch.randperm(cut, generator=order).split(args.batch_size):
            loss = F.binary_cross_entropy_with_logits(model(ids[idx]), clicks[idx])
            scaled_loss = opt.get_scaled_loss(loss)
            grads = torch.autograd.grad(scaled_loss, emb + dense)
            sparse = sparse or all(g.is_sparse for g in grads[: len(emb)])
            # Unscaled separately, as the recommender guide does (sparse ones stay sparse).
            emb_grads = opt.get_unscaled_gradients(grads[: len(emb)])
            dense_grads = opt.get_unscaled_gradients(grads[len(emb) :])
            # One apply_gradients for both sets: it is a whole step (check, apply, scale
            # update), so both optimizers step or both skip, and the scale moves once.
            pairs = [*zip(emb_grads, emb, strict=True), *zip(dense_grads, dense, strict=True)]
            result = opt.apply_gradients(pairs)
            skipped += int(result.found_inf)
            losses.append(loss.item())
        epoch_losses.append(statistics.fmean(losses))
    model.eval()
    with torch.no_grad():
        accuracy = ((model(ids[cut:]) > 0).float() == clicks[cut:]).float().mean().item()
    # Each inner optimizer counts its own steps: both advanced on every applied step.
    steps = [
        int(next(iter(inner.state.values()))["step"]) if inner.state else 0
        for inner in opt.optimizers
    ]
    print(
        f"recommender loss by epoch {' '.join(f'{v:.4f}' for v in epoch_losses)}  "
        f"test acc {accuracy:.3f}  scale {opt.loss_scaler.get_scale():g}  skipped {skipped}"
    )
    print(
        f"sparse embedding gradients: {sparse}; steps taken by SparseAdam {steps[0]}, "
        f"by Adam {steps[1]}"
    )
    return {
        "losses": epoch_losses,
        "test_accuracy": accuracy,
        "loss_scale": opt.loss_scaler.get_scale(),
        "skipped_steps": skipped,
        "sparse_gradients": sparse,
        "optimizer_steps": steps,
    }


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description="Keras-style custom loop in mixed_float16.")
    parser.add_argument("--epochs", type=int, default=4)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--hidden", type=int, default=64, help="small: float16 is slow on CPU")
    parser.add_argument("--samples", type=int, default=4096, help="recommender samples")
    parser.add_argument("--lr", type=float, default=2e-3)
    parser.add_argument(
        "--level",
        default="O1",
        choices=["O1", "O2"],
        help="O1: float32 weights cast on use, as Keras stores variables; O2: float16 weights "
        "with float32 masters",
    )
    parser.add_argument("--initial-scale", type=float, default=2.0**24)
    parser.add_argument("--growth-steps", type=int, default=100)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)

    print(f"== part 1: Keras custom loop on the digits ({POLICY}, {args.level})")
    digits = part1_digits(args)
    print(f"\n== part 2: embeddings apart, SparseAdam + Adam ({POLICY}, {args.level})")
    recommender = part2_embeddings(args)
    return {"digits": digits, "recommender": recommender}


if __name__ == "__main__":
    main()
