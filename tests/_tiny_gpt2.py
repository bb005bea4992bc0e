"""A tiny seeded GPT-2 language model for the Hugging Face and accelerate tests."""

from __future__ import annotations

import torch
import transformers
from torch import nn


def tiny_gpt2(vocab: int, seq: int) -> nn.Module:
    """2 layers, width 32, no dropout, weights from seed 0; the global RNG is left alone."""
    with torch.random.fork_rng():
        torch.manual_seed(0)
        config = transformers.GPT2Config(
            n_layer=2,
            n_head=2,
            n_embd=32,
            vocab_size=vocab,
            n_positions=seq,
            resid_pdrop=0.0,
            embd_pdrop=0.0,
            attn_pdrop=0.0,
            bos_token_id=vocab - 1,
            eos_token_id=vocab - 1,
        )
        model = transformers.GPT2LMHeadModel(config)
    # Unset, transformers warns from loss_function on every forward.
    model.loss_type = "ForCausalLM"
    return model


def counting_rows(n: int, vocab: int, seq: int, seed: int = 0) -> list[dict[str, torch.Tensor]]:
    """Rows counting up from a random start by a stride of 1-3 (mod vocab): learnable."""
    g = torch.Generator().manual_seed(seed)
    start = torch.randint(0, vocab, (n, 1), generator=g)
    stride = torch.randint(1, 4, (n, 1), generator=g)
    ids = (start + stride * torch.arange(seq)) % vocab
    return [{"input_ids": row, "labels": row} for row in ids]
