"""Checkpoints: round trips at every level and policy, dtype conversion with the range
report, plain state dicts, tampering, truncation, unsafe pickles, key mismatches."""

from __future__ import annotations

import copy
import json
import pickle
import random
import struct

import pytest
import torch
from safetensors.torch import load_file
from torch import nn

import mixprec as mp
from mixprec.checkpoint import _checksum
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


@pytest.mark.parametrize("sign", [1.0, -1.0])
def test_out_of_range_values_error_clamp_ignore(tmp_path, sign):
    big = make_mlp()
    with torch.no_grad():
        big[0].weight[0, 0] = sign * 1e6  # beyond float16's 65504
    path = mp.save_checkpoint(tmp_path / "big.safetensors", big)
    target = lambda: mp.auto_mixed_precision(make_mlp(), "mixed_float16", "O2")  # noqa: E731
    with pytest.raises(mp.CheckpointError, match=r"tensor '0.weight' has max \|value\| 1e\+06"):
        mp.load_checkpoint(path, target())
    clamped = target()
    report = mp.load_checkpoint(path, clamped, on_range="clamp")
    assert report.out_of_range == [("0.weight", 1e6, "float16", "clamp")]
    assert clamped[0].weight[0, 0].item() == sign * 65504.0
    ignored = target()
    mp.load_checkpoint(path, ignored, on_range="ignore")
    assert ignored[0].weight[0, 0].item() == sign * float("inf")
    with pytest.raises(ValueError, match="on_range='wrap' is invalid"):
        mp.load_checkpoint(path, target(), on_range="wrap")  # type: ignore[arg-type]


@pytest.mark.parametrize("sign", [1.0, -1.0])
def test_bfloat16_values_past_float16_clamp_to_its_max_not_to_inf(tmp_path, sign):
    """float16's max, 65504, is no bfloat16 value: clamped in bfloat16 it rounded to 65536,
    which is inf in float16."""
    source = make_mlp().to(torch.bfloat16)
    with torch.no_grad():
        source[0].weight[0, 0] = sign * 1e6
    path = mp.save_checkpoint(tmp_path / "bf16.safetensors", source)
    target = make_mlp().to(torch.float16)
    report = mp.load_checkpoint(path, target, on_range="clamp")
    assert [(name, how) for name, _, _, how in report.out_of_range] == [("0.weight", "clamp")]
    assert target[0].weight[0, 0].item() == sign * 65504.0
    assert torch.isfinite(target[0].weight).all()


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
    assert meta["format"] == "mixprec-checkpoint" and meta["format_version"] == 2
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


def _rewrite_header(path, edit, rehash=True):
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


# -- issue 15 items 2 and 5: values, dtypes, the header's schema and checksum, all or nothing


def _with_bad_values():
    model = make_mlp()
    with torch.no_grad():
        model[0].weight[0, :3] = torch.tensor([float("nan"), float("inf"), 1.0])
        model[5].bias[1] = float("-inf")
    return model


@pytest.mark.parametrize("on_range", ["error", "clamp"])
@pytest.mark.parametrize("level", ["O0", "O2"])
def test_non_finite_weights_are_refused_by_name(tmp_path, on_range, level):
    path = mp.save_checkpoint(tmp_path / "nan.safetensors", _with_bad_values())
    target = mp.auto_mixed_precision(make_mlp(seed=1), "mixed_float16", level)
    before = {k: v.clone() for k, v in target.state_dict().items()}
    # Before: loaded silently ('clamp' kept NaN and inf), and every step was then skipped.
    with pytest.raises(
        mp.CheckpointError,
        match=r"non-finite values in 2 tensor\(s\): '0.weight' \(1 NaN, 1 inf\), "
        r"'5.bias' \(0 NaN, 1 inf\).*on_range='ignore' loads them",
    ):
        mp.load_checkpoint(path, target, on_range=on_range)
    assert all(torch.equal(before[k], v) for k, v in target.state_dict().items())


