"""Keras mixed precision guide, in PyTorch: a global dtype policy, a float32 softmax output,
``fit(batch_size, epochs, validation_split)``, ``evaluate`` and time per step.

    python examples/keras_style.py --epochs 5 --batch-size 64

The same model is trained twice from the same weights and batch order, once under the
``float32`` policy and once under ``mixed_bfloat16``, and the two are compared: accuracy,
loss and milliseconds per step.
"""

from __future__ import annotations

import argparse
import statistics
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

import mixprec as mp


def build_model(hidden: int) -> nn.Sequential:
    """Flatten → Dense → ReLU → Dense → ReLU → Dense (logits) → float32 softmax."""
    model = mp.models.mlp(input_shape=(8, 8), hidden=hidden)
    assert isinstance(model, nn.Sequential)
    # Keras' `Activation("softmax", dtype="float32")`: whatever the global policy, the
    # probabilities are computed and returned in float32, so the loss sees no 16-bit rounding.
    model.append(mp.to_float(nn.Softmax(dim=-1), "float32"))
    return model


def sparse_categorical_crossentropy(probs: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Keras' loss on probabilities (not logits): -log p[target], clipped away from log(0)."""
    return F.nll_loss(probs.clamp_min(1e-7).log(), target)


def output_dtypes(model: nn.Sequential, x: torch.Tensor) -> tuple[torch.dtype, torch.dtype]:
    """The dtypes of the logits layer's output and of the model's (softmax) output."""
    seen: dict[str, torch.dtype] = {}
    handle = model[-2].register_forward_hook(
        lambda _m, _i, out: seen.__setitem__("logits", out.dtype)
    )
    try:
        model.eval()
        with torch.no_grad():
            seen["output"] = model(x).dtype
    finally:
        handle.remove()
    return seen["logits"], seen["output"]


def run(policy: str, data: Any, args: argparse.Namespace) -> dict[str, Any]:
    """Train under ``policy`` set globally, as the Keras guide does; return its figures."""
    (x_train, y_train), (x_test, y_test) = data
    mp.set_global_policy(policy)
    torch.manual_seed(args.seed)  # the same initial weights and batch order in both runs
    model = build_model(args.hidden)
    optimizer = torch.optim.RMSprop(model.parameters(), lr=args.lr)
    # policy=None: the Trainer applies the global policy (level "auto": O0 or O2 here).
    trainer = mp.Trainer(model, sparse_categorical_crossentropy, optimizer, metrics=["accuracy"])
    policy_now = mp.global_policy()
    print(
        f"--- policy {policy_now.name}: compute dtype {policy_now.compute_dtype}, "
        f"variable dtype {policy_now.variable_dtype}"
    )
    history = trainer.fit(
        x_train,
        y_train,
        batch_size=args.batch_size,
        epochs=args.epochs,
        validation_split=0.2,  # the last 20% of the training set, held out before shuffling
        verbose=args.verbose,
    )
    scores = trainer.evaluate(x_test, y_test, batch_size=256)
    logits_dtype, output_dtype = output_dtypes(model, x_test[:4].to(trainer.device))
    print(f"logits dtype: {logits_dtype}, softmax output dtype: {output_dtype}")
    print(f"Test loss: {scores['loss']:.4f}  Test accuracy: {scores['accuracy']:.4f}")
    ms = history.history["ms_per_step"]
    # The first epoch pays one-time costs (allocations, first casts), as in Keras' logs.
    steady = ms[1:] or ms
    return {
        "policy": policy,
        "loss": history.history["loss"],
        "val_accuracy": history.history["val_accuracy"],
        "test_loss": scores["loss"],
        "test_accuracy": scores["accuracy"],
        "ms_per_step": statistics.median(steady),
        "ms_per_step_by_epoch": ms,
        "logits_dtype": str(logits_dtype).removeprefix("torch."),
        "output_dtype": str(output_dtype).removeprefix("torch."),
    }


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description="Keras-style fit in float32 and mixed precision.")
    parser.add_argument("--policy", default="mixed_bfloat16", help="the mixed policy to compare")
    parser.add_argument("--epochs", type=int, default=5)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--verbose", type=int, default=1, help="1: one line per epoch")
    args = parser.parse_args(argv)

    data = mp.data.load_digits()
    previous = mp.global_policy()
    try:
        runs = {name: run(name, data, args) for name in ("float32", args.policy)}
    finally:
        mp.set_global_policy(previous)  # a global setting: leave it as we found it

    base, mixed = runs["float32"], runs[args.policy]
    header = f"{'policy':<16} {'test acc':>8} {'test loss':>9} {'val acc':>8} {'ms/step':>8}"
    print("\n" + header + "\n" + "-" * len(header))
    for r in (base, mixed):
        print(
            f"{r['policy']:<16} {r['test_accuracy']:>8.3f} {r['test_loss']:>9.4f} "
            f"{r['val_accuracy'][-1]:>8.3f} {r['ms_per_step']:>8.2f}"
        )
    speedup = base["ms_per_step"] / mixed["ms_per_step"]
    diff = mixed["test_accuracy"] - base["test_accuracy"]
    print(f"\n{args.policy}: accuracy {diff:+.3f} vs float32, {speedup:.2f}x its speed per step")
    return {"float32": base, "mixed": mixed, "speedup": speedup, "accuracy_diff": diff}


if __name__ == "__main__":
    main()
