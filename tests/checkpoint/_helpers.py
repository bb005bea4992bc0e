"""Helpers shared by the checkpoint tests: a briefly trained model, and a checkpoint's
mixprec header rewritten in place."""

from __future__ import annotations

import json
import struct

import torch
from safetensors.torch import load_file
from torch import nn

import mixprec as mp
from mixprec.checkpoint import _checksum
from tests.conftest import classification_data, make_mlp

LEVELS = ["O0", "O1", "O2", "O3"]
POLICIES = ["mixed_bfloat16", "mixed_float16"]


def trained(policy, level, steps=3, model=None):
    """``model`` (an MLP by default) under ``policy`` and ``level``, with a
    ``LossScaleOptimizer`` over Adam after ``steps`` steps: masters, moments, a scale."""
    model = mp.auto_mixed_precision(model or make_mlp(), policy, level)
    opt = mp.LossScaleOptimizer(torch.optim.Adam(model.parameters(), lr=1e-2, eps=1e-4))
    x, y = classification_data(n=32)
    for _ in range(steps):
        opt.zero_grad()
        opt.backward(nn.functional.cross_entropy(model(x), y))
        opt.step()
    return model, opt


def rewrite_header(path, edit, rehash=True):
    """Rewrite a checkpoint's mixprec JSON header in place; with ``rehash``, with the
    checksum a writer would give it (so that what is tested is the header's checking)."""
    raw = path.read_bytes()
    length = struct.unpack("<Q", raw[:8])[0]
    header = json.loads(raw[8 : 8 + length])
    meta = json.loads(header["__metadata__"]["mixprec"])
    edit(meta)
    if rehash:
        meta["checksum"] = _checksum(load_file(path), meta)
    header["__metadata__"]["mixprec"] = json.dumps(meta)
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    path.write_bytes(struct.pack("<Q", len(text)) + text + raw[8 + length :])


def node_at(skeleton, *keys):
    """The node at ``keys`` in a ``_flatten`` skeleton (``__dict__`` pairs, lists)."""
    for key in keys:
        items = skeleton["__dict__"] if isinstance(skeleton, dict) else enumerate(skeleton)
        skeleton = next(v for k, v in items if k == key)
    return skeleton


def set_node(skeleton, value, *keys):
    """Set the ``__dict__`` entry at ``keys`` in a ``_flatten`` skeleton to ``value``."""
    parent = node_at(skeleton, *keys[:-1])
    for pair in parent["__dict__"]:
        if pair[0] == keys[-1]:
            pair[1] = value
