"""read_checkpoint: plain state dicts and safetensors files, truncation and tampering, unsafe
pickles, a header length that looks like a pickle, a directory."""

from __future__ import annotations

import json
import pickle
import struct
import subprocess
import sys
import time

import pytest
import torch
from torch import nn

import mixprec as mp
from tests.checkpoint._helpers import LEVELS
from tests.conftest import make_mlp, make_transformer


def test_plain_torch_state_dict_and_safetensors_files(tmp_path):
    reference = make_transformer()
    torch.save(reference.state_dict(), tmp_path / "plain.pt")
    torch.save({"state_dict": reference.state_dict(), "epoch": 3}, tmp_path / "nested.pt")
    from safetensors.torch import save_file

    save_file(reference.state_dict(), tmp_path / "plain.safetensors")
    for name in ("plain.pt", "nested.pt", "plain.safetensors"):
        for level in LEVELS:
            model = mp.auto_mixed_precision(make_transformer(seed=3), "mixed_bfloat16", level)
            mp.load_checkpoint(tmp_path / name, model)
            for (key, a), b in zip(reference.state_dict().items(), model.state_dict().values(),
                                   strict=True):  # fmt: skip
                assert torch.equal(a.to(b.dtype), b), (name, level, key)


def test_tampered_and_truncated_files(tmp_path):
    path = mp.save_checkpoint(tmp_path / "c.safetensors", make_mlp())
    data = bytearray(path.read_bytes())
    tampered = tmp_path / "tampered.safetensors"
    data[-5] ^= 0xFF  # flip bits in the last tensor's bytes
    tampered.write_bytes(bytes(data))
    with pytest.raises(mp.CheckpointError, match="tampered.safetensors: checksum mismatch"):
        mp.load_checkpoint(tampered, make_mlp())
    truncated = tmp_path / "truncated.safetensors"
    truncated.write_bytes(path.read_bytes()[:-100])
    with pytest.raises(mp.CheckpointError, match="truncated.safetensors: truncated or corrupt"):
        mp.load_checkpoint(truncated, make_mlp())
    header_len = struct.unpack("<Q", path.read_bytes()[:8])[0]
    header = json.loads(path.read_bytes()[8 : 8 + header_len])
    meta = json.loads(header["__metadata__"]["mixprec"])
    assert meta["format"] == "mixprec-checkpoint" and meta["format_version"] == 3
    with pytest.raises(mp.CheckpointError, match="no such checkpoint file"):
        mp.load_checkpoint(tmp_path / "absent.safetensors", make_mlp())
    with pytest.raises(mp.CheckpointError, match="holds no optimizer state"):
        fresh = make_mlp()
        mp.load_checkpoint(path, fresh, torch.optim.SGD(fresh.parameters(), lr=0.1))


