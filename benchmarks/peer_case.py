"""One side of the case-by-case comparison in docs/benchmarks.md, in a process of its own.

Trains one case and prints the median ms a step over 5 blocks after 10 warm-up steps, and
the median page faults a step. The sides:

- ``default``: mixprec's default, ``auto_mixed_precision`` + ``LossScaleOptimizer``;
- ``autocast``: plain ``torch.autocast(bfloat16)`` and an ordinary optimizer step;
- ``o1``: mixprec at level O1 in bfloat16 (float32 weights, as under autocast);
- ``o2``: mixprec at level O2 in bfloat16, what ``default`` is where ``auto`` takes
  bfloat16 (on a CPU where it takes float32, the default's step in bfloat16);
- ``bf16``: the model cast to bfloat16 and stepped by the plain optimizer, without mixprec.

Run the sides in turn, each in a fresh process, so that none inherits another's allocator
state (docs/benchmarks.md, "Page faults on CPU")::

    python benchmarks/peer_case.py default mlp8192-adamw
    python benchmarks/peer_case.py autocast mlp8192-adamw
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

import mixprec as mp
from mixprec.bench.faults import FaultMeter
from mixprec.bench.workloads import get_workload

SIDES = ("default", "autocast", "o1", "o2", "bf16")
CASES = ("mlp64-sgd", "mlp64-adamw", "mlp8192-adamw", "cnn-sgd", "lm-adamw")
Loss = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def build(case: str) -> tuple[nn.Module, torch.Tensor, torch.Tensor, Loss]:
    """The case's model, batch, targets and loss."""
    torch.manual_seed(0)
    if case.startswith("mlp"):
        batch = 8192 if case.startswith("mlp8192") else 64
        model: nn.Module = nn.Sequential(
            nn.Linear(784, 512), nn.ReLU(), nn.Linear(512, 512), nn.ReLU(), nn.Linear(512, 10)
        )
        return model, torch.randn(batch, 784), torch.randint(0, 10, (batch,)), F.cross_entropy
    if case.startswith("lm"):
        # mixprec bench's lm-d512: 4 pre-norm blocks, d=512, 8 x 256 tokens, vocabulary 8192.
        work = get_workload("lm-d512")
        return work.make_model(), *work.batch, work.loss_fn
    model = nn.Sequential(
        nn.Conv2d(3, 32, 3, padding=1), nn.BatchNorm2d(32), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(32, 64, 3, padding=1), nn.BatchNorm2d(64), nn.ReLU(), nn.MaxPool2d(2),
        nn.Flatten(), nn.Linear(64 * 8 * 8, 10),
    )  # fmt: skip
    return model, torch.randn(64, 3, 32, 32), torch.randint(0, 10, (64,)), F.cross_entropy


def _plain_lm_loss(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """Next-token cross-entropy as a plain loop writes it (``F.cross_entropy``), in float32:
    CPU autocast computes it so; outside autocast, 16-bit logits are widened here."""
    flat = logits[:, :-1].flatten(0, 1)
    if not torch.is_autocast_enabled("cpu"):
        flat = flat.float()
    return F.cross_entropy(flat, tokens[:, 1:].flatten())


def make_step(
    side: str,
    case: str,
    compiled: bool = False,
    keep_grad_buffers: bool = False,
    output_bf16: bool = False,
    plain_loss: bool = False,
) -> tuple[Callable[[], None], nn.Module]:
    """The side's training step on the case, and its model. ``output_bf16``: mixprec's
    model returns bfloat16 (its policy's output dtype); ``plain_loss``: the LM's loss is
    ``F.cross_entropy`` instead of mixprec's ``lm_loss``, which reads 16-bit logits in
    float32 a chunk at a time."""
    model, x, y, loss_fn = build(case)
    if plain_loss:
        loss_fn = _plain_lm_loss
    if side == "bf16":
        model = model.bfloat16()
    opt: torch.optim.Optimizer
    if case.endswith("sgd"):
        opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    else:
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    if side in ("default", "o1", "o2"):
        level = {"o1": "O1", "o2": "O2"}.get(side, "auto")
        policy: str | mp.Policy = "auto" if side == "default" else "mixed_bfloat16"
        if output_bf16:
            policy = mp.Policy("params=float32,compute=bfloat16,output=bfloat16")
        model = mp.auto_mixed_precision(model, policy=policy, level=level)
        lso = mp.LossScaleOptimizer(opt, keep_grad_buffers=keep_grad_buffers)
    forward = torch.compile(model) if compiled else model

    def mixprec_step() -> None:
        lso.backward(loss_fn(forward(x), y))
        lso.step()
        lso.zero_grad()

    def autocast_step() -> None:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = loss_fn(forward(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()

    def bf16_step() -> None:
        inputs = x.bfloat16() if x.is_floating_point() else x  # token ids stay integers
        loss_fn(forward(inputs).float(), y).backward()
        opt.step()
        opt.zero_grad()

    steps = {"default": mixprec_step, "o1": mixprec_step, "o2": mixprec_step,
             "autocast": autocast_step, "bf16": bf16_step}  # fmt: skip
    return steps[side], model


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("side", choices=SIDES)
    parser.add_argument("case", choices=CASES)
    parser.add_argument("--compile", action="store_true", help="torch.compile the model")
    parser.add_argument(
        "--keep-grad-buffers", action="store_true",
        help="LossScaleOptimizer(keep_grad_buffers=True), for default, o1 and o2",
    )  # fmt: skip
    parser.add_argument(
        "--output-bf16", action="store_true",
        help="mixprec's model returns bfloat16 (policy output=bfloat16), for default, o1 and o2",
    )  # fmt: skip
    parser.add_argument(
        "--plain-loss", action="store_true",
        help="lm-adamw: F.cross_entropy instead of mixprec's lm_loss",
    )  # fmt: skip
    parser.add_argument("--steps", type=int, default=0, help="timed steps (default: by case)")
    parser.add_argument("--out", help="append the median ms a step to this file")
    args = parser.parse_args()
    for flag in ("keep_grad_buffers", "output_bf16"):
        if getattr(args, flag) and args.side not in ("default", "o1", "o2"):
            option = "--" + flag.replace("_", "-")
            parser.error(f"{option} is for the default and o1 sides, not {args.side}")
    if args.plain_loss and args.case != "lm-adamw":
        parser.error(f"--plain-loss is for lm-adamw, not {args.case}")
    step, _ = make_step(
        args.side, args.case, args.compile, args.keep_grad_buffers, args.output_bf16,
        args.plain_loss,
    )  # fmt: skip
    steps = args.steps or {"mlp8192-adamw": 60, "lm-adamw": 20}.get(args.case, 600)
    block = max(steps // 5, 1)
    for _ in range(10):
        step()
    times, meter = [], FaultMeter()
    for _ in range(5):
        meter.start()
        start = time.perf_counter()
        for _ in range(block):
            step()
        times.append(1000 * (time.perf_counter() - start) / block)
        meter.stop(block)
    ms = statistics.median(times)
    faults, _ = meter.per_step()
    if args.out:
        with open(args.out, "a") as f:
            f.write(f"{ms:.3f}\n")
    mode = "compiled" if args.compile else "eager"
    counted = f"{faults:.0f}" if faults is not None else "-"
    print(f"{args.side} {args.case} {mode}: {ms:.2f} ms a step, {counted} page faults a step")


if __name__ == "__main__":
    main()
