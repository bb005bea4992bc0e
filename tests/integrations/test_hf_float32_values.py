"""``float32_from_checkpoint``: the float32 values of a Trainer checkpoint taken back into a
16-bit model (MixprecTrainer's resume and best model), a tied weight included."""

from __future__ import annotations

import torch
from safetensors.torch import save_file
from torch import nn

import mixprec as mp
from mixprec._float32_copies import current_float32_copy
from mixprec.integrations._hf_prepare import float32_from_checkpoint


class _Tied(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(8, 4)
        self.head = nn.Linear(4, 8, bias=False)
        self.head.weight = self.embed.weight  # one tensor, two names


def test_a_tied_weight_stored_under_its_second_name_is_taken_back(tmp_path):
    """The file holds a tied weight once, under either name: only the first name was
    looked up, so a weight stored as ``head.weight`` kept its 16-bit rounding."""
    torch.manual_seed(0)
    values = torch.randn(8, 4)
    model = mp.auto_mixed_precision(_Tied(), "mixed_bfloat16", "O2")
    mp.release_float32_copies(model)
    with torch.no_grad():
        model.embed.weight.copy_(values.to(model.embed.weight.dtype))
    save_file({"head.weight": values}, str(tmp_path / "model.safetensors"))
    float32_from_checkpoint(model, str(tmp_path))
    kept = current_float32_copy(model.embed.weight)
    assert kept is not None and torch.equal(kept, values)
