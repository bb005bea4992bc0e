"""The format's checksum: format 2 covers the header and the tensors; format 1 files, whose
checksum covers the tensors only, still load."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

import mixprec as mp
from mixprec.checkpoint import _checksum
from tests.checkpoint._helpers import rewrite_header
from tests.conftest import make_mlp


def test_checksum_covers_the_header_and_format_1_files_still_load(tmp_path):
    model = make_mlp()
    path = mp.save_checkpoint(tmp_path / "c.safetensors", model)
    rewrite_header(path, lambda meta: meta.update(level="O1"), rehash=False)
    # Format 2's checksum covers the header too: an edited header does not load.
    with pytest.raises(mp.CheckpointError, match="checksum mismatch: the header or tensors"):
        mp.load_checkpoint(path, make_mlp(seed=1))

    old = mp.save_checkpoint(tmp_path / "v1.safetensors", model)

    def format_1(meta):
        meta["format_version"] = 1
        meta["checksum"] = _checksum(load_file(old))  # tensors only, as format 1 wrote it

    rewrite_header(old, format_1, rehash=False)
    fresh = make_mlp(seed=1)
    assert mp.load_checkpoint(old, fresh).metadata["format_version"] == 1
    assert torch.equal(fresh[0].weight, model[0].weight)
    data = bytearray(old.read_bytes())
    data[-5] ^= 0xFF
    old.write_bytes(bytes(data))
    with pytest.raises(mp.CheckpointError, match="checksum mismatch: the tensors were"):
        mp.load_checkpoint(old, make_mlp(seed=1))
