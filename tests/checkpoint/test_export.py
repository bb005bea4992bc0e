"""export_weights: a model's weights in another dtype, from its float32 masters;
convert_checkpoint onto its own source."""

from __future__ import annotations

import pytest
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


def test_convert_checkpoint_onto_its_source_needs_in_place_and_lists_what_it_drops(
    tmp_path, monkeypatch
):
    model, opt = trained("mixed_float16", "O2")
    path = mp.save_checkpoint(tmp_path / "c.safetensors", model, opt, {"global_step": 3})
    (tmp_path / "link.safetensors").symlink_to(path)
    original = path.read_bytes()
    monkeypatch.chdir(tmp_path)
    # The same file by name, through a symlink, and by a relative path.
    for destination in (path, tmp_path / "link.safetensors", "c.safetensors"):
        with pytest.raises(mp.ArgumentError, match=r"is the source file; .* in_place=True"):
            mp.convert_checkpoint(path, destination, "bfloat16")
        assert path.read_bytes() == original
    other = mp.convert_checkpoint(path, tmp_path / "w.safetensors", "bfloat16")
    assert other.dropped == [
        "optimizer state (LossScaleOptimizer over Adam)",
        "loss scaler state",
        "float32 master weights of 6 parameter(s) (written rounded to bfloat16)",
        "RNG states",
        "trainer state (global_step)",
        "policy and level (params=float32,compute=float16,output=float32, O2)",
    ]
    report = mp.convert_checkpoint("link.safetensors", path, "bfloat16", in_place=True)
    assert report.dropped == other.dropped
    tensors, header = mp.read_checkpoint(path)
    assert header.keys() == {"aliases"} and {t.dtype for t in tensors.values()} == {torch.bfloat16}
    assert mp.convert_checkpoint(path, path, in_place=True).dropped == []  # weights only now