def test_non_finite_values_load_under_ignore_and_in_optimizer_state_are_refused(tmp_path):
    path = mp.save_checkpoint(tmp_path / "nan.safetensors", _with_bad_values())
    model = make_mlp(seed=1)
    report = mp.load_checkpoint(path, model, on_range="ignore")
    assert report.non_finite == [("0.weight", 1, 1), ("5.bias", 0, 1)]
    assert "0.weight: 1 NaN, 1 inf (loaded as they are)" in str(report)
    assert model[0].weight[0, 0].isnan() and model[5].bias[1] == float("-inf")
    with pytest.raises(mp.CheckpointError, match=r"non-finite values in 2 tensor"):
        mp.convert_checkpoint(path, tmp_path / "out.safetensors", "bfloat16")

    model, opt = trained("mixed_bfloat16", "O2")
    with torch.no_grad():
        opt.optimizer.state[opt.optimizer.param_groups[0]["params"][0]]["exp_avg"][0, 0] = torch.nan
    path = mp.save_checkpoint(tmp_path / "opt.safetensors", model, opt)
    fresh = mp.auto_mixed_precision(make_mlp(), "mixed_bfloat16", "O2")
    fresh_opt = mp.LossScaleOptimizer(torch.optim.Adam(fresh.parameters(), lr=1e-2, eps=1e-4))
    with pytest.raises(
        mp.CheckpointError, match=r"'optim/optimizers/0/state/0/exp_avg' \(1 NaN, 0 inf\)"
    ):
        mp.load_checkpoint(path, fresh, fresh_opt)
    mp.load_checkpoint(path, make_mlp())  # the weights alone are finite


@pytest.mark.parametrize(
    ("dtype", "reason"),
    [
        (torch.complex64, "the imaginary parts would be dropped"),
        (torch.uint64, "quantized or foreign data"),
        (torch.bool, "booleans are flags"),
        (torch.int32, "quantized or foreign data"),
        (torch.float8_e4m3fn, "only with the scales stored beside them"),
    ],
)
def test_dtypes_that_do_not_convert_are_refused(tmp_path, dtype, reason):
    from safetensors.torch import save_file

    state = make_mlp().state_dict()
    state["3.weight"] = torch.ones(state["3.weight"].shape, dtype=dtype)
    save_file(state, tmp_path / "odd.safetensors")
    target = mp.auto_mixed_precision(make_mlp(seed=1), "mixed_bfloat16", "O2")
    before = {k: v.clone() for k, v in target.state_dict().items()}
    # Before: copied into the float32 LayerNorm weight with no `converted` entry (float8:
    # converted without its scales; into bfloat16, an unhandled NotImplementedError).
    name = str(dtype).removeprefix("torch.")
    with pytest.raises(
        mp.CheckpointError,
        match=rf"tensor '3.weight' is {name} in the checkpoint; it does not convert to "
        rf"float32 \(.*{reason}",
    ):
        mp.load_checkpoint(tmp_path / "odd.safetensors", target)
    assert all(torch.equal(before[k], v) for k, v in target.state_dict().items())
    if dtype == torch.float8_e4m3fn:  # listed by inspect; refused by convert too
        tensors, _ = mp.read_checkpoint(tmp_path / "odd.safetensors")
        assert tensors["model/3.weight"].dtype == torch.float8_e4m3fn
        with pytest.raises(mp.CheckpointError, match="does not convert to float16 .float8"):
            mp.convert_checkpoint(tmp_path / "odd.safetensors", tmp_path / "o.st", "float16")


def _entry(skeleton, *keys):
    """The node at ``keys`` in a ``_flatten`` skeleton (``__dict__`` pairs, lists)."""
    for key in keys:
        items = skeleton["__dict__"] if isinstance(skeleton, dict) else enumerate(skeleton)
        skeleton = next(v for k, v in items if k == key)
    return skeleton


def _set(skeleton, value, *keys):
    parent = _entry(skeleton, *keys[:-1])
    for pair in parent["__dict__"]:
        if pair[0] == keys[-1]:
            pair[1] = value


def _deep(levels):
    node = 1
    for _ in range(levels):
        node = [node]
    return node


