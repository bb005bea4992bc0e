"""Checkpoints: round trips at every level and policy, dtype conversion with the range
report, plain state dicts, tampering, truncation, unsafe pickles, key mismatches."""

from __future__ import annotations

import json
import pickle
import struct

import pytest
import torch
from torch import nn

import mixprec as mp
from tests.conftest import classification_data, make_mlp, make_transformer

LEVELS = ["O0", "O1", "O2", "O3"]
POLICIES = ["mixed_bfloat16", "mixed_float16"]


def trained(policy, level, steps=3, model=None):
    model = mp.auto_mixed_precision(model or make_mlp(), policy, level)
    opt = mp.LossScaleOptimizer(torch.optim.Adam(model.parameters(), lr=1e-2, eps=1e-4))
    x, y = classification_data(n=32)
    for _ in range(steps):
        opt.zero_grad()
        opt.backward(nn.functional.cross_entropy(model(x), y))
        opt.step()
    return model, opt


@pytest.mark.parametrize("level", LEVELS)
@pytest.mark.parametrize("policy", POLICIES)
def test_round_trip_every_level_and_policy(tmp_path, policy, level):
    model, opt = trained(policy, level)
    path = mp.save_checkpoint(tmp_path / "c.safetensors", model, opt, {"step": 3, "epoch": 1})
    model2 = mp.auto_mixed_precision(make_mlp(seed=9), policy, level)
    opt2 = mp.LossScaleOptimizer(torch.optim.Adam(model2.parameters(), lr=1e-2, eps=1e-4))
    report = mp.load_checkpoint(path, model2, opt2)
    for a, b in zip(model.parameters(), model2.parameters(), strict=True):
        assert a.dtype == b.dtype and torch.equal(a, b)
    for (_, m1), (_, m2) in zip(opt.master_weights(), opt2.master_weights(), strict=True):
        assert torch.equal(m1, m2) and m2.dtype == torch.float32
    assert opt2.loss_scaler.state == opt.loss_scaler.state
    assert report.trainer_state == {"step": 3, "epoch": 1}
    assert report.metadata["level"] == level
    assert report.metadata["policy"] == str(mp.Policy(policy))


def test_float32_checkpoint_into_16_bit_model_and_back(tmp_path):
    reference = make_mlp()
    path = mp.save_checkpoint(tmp_path / "f32.safetensors", reference)
    half = mp.auto_mixed_precision(make_mlp(seed=5), "mixed_float16", "O2")
    report = mp.load_checkpoint(path, half)
    assert ("0.weight", "float32", "float16") in report.converted
    assert ("3.weight", "float32", "float16") not in report.converted  # LayerNorm: float32
    assert half[0].weight.dtype == torch.float16
    assert torch.equal(half[0].weight, reference[0].weight.half())
    # A LossScaleOptimizer built afterwards starts from the exact float32 values.
    opt = mp.LossScaleOptimizer(torch.optim.SGD(half.parameters(), lr=0.1))
    masters = dict(opt.master_weights())
    assert torch.equal(masters[half[0].weight], reference[0].weight)
    # and back: the 16-bit model's checkpoint (masters, float32) into a float32 model
    back = make_mlp(seed=7)
    path2 = mp.save_checkpoint(tmp_path / "half.safetensors", half, opt)
    report2 = mp.load_checkpoint(path2, back)
    assert report2.converted == []  # masters were stored: float32 already
    assert torch.equal(back[0].weight, reference[0].weight)


def test_out_of_range_values_error_clamp_ignore(tmp_path):
    big = make_mlp()
    with torch.no_grad():
        big[0].weight[0, 0] = 1e6  # beyond float16's 65504
    path = mp.save_checkpoint(tmp_path / "big.safetensors", big)
    target = lambda: mp.auto_mixed_precision(make_mlp(), "mixed_float16", "O2")  # noqa: E731
    with pytest.raises(mp.CheckpointError, match=r"tensor '0.weight' has max \|value\| 1e\+06"):
        mp.load_checkpoint(path, target())
    clamped = target()
    report = mp.load_checkpoint(path, clamped, on_range="clamp")
    assert report.out_of_range == [("0.weight", 1e6, "float16", "clamp")]
    assert clamped[0].weight[0, 0].item() == 65504.0
    ignored = target()
    mp.load_checkpoint(path, ignored, on_range="ignore")
    assert ignored[0].weight[0, 0].item() == float("inf")
    with pytest.raises(ValueError, match="on_range='wrap' is invalid"):
        mp.load_checkpoint(path, target(), on_range="wrap")  # type: ignore[arg-type]


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


