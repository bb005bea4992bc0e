"""TensorFlow 1 mixed precision by hand, in PyTorch: a small CTC speech model.

    python examples/tf1_manual.py --steps 80

What the TF1 recipe did by hand, and what stands for it here:
- variables stored in float32 and cast to float16 where used (the custom variable getter),
  matmul/conv inputs cast to float16: ``auto_mixed_precision(model, "mixed_float16", "O1")``;
- log-softmax and the CTC loss in float32: ``mp.models.SpeechCTC`` returns float32
  log-probabilities and ``mp.models.ctc_loss`` computes in float32;
- ``ExponentialUpdateLossScaleManager(init_loss_scale=2**32, incr_every_n_steps=1000,
  decr_every_n_nan_or_inf=2, decr_ratio=0.5)`` inside a ``LossScaleOptimizer``: the scale
  starts far too high, so the first steps overflow and the scale halves after every second
  overflow until gradients fit in float16;
- restoring a float32 checkpoint into a float16 model (the ``CastFromFloat32SaverBuilder``):
  ``mp.load_checkpoint`` casts each tensor to its destination's dtype and reports it.
"""

from __future__ import annotations

import argparse
import math
import statistics
import tempfile
from pathlib import Path
from typing import Any

import torch
from torch import nn

import mixprec as mp

Batch = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]


def ctc_batch_loss(model: nn.Module, batch: Batch) -> torch.Tensor:
    features, targets, input_lengths, target_lengths = batch
    log_probs = model(features)  # (time, batch, tokens), float32 whatever the policy
    frames = model.output_lengths(input_lengths)  # type: ignore[operator]
    return mp.models.ctc_loss(log_probs, targets, frames, target_lengths)


def edit_distance(a: list[int], b: list[int]) -> int:
    row = list(range(len(b) + 1))
    for i, x in enumerate(a, 1):
        prev, row[0] = row[0], i
        for j, y in enumerate(b, 1):
            prev, row[j] = row[j], min(row[j] + 1, row[j - 1] + 1, prev + (x != y))
    return row[-1]


def token_error_rate(model: nn.Module, batch: Batch) -> float:
    """Greedy CTC decoding (best token per frame, repeats merged, blanks dropped) against the
    targets: edit distance over target length, summed over the batch."""
    features, targets, input_lengths, target_lengths = batch
    model.eval()
    with torch.no_grad():
        best = model(features).argmax(-1).T  # (batch, time)
    frames = model.output_lengths(input_lengths)  # type: ignore[operator]
    errors = 0
    for i in range(len(best)):
        path = best[i, : int(frames[i])].tolist()
        decoded = [t for k, t in enumerate(path) if t != 0 and (k == 0 or t != path[k - 1])]
        errors += edit_distance(decoded, targets[i, : int(target_lengths[i])].tolist())
    return errors / int(target_lengths.sum())