class _Boom:
    """Unpickling this would create the marker file."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return (open, (self.marker, "w"))


def test_malicious_pickle_is_refused_without_running(tmp_path):
    marker = tmp_path / "pwned"
    for name, dump in (
        ("evil.pt", lambda f: torch.save({"w": torch.ones(2), "x": _Boom(str(marker))}, f)),
        ("evil.pkl", lambda f: pickle.dump({"w": _Boom(str(marker))}, f)),
    ):
        path = tmp_path / name
        with path.open("wb") as f:
            dump(f)
        assert not marker.exists()
        with pytest.raises(mp.CheckpointError, match=rf"{name}: refused"):
            mp.load_checkpoint(path, make_mlp())
        assert not marker.exists()


def test_header_length_that_looks_like_a_pickle(tmp_path):
    """A safetensors header length whose first byte is 0x80 (a pickle's first byte) must
    still be read as a mixprec checkpoint, with its header."""
    model = make_mlp()
    for pad in range(300):
        path = mp.save_checkpoint(tmp_path / "c.safetensors", model, trainer_state={"p": "x" * pad})
        if path.read_bytes()[0] == 0x80:
            break
    else:
        raise AssertionError("no padding gave a 0x80 first byte")
    _, header = mp.read_checkpoint(path)
    assert header["format"] == "mixprec-checkpoint"
    assert mp.load_checkpoint(path, make_mlp(seed=3)).trainer_state["p"] == "x" * pad
    junk = tmp_path / "junk.bin"
    junk.write_bytes(b"hello world, not a checkpoint")
    with pytest.raises(mp.CheckpointError, match="junk.bin: truncated, corrupt, or not a"):
        mp.read_checkpoint(junk)


def test_reading_a_directory_says_it_is_one(tmp_path):
    mp.save_checkpoint(tmp_path / "c.safetensors", make_mlp())
    with pytest.raises(
        mp.CheckpointError, match=r"is a directory, not a checkpoint file \(it holds c"
    ):
        mp.read_checkpoint(tmp_path)


_WRITER = """
import sys, torch, mixprec as mp
model = torch.nn.Linear(64, 64)
for i in range(1_000_000):
    with torch.no_grad():
        model.weight.fill_(i)
    mp.save_checkpoint(sys.argv[1], model, trainer_state={"i": i})
    if i == 0:
        print("ready", flush=True)
"""


def test_loads_while_another_process_replaces_the_file_see_one_whole_checkpoint(tmp_path):
    # Each load reads header and tensors through one open file: a replace between two opens
    # of the path would pair one file's header with another's tensors (a checksum mismatch).
    path = tmp_path / "c.safetensors"
    writer = subprocess.Popen(
        [sys.executable, "-c", _WRITER, str(path)], stdout=subprocess.PIPE, text=True
    )
    try:
        assert writer.stdout is not None and writer.stdout.readline() == "ready\n"
        model = nn.Linear(64, 64)
        seen, loads, deadline = set(), 0, time.monotonic() + 10
        # At least 40 loads, across several of the writer's files.
        while loads < 40 or (len(seen) < 3 and time.monotonic() < deadline):
            report = mp.load_checkpoint(path, model)
            step = report.trainer_state["i"]
            assert bool((model.weight == step).all()), step  # weights of that same save
            seen.add(step)
            loads += 1
        assert len(seen) >= 3  # the file was replaced while it was being loaded
    finally:
        writer.kill()
        writer.wait()


def test_a_torch_style_o2_checkpoints_masters_beside_its_weights_are_said(tmp_path, capsys):
    """``{"model": model.state_dict(), "optimizer": opt.state_dict()}`` at O2 (the migration
    guide's Apex-style save): ``load_checkpoint`` and ``mixprec convert`` read the 16-bit
    weights (9.6e-4 off the masters beside them), saying "0 tensors converted"; with an
    optimizer, "holds no optimizer state", though one was there."""
    from mixprec import cli
    from tests.checkpoint._helpers import trained

    model, opt = trained("mixed_bfloat16", "O2")
    path = tmp_path / "run.pt"
    torch.save({"model": model.state_dict(), "optimizer": opt.state_dict(), "epoch": 3}, path)
    said = r"run\.pt: its 'model' entry holds 16-bit weights whose float32 masters are in its "
    with pytest.warns(UserWarning, match=said + r"'optimizer' entry .*opt\.load_state_dict"):
        mp.load_checkpoint(path, make_mlp())
    with pytest.warns(UserWarning, match=said), pytest.raises(
        mp.CheckpointError, match=r"holds no optimizer state mixprec reads: a torch\.save file, "
        r"whose entries beside the weights \(epoch, optimizer\) are not read"
    ):  # fmt: skip
        fresh = make_mlp()
        mp.load_checkpoint(path, fresh, mp.LossScaleOptimizer(torch.optim.Adam(fresh.parameters())))
    out = tmp_path / "out.safetensors"
    with pytest.warns(UserWarning, match=said):
        assert cli.main(["convert", str(path), str(out), "--dtype", "float32"]) == 0
    assert "dropped: the file's other entries (epoch, optimizer)" in capsys.readouterr().out
    # The same save of a float32 run, or of weights alone, says nothing.
    plain = make_mlp()
    torch.save({"model": plain.state_dict(), "optimizer": torch.optim.Adam(
        plain.parameters()).state_dict()}, tmp_path / "f32.pt")  # fmt: skip
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        mp.load_checkpoint(tmp_path / "f32.pt", make_mlp())


@pytest.mark.parametrize("level", ["O1", "O3"])
def test_a_torch_style_checkpoint_without_masters_says_nothing(tmp_path, level):
    # A LossScaleOptimizer's state has a master_weights entry at every level, empty at O1
    # and O3 (no masters): nothing lies unread beside the weights.
    import warnings

    from tests.checkpoint._helpers import trained

    model, opt = trained("mixed_bfloat16", level)
    torch.save({"model": model.state_dict(), "optimizer": opt.state_dict()}, tmp_path / "r.pt")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        mp.read_checkpoint(tmp_path / "r.pt")