def test_tied_weights_are_stored_once(tmp_path):
    class Tied(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = nn.Embedding(10, 4)
            self.head = nn.Linear(4, 10, bias=False)
            self.head.weight = self.embed.weight

        def forward(self, ids):
            return self.head(self.embed(ids))

    torch.manual_seed(0)
    model = mp.auto_mixed_precision(Tied(), "mixed_bfloat16", "O2")
    opt = mp.LossScaleOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    path = mp.save_checkpoint(tmp_path / "t.safetensors", model, opt)
    tensors, header = mp.read_checkpoint(path)
    assert header["aliases"] == {"head.weight": "embed.weight"}
    assert tensors["model/embed.weight"].dtype == torch.float32  # the master
    torch.manual_seed(1)
    other = mp.auto_mixed_precision(Tied(), "mixed_bfloat16", "O2")
    mp.load_checkpoint(path, other)
    assert torch.equal(other.head.weight, model.head.weight)


def test_key_mismatches_listed_in_one_error(tmp_path):
    path = mp.save_checkpoint(tmp_path / "mlp.safetensors", make_mlp())
    wider = make_mlp(hidden=80)
    with pytest.raises(mp.CheckpointError, match="does not match the model") as err:
        mp.load_checkpoint(path, wider)
    text = str(err.value)
    assert "shape mismatch 0.weight: saved (64, 32), model (80, 32)" in text
    other = nn.Sequential(nn.Linear(32, 64), nn.Linear(64, 10))
    with pytest.raises(mp.CheckpointError) as err:
        mp.load_checkpoint(path, other)
    assert "missing: 1.weight, 1.bias" in str(err.value)
    assert "unexpected: 2.bias, 2.weight, 3.bias, 3.weight, 5.bias, 5.weight" in str(err.value)
    report = mp.load_checkpoint(path, other, strict=False)
    assert report.missing == ["1.weight", "1.bias"] and torch.equal(
        other[0].weight, make_mlp()[0].weight
    )


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
    assert meta["format"] == "mixprec-checkpoint" and meta["format_version"] == 1
    with pytest.raises(mp.CheckpointError, match="no such checkpoint file"):
        mp.load_checkpoint(tmp_path / "absent.safetensors", make_mlp())
    with pytest.raises(mp.CheckpointError, match="holds no optimizer state"):
        mp.load_checkpoint(path, make_mlp(), torch.optim.SGD(make_mlp().parameters(), lr=0.1))


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


def _rewrite_header(path, edit):
    """Rewrite a checkpoint's mixprec JSON header in place (the checksum covers tensors)."""
    raw = path.read_bytes()
    length = struct.unpack("<Q", raw[:8])[0]
    header = json.loads(raw[8 : 8 + length])
    meta = json.loads(header["__metadata__"]["mixprec"])
    edit(meta)
    header["__metadata__"]["mixprec"] = json.dumps(meta)
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    path.write_bytes(struct.pack("<Q", len(text)) + text + raw[8 + length :])


def test_damaged_optimizer_state_message_does_not_contradict_itself(tmp_path):
    model = mp.auto_mixed_precision(make_mlp(), "mixed_bfloat16", "O2")
    opt = mp.LossScaleOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    path = mp.save_checkpoint(tmp_path / "c.safetensors", model, opt)

    def drop(meta):
        del meta["optimizer"]["__dict__"][0]  # the first saved key: 'optimizers'

    _rewrite_header(path, drop)
    fresh = mp.auto_mixed_precision(make_mlp(), "mixed_bfloat16", "O2")
    fresh_opt = mp.LossScaleOptimizer(torch.optim.SGD(fresh.parameters(), lr=0.1))
    # Before: "optimizer state is from a LossScaleOptimizer, not a LossScaleOptimizer".
    with pytest.raises(mp.CheckpointError, match="has no 'optimizers' entry"):
        mp.load_checkpoint(path, fresh, fresh_opt)


def test_reading_a_directory_says_it_is_one(tmp_path):
    mp.save_checkpoint(tmp_path / "c.safetensors", make_mlp())
    with pytest.raises(
        mp.CheckpointError, match=r"is a directory, not a checkpoint file \(it holds c"
    ):
        mp.read_checkpoint(tmp_path)
