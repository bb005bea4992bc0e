"""export_weights: a model's weights in another dtype, from its float32 masters."""

from __future__ import annotations

import torch

import mixprec as mp
from tests.checkpoint._helpers import trained
from tests.conftest import make_mlp


def test_export_weights(tmp_path):
    model, opt = trained("mixed_bfloat16", "O2")
    path = mp.export_weights(model, tmp_path / "w.safetensors", "bfloat16", optimizer=opt)
    tensors, _ = mp.read_checkpoint(path)
    assert tensors["model/0.weight"].dtype == torch.bfloat16
    masters = dict(opt.master_weights())
    assert torch.equal(tensors["model/0.weight"], masters[model[0].weight].bfloat16())
    fp32 = mp.export_weights(model, tmp_path / "w32.safetensors", optimizer=opt)
    fresh = make_mlp(seed=4)
    mp.load_checkpoint(fp32, fresh)
    assert torch.equal(fresh[0].weight, masters[model[0].weight])
