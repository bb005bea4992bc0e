"""``mixprec inspect``: list a checkpoint's tensors and metadata, without a model."""

from __future__ import annotations

import argparse
from typing import Any

import torch

from mixprec._dtypes import dtype_name
from mixprec.checkpoint import read_checkpoint, trainer_state

HELP = "list a checkpoint's tensors and metadata"


def add_arguments(sub: argparse.ArgumentParser) -> None:
    """The options of ``mixprec inspect``."""
    sub.add_argument(
        "checkpoint", help="a mixprec checkpoint, .safetensors or torch.save file to list"
    )


def run(args: argparse.Namespace) -> int:
    """Print the header's versions, policy and trainer state, then one line per tensor."""
    tensors, header = read_checkpoint(args.checkpoint)
    print(f"{args.checkpoint}: {len(tensors)} tensors")
    for key in ("format_version", "mixprec_version", "torch_version", "policy", "level"):
        if header.get(key) is not None:
            print(f"  {key}: {header[key]}")
    if header.get("masters"):
        print(f"  float32 masters stored for: {', '.join(header['masters'])}")
    if header.get("other_entries"):
        print(f"  entries beside the state dict (not read): {', '.join(header['other_entries'])}")
    trainer = trainer_state(header, tensors)
    scalars = {k: _brief(v) for k, v in trainer.items() if not isinstance(v, torch.Tensor)}
    if scalars:
        print(f"  trainer state: {scalars}")
    width = max((len(n) for n in tensors), default=0)
    total = 0
    for name in sorted(tensors):
        t = tensors[name]
        total += t.numel() * t.element_size()
        print(f"  {name:<{width}}  {str(t.dtype).removeprefix('torch.'):<9} {tuple(t.shape)}")
    # Tied weights are stored once; their other names would otherwise look missing.
    for alias, stored in sorted((header.get("aliases") or {}).items()):
        print(f"  model/{alias} is model/{stored} (tied, stored once)")
    print(f"  {total / 2**20:.2f} MiB of tensor data")
    return 0


def _brief(value: Any) -> Any:
    """``value`` with each tensor inside as its dtype and shape and each long list as its
    length: nested state (RNG states, a scheduler's) would print thousands of numbers."""
    if isinstance(value, torch.Tensor):
        return f"<tensor {dtype_name(value.dtype)} {tuple(value.shape)}>"
    if isinstance(value, dict):
        return {k: _brief(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        if len(value) > _LONG:
            return f"<{len(value)} items>"
        return type(value)(_brief(v) for v in value)
    return value


_LONG = 16