@pytest.mark.parametrize(
    ("key", "value", "match"),
    [
        ("aliases", "abc", r"'aliases' is 'abc'; valid: an object mapping a state-dict key"),
        ("aliases", {"x": "nope"}, r"'aliases/x' is 'nope'; valid: the name of a stored model"),
        ("masters", 5, r"'masters' is 5; valid: a list of strings"),
        ("trainer_state", [1, 2], r"'trainer_state' is \[1, 2\]; valid: \{'__dict__'"),
        ("trainer_state", {"__dict__": [["step_in_epoch", -5]]},
         r"'trainer_state/step_in_epoch' is -5; valid: an int from 0 to 2\*\*63 - 1"),
        ("trainer_state", {"__dict__": [["epoch", 2**70]]}, r"'trainer_state/epoch' is 1180"),
        ("trainer_state", {"__dict__": [["data", _deep(80)]]},
         r"'trainer_state/data/0/0/0/0/0.*' is \[\[\[\[...\]\]\]\]; valid: at most 64 levels"),
        ("rng", "abc", r"'rng' is 'abc'; valid: null or \{'__dict__': \[\['torch'"),
        ("optimizer", {"__tensor__": "nope"}, r"'optimizer' is \{'__tensor__': 'nope'\}; valid"),
        ("optimizer", {"__dict__": [[[1], 2]]},
         r"'optimizer' is \[\[1\], 2\]; valid: a \[key, value\] pair with a scalar key"),
        ("format_version", "1", r"'format_version' is '1'; valid: an int from 1 to 2"),
        ("float8", {"recipe": 5, "converted": []}, r"'float8/recipe' is 5; valid: a string"),
        ("level", ["O2"], r"'level' is \['O2'\]; valid: a string or null"),
        ("checksum", 7, r"'checksum' is 7; valid: a SHA-256 digest"),
        ("extra", 1, r"'extra' is 1; valid: only the keys mixprec writes: format, "),
    ],
)  # fmt: skip
def test_header_of_the_wrong_types_is_refused_by_key(tmp_path, key, value, match):
    path = mp.save_checkpoint(tmp_path / "c.safetensors", make_mlp(), trainer_state={"step": 1})

    def edit(meta):
        meta[key] = value

    _rewrite_header(path, edit, rehash=key != "checksum")
    # Before: KeyError, AttributeError, TypeError, islice's ValueError, or a silent load.
    with pytest.raises(mp.CheckpointError, match=rf"c.safetensors: mixprec header: {match}"):
        mp.load_checkpoint(path, make_mlp(seed=1), restore_rng=True)


def test_rng_of_the_wrong_type_is_refused_before_the_weights_change(tmp_path):
    path = mp.save_checkpoint(tmp_path / "c.safetensors", make_mlp())
    _rewrite_header(path, lambda meta: _set(meta["rng"], {"__tuple__": [3, "abc", None]},
                                            "python"))  # fmt: skip
    model = make_mlp(seed=1)
    before = [p.clone() for p in model.parameters()]
    with pytest.raises(mp.CheckpointError, match=r"'rng/python' is \{'__tuple__'"):
        mp.load_checkpoint(path, model, restore_rng=True)
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))


def test_checksum_covers_the_header_and_format_1_files_still_load(tmp_path):
    model = make_mlp()
    path = mp.save_checkpoint(tmp_path / "c.safetensors", model)
    _rewrite_header(path, lambda meta: meta.update(level="O1"), rehash=False)
    # Before: the checksum covered the tensors only, and the edited header loaded.
    with pytest.raises(mp.CheckpointError, match="checksum mismatch: the header or tensors"):
        mp.load_checkpoint(path, make_mlp(seed=1))

    old = mp.save_checkpoint(tmp_path / "v1.safetensors", model)

    def format_1(meta):
        meta["format_version"] = 1
        meta["checksum"] = _checksum(load_file(old))  # tensors only, as format 1 wrote it

    _rewrite_header(old, format_1, rehash=False)
    fresh = make_mlp(seed=1)
    assert mp.load_checkpoint(old, fresh).metadata["format_version"] == 1
    assert torch.equal(fresh[0].weight, model[0].weight)
    data = bytearray(old.read_bytes())
    data[-5] ^= 0xFF
    old.write_bytes(bytes(data))
    with pytest.raises(mp.CheckpointError, match="checksum mismatch: the tensors were"):
        mp.load_checkpoint(old, make_mlp(seed=1))


def _state(model, opt):
    """Everything a load may change, copied."""
    return copy.deepcopy(
        {
            "model": model.state_dict(),
            "optimizer": opt.state_dict(),
            "scaler": opt.loss_scaler.state_dict(),
            "torch_rng": torch.get_rng_state(),
            "python_rng": random.getstate(),
        }
    )


def _same(a, b):
    if isinstance(a, torch.Tensor):
        return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    return a == b


_PARAM_0 = ("optimizers", 0, "state", 0)  # the inner Adam's state of the first parameter


def _python_rng_too_short(meta):
    _set(meta["rng"], {"__tuple__": [3, {"__tuple__": [1, 2]}, None]}, "python")


def _torch_rng_too_short(meta):
    _set(meta["rng"], {"__tensor__": "trainer/blob"}, "torch")


def _step_not_a_number(meta):
    _set(meta["optimizer"], "abc", *_PARAM_0, "step")


def _step_missing(meta):
    exp_avg = _entry(meta["optimizer"], *_PARAM_0, "exp_avg")
    _set(meta["optimizer"], {"__dict__": [["exp_avg", exp_avg]]}, *_PARAM_0)


