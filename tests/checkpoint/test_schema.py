"""The mixprec header's schema: a value of the wrong type or range is refused by its key,
before the model changes."""

from __future__ import annotations

import pytest
import torch

import mixprec as mp
from tests.checkpoint._helpers import rewrite_header, set_node
from tests.conftest import make_mlp


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
        ("format_version", "1", r"'format_version' is '1'; valid: an int from 1 to 3"),
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

    rewrite_header(path, edit, rehash=key != "checksum")
    # A CheckpointError naming the key, not a KeyError, AttributeError, TypeError, islice's
    # ValueError or a silent load.
    with pytest.raises(mp.CheckpointError, match=rf"c.safetensors: mixprec header: {match}"):
        mp.load_checkpoint(path, make_mlp(seed=1), restore_rng=True)


def test_rng_of_the_wrong_type_is_refused_before_the_weights_change(tmp_path):
    path = mp.save_checkpoint(tmp_path / "c.safetensors", make_mlp())
    rewrite_header(path, lambda meta: set_node(meta["rng"], {"__tuple__": [3, "abc", None]},
                                            "python"))  # fmt: skip
    model = make_mlp(seed=1)
    before = [p.clone() for p in model.parameters()]
    with pytest.raises(mp.CheckpointError, match=r"'rng/python' is \{'__tuple__'"):
        mp.load_checkpoint(path, model, restore_rng=True)
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))


@pytest.mark.parametrize(
    ("entry", "match"),
    [
        (5, r"trainer_state/rank_rng/1 is a int, not a generator-state dict"),
        ({"python": (3, [0], None)}, r"its RNG state cannot be restored \('torch'\)"),
    ],
)
def test_a_ranks_rng_entry_that_does_not_load_is_refused_before_the_weights_change(
    tmp_path, monkeypatch, entry, match
):
    """Under torchrun, rank 1 takes its own entry of ``rank_rng``: a bad one raised a raw
    TypeError or KeyError, after the weights had changed."""
    from mixprec import distributed
    from mixprec.checkpoint import rng_state

    state = {"rank_rng": [rng_state(), entry]}
    path = mp.save_checkpoint(tmp_path / "c.safetensors", make_mlp(), trainer_state=state)
    monkeypatch.setattr(distributed, "world_size", lambda: 2)
    monkeypatch.setattr(distributed, "rank", lambda: 1)
    model = make_mlp(seed=1)
    before = [p.clone() for p in model.parameters()]
    with pytest.raises(mp.CheckpointError, match=match):
        mp.load_checkpoint(path, model, restore_rng=True)
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))
    monkeypatch.setattr(distributed, "rank", lambda: 0)  # rank 0 takes the file's own
    mp.load_checkpoint(path, model, restore_rng=True)


@pytest.mark.parametrize(
    ("key", "value", "match"),
    [
        ("policy", "banana", r"'policy' is 'banana'; valid: null or a policy string such as"),
        ("policy", "auto", r"'policy' is 'auto'; valid: null or a policy string"),
        ("level", "O7", r"'level' is 'O7'; valid: null or one of O0, O1, O2, O3"),
        ("masters", ["0.weight", "nope"],
         r"'masters/1' is 'nope'; valid: the name of a stored model tensor"),
        ("masters", ["0.weight", "0.weight"], r"'masters' is .*; valid: a list of distinct"),
        ("optimizer_kind", "Adam W", r"'optimizer_kind' is 'Adam W'; valid: null or an optim"),
        ("optimizer_kind", "SGD",
         r"'optimizer_classes' is \['Adam'\]; valid: \['SGD'\], as 'optimizer_kind' says"),
        ("optimizer_classes", [], r"'optimizer_classes' is \[\]; valid: null or a non-empty"),
        ("optimizer_classes", ["Adam", "SGD"],
         r"'optimizer_classes' is \['Adam', 'SGD'\]; valid: \['Adam'\], as 'optimizer_kind'"),
        ("optimizer_classes", None, r"'optimizer_classes' is None; valid: null exactly when"),
    ],
)  # fmt: skip
def test_header_values_that_mean_nothing_are_refused_by_key(tmp_path, key, value, match):
    model = mp.auto_mixed_precision(make_mlp(), "mixed_bfloat16", "O2")
    opt = torch.optim.Adam(model.parameters())
    path = mp.save_checkpoint(tmp_path / "c.safetensors", model, opt)

    def edit(meta):
        meta[key] = value

    rewrite_header(path, edit)
    with pytest.raises(mp.CheckpointError, match=rf"c.safetensors: mixprec header: {match}"):
        mp.load_checkpoint(path, mp.auto_mixed_precision(make_mlp(), "mixed_bfloat16", "O2"))


def test_optimizer_kind_without_optimizer_state_is_refused(tmp_path):
    path = mp.save_checkpoint(tmp_path / "c.safetensors", make_mlp())
    rewrite_header(path, lambda meta: meta.update(optimizer_kind="banana"))
    with pytest.raises(mp.CheckpointError, match=r"'optimizer_kind' is 'banana'; valid: null ex"):
        mp.load_checkpoint(path, make_mlp(seed=1))