def batches(data: Batch, batch_size: int, steps: int, seed: int) -> list[Batch]:
    g = torch.Generator().manual_seed(seed)
    features, targets, input_lengths, target_lengths = data
    out: list[Batch] = []
    while len(out) < steps:
        for idx in torch.randperm(len(features), generator=g).split(batch_size):
            out.append((features[idx], targets[idx], input_lengths[idx], target_lengths[idx]))
    return out[:steps]


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description="TF1-style float16 training of a CTC model.")
    parser.add_argument("--pretrain-steps", type=int, default=30, help="float32 steps")
    parser.add_argument("--steps", type=int, default=80, help="mixed precision steps")
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--checkpoint-dir", default=None, help="default: a temporary folder")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)

    sizes = {"n_mels": 20, "n_tokens": 10}  # small: float16 GRUs are slow on a CPU
    speech = mp.models.synthetic_speech(n=96, time=40, seed=args.seed, **sizes)
    train: Batch = tuple(t[:64] for t in speech)  # type: ignore[assignment]
    test: Batch = tuple(t[64:] for t in speech)  # type: ignore[assignment]

    # 1. An earlier float32 run and its checkpoint: the model the TF1 recipe restored from.
    torch.manual_seed(args.seed)
    model32 = mp.models.SpeechCTC(hidden=args.hidden, **sizes)
    opt32 = torch.optim.Adam(model32.parameters(), lr=args.lr)
    for batch in batches(train, args.batch_size, args.pretrain_steps, args.seed):
        opt32.zero_grad()
        ctc_batch_loss(model32, batch).backward()
        opt32.step()
    with torch.no_grad():
        loss32 = ctc_batch_loss(model32.eval(), test).item()
    print(f"float32 pretraining: {args.pretrain_steps} steps, test CTC loss {loss32:.4f}")

    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(args.checkpoint_dir or tmp)
        ckpt = mp.save_checkpoint(folder / "speech_fp32.safetensors", model32)

        # 2. The TF1 setup: float32 storage, float16 math (level O1), float32 CTC loss.
        model = mp.auto_mixed_precision(
            mp.models.SpeechCTC(hidden=args.hidden, **sizes), "mixed_float16", level="O1"
        )
        report = mp.load_checkpoint(ckpt, model)
        print("\nrestore into the O1 model (variables stored in float32, nothing to cast):")
        print(report)

        # 3. The same float32 checkpoint into a model stored in float16 (O3: every weight
        # float16, like the TF1 model whose batch-norm statistics were float16).
        half = mp.auto_mixed_precision(
            mp.models.SpeechCTC(hidden=args.hidden, **sizes), "float16", level="O3"
        )
        half_report = mp.load_checkpoint(ckpt, half)
        print("\nrestore into the float16 (O3) model:")
        print(half_report)
        with torch.no_grad():
            loss16 = ctc_batch_loss(half.eval(), test).item()
        print(f"test CTC loss: float32 model {loss32:.4f}, restored float16 model {loss16:.4f}")

    # 4. Fine-tune the O1 model with TF1's loss scale manager.
    scaler = mp.ExponentialUpdateLossScaleManager(
        init_loss_scale=2**32, incr_every_n_steps=1000, decr_every_n_nan_or_inf=2, decr_ratio=0.5
    )
    opt = mp.LossScaleOptimizer(torch.optim.Adam(model.parameters(), lr=args.lr), scaler)
    print(f"\n{scaler}")
    losses, changes, skipped = [], [], 0
    scale = scaler.get_scale()
    for step, batch in enumerate(
        batches(train, args.batch_size, args.steps, args.seed + 1), start=1
    ):
        model.train()
        opt.zero_grad()
        loss = ctc_batch_loss(model, batch)
        opt.backward(loss)
        result = opt.step()
        skipped += int(result.skipped)
        losses.append(loss.item())
        if scaler.get_scale() != scale:
            scale = scaler.get_scale()
            changes.append((step, scale))
    trajectory = " ".join(f"{step}:2^{math.log2(s):g}" for step, s in changes)
    print(f"scale changes (step:scale): {trajectory or 'none'}")
    state = scaler.state
    print(
        f"final scale 2^{math.log2(state.scale):g}, skipped {state.skipped_steps} of "
        f"{state.steps} steps"
    )
    first, last = statistics.fmean(losses[:10]), statistics.fmean(losses[-10:])
    with torch.no_grad():
        test_loss = ctc_batch_loss(model.eval(), test).item()
    ter = token_error_rate(model, test)
    print(f"train CTC loss, first 10 steps {first:.4f} -> last 10 steps {last:.4f}")
    print(f"test CTC loss {test_loss:.4f}, greedy token error rate {ter:.3f}")
    return {
        "pretrain_test_loss": loss32,
        "restored_fp16_test_loss": loss16,
        "converted_o1": len(report.converted),
        "converted_fp16": len(half_report.converted),
        "conversions": half_report.converted,
        "scale_changes": changes,
        "final_scale": state.scale,
        "skipped_steps": state.skipped_steps,
        "steps": state.steps,
        "first_losses": first,
        "last_losses": last,
        "test_loss": test_loss,
        "token_error_rate": ter,
    }


if __name__ == "__main__":
    main()