def _extra_param_group(meta):
    groups = _entry(meta["optimizer"], "optimizers", 0, "param_groups")
    groups.append(groups[0])


def _negative_scale(meta):
    _set(meta["optimizer"], -1.0, "loss_scaler", "scale")


def _micro_steps_not_an_int(meta):
    _set(meta["optimizer"], "abc", "micro_steps")


@pytest.mark.parametrize(
    ("edit", "match"),
    [
        (_python_rng_too_short, r"RNG state cannot be restored \(state vector is the wrong size"),
        (_torch_rng_too_short, r"RNG state cannot be restored \(Expected a CPUGeneratorImpl"),
        (_step_not_a_number, "optimizer state does not fit this optimizer: ValueError"),
        (_step_missing, "optimizer state does not fit this optimizer: KeyError: 'step'"),
        (_extra_param_group, "ValueError: loaded state dict has a different number of param"),
        (_negative_scale, "loss scaler state does not load"),
        (_micro_steps_not_an_int, "optimizer state: 'micro_steps' is 'abc'; valid: an int >= 0"),
    ],
)
def test_a_failed_load_changes_nothing(tmp_path, edit, match):
    model, opt = trained("mixed_float16", "O2", steps=1)
    intact = mp.save_checkpoint(tmp_path / "intact.safetensors", model, opt)
    path = mp.save_checkpoint(
        tmp_path / "c.safetensors", model, opt, {"blob": torch.zeros(3, dtype=torch.uint8)}
    )
    _rewrite_header(path, edit)
    target, target_opt = trained("mixed_float16", "O2", steps=1, model=make_mlp(seed=4))
    torch.manual_seed(123)
    random.seed(123)
    before = _state(target, target_opt)
    # Before: the weights (and the first inner optimizer, the scaler, the torch RNG) were
    # already replaced when the optimizer or RNG state failed.
    with pytest.raises(mp.CheckpointError, match=match):
        mp.load_checkpoint(path, target, target_opt, restore_rng=True)
    assert _same(before, _state(target, target_opt))
    # The same load with the file intact does change all of it: the comparison can fail.
    mp.load_checkpoint(intact, target, target_opt, restore_rng=True)
    after = _state(target, target_opt)
    assert not any(_same(before[k], after[k]) for k in ("model", "optimizer", "torch_rng"))


class _Masked(nn.Module):
    """A causal mask buffer of -inf, as attention models register."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.register_buffer("mask", torch.full((4, 4), float("-inf")).triu(1))

    def forward(self, x):
        return (self.lin(x) @ (self.mask.exp())).sum(-1)


def test_non_finite_buffers_load_and_export_as_saved(tmp_path):
    # Review: the non-finite check refused a -inf mask buffer, which is normal; it covers
    # parameters and optimizer state only.
    model = _Masked()
    path = mp.save_checkpoint(tmp_path / "m.safetensors", model)
    again = _Masked()
    nn.init.zeros_(again.lin.weight)
    report = mp.load_checkpoint(path, again)
    assert report.non_finite == [] and torch.equal(again.lin.weight, model.lin.weight)
    mp.export_weights(model, tmp_path / "w.safetensors", "bfloat16")
    with torch.no_grad():
        model.lin.weight[0, 0] = float("nan")  # a parameter still is refused
    bad = mp.save_checkpoint(tmp_path / "bad.safetensors", model)
    with pytest.raises(mp.CheckpointError, match=r"'lin.weight' \(1 NaN, 0 inf\)"):
        mp.load_checkpoint(bad, _Masked())


@pytest.mark.parametrize(
    ("state", "match"),
    [
        ({"global_step": torch.tensor(5)}, "'trainer_state/global_step' is"),
        ({"epoch": None}, "'trainer_state/epoch' is None; valid: an int from 0 to 2"),
        ({"step_in_epoch": -5}, "'trainer_state/step_in_epoch' is -5"),
        ({"epoch_rng": torch.zeros(3)}, "'trainer_state/epoch_rng' is .*null or a uint8"),
    ],
)
def test_save_refuses_a_trainer_state_load_would_refuse(tmp_path, state, match):
    # Review: these saved, then load_checkpoint (and inspect, convert) refused the file.
    target = tmp_path / "t.safetensors"
    with pytest.raises(ValueError, match=f"save_checkpoint: {match}"):
        mp.save_checkpoint(target, make_mlp(), trainer_state=state)
    assert not target.exists()
