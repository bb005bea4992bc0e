"""save_checkpoint: round trips at every level and policy, tied weights stored once, and
the trainer states a load would refuse refused when saving."""

from __future__ import annotations

import errno

import pytest
import torch
from safetensors import SafetensorError
from torch import nn

import mixprec as mp
from tests.checkpoint._helpers import LEVELS, POLICIES, trained
from tests.conftest import make_mlp


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
    # What load_checkpoint (and inspect, convert) would refuse is refused when saving.
    target = tmp_path / "t.safetensors"
    with pytest.raises(ValueError, match=f"save_checkpoint: {match}"):
        mp.save_checkpoint(target, make_mlp(), trainer_state=state)
    assert not target.exists()


def test_save_refuses_a_directory_path(tmp_path):
    folder = tmp_path / "ckpts"
    folder.mkdir()
    with pytest.raises(mp.ArgumentError) as info:
        mp.save_checkpoint(folder, make_mlp())
    assert str(info.value) == (
        f"save_checkpoint: path {str(folder)!r} is a directory; "
        "valid: a file path (e.g. 'ckpt.safetensors') in an existing or new directory"
    )
    assert list(folder.iterdir()) == []


def test_save_refuses_a_path_under_a_file(tmp_path):
    blocker = tmp_path / "notes.txt"
    blocker.write_text("x")
    target = blocker / "sub" / "c.safetensors"
    with pytest.raises(mp.ArgumentError) as info:
        mp.save_checkpoint(target, make_mlp())
    assert str(info.value) == (
        f"save_checkpoint: path {str(target)!r} is under {str(blocker)!r}, "
        "which is a file; valid: a file path in an existing or new directory"
    )
    assert blocker.read_text() == "x"


def test_disk_full_names_the_path_and_keeps_the_previous_checkpoint(tmp_path, monkeypatch):
    target = tmp_path / "c.safetensors"
    mp.save_checkpoint(target, make_mlp(seed=1))
    before = target.read_bytes()

    def full(*args, **kwargs):  # as safetensors 0.8 reports it (seen on a full tmpfs)
        raise SafetensorError(
            "Error while serializing: I/O error: No space left on device (os error 28)"
        )

    monkeypatch.setattr("mixprec.checkpoint._files.save_file", full)
    with pytest.raises(OSError) as info:
        mp.save_checkpoint(target, make_mlp(seed=2))
    assert info.value.errno == errno.ENOSPC
    assert str(info.value) == (
        f"[Errno 28] no space left on device while writing checkpoint {str(target)!r}; "
        "the previous checkpoint there is intact"
    )
    assert target.read_bytes() == before
    assert [p.name for p in tmp_path.iterdir()] == ["c.safetensors"]


def test_the_optimizer_a_loss_scale_optimizer_wraps_is_refused(tmp_path):
    """``save_checkpoint(path, model, inner)`` with the torch optimizer the wrapper holds:
    the loss scale went back from 524288 to 65536 on resume and the masters came back
    rounded to 16 bits (2.6e-3 apart after 10 steps), saying nothing."""
    model = mp.auto_mixed_precision(make_mlp(), "mixed_float16", "O2")
    inner = torch.optim.Adam(model.parameters(), lr=1e-2)
    opt = mp.LossScaleOptimizer(inner)
    path = tmp_path / "c.safetensors"
    mp.save_checkpoint(path, model, opt)
    before = path.read_bytes()
    refused = r"\(optimizer=Adam\) is the optimizer a LossScaleOptimizer wraps: .*Pass the Loss"
    with pytest.raises(mp.ArgumentError, match="save_checkpoint" + refused):
        mp.save_checkpoint(path, model, inner)
    assert path.read_bytes() == before  # the checkpoint there is left as it was
    with pytest.raises(mp.ArgumentError, match="load_checkpoint" + refused):
        mp.load_checkpoint(path, model, inner)
    with pytest.raises(mp.ArgumentError, match="export_weights" + refused):
        mp.export_weights(model, tmp_path / "w.safetensors", optimizer=inner)


@pytest.mark.parametrize("case", ["head replaced", "one optimizer, two models"])
def test_masters_of_weights_the_model_does_not_hold_are_refused(tmp_path, case):
    """The file saved without a word and no load could restore it ("no saved weight for
    the master of a (4, 32) weight"): a head replaced after the optimizer was built, or one
    optimizer over two models saved with one of them. The previous checkpoint stays."""
    model = mp.auto_mixed_precision(make_mlp(), "mixed_bfloat16", "O2")
    other = mp.auto_mixed_precision(make_mlp(seed=3), "mixed_bfloat16", "O2")
    params = list(model.parameters())
    if case != "head replaced":
        params += list(other.parameters())
    opt = mp.LossScaleOptimizer(torch.optim.SGD(params, lr=0.1))
    path = mp.save_checkpoint(tmp_path / "c.safetensors", model)
    before = path.read_bytes()
    if case == "head replaced":
        model[-1] = nn.Linear(model[-1].in_features, 6)
    with pytest.raises(
        mp.ArgumentError,
        match=r"keeps float32 masters for \d+ weight\(s\) "
        r"the model does not hold \(a \(\d+, \d+\) weight.*nn.ModuleDict",
    ):
        mp.save_checkpoint(path, model, opt)
    assert path.read_bytes() == before
    both = nn.ModuleDict({"a": model, "b": other})
    if case != "head replaced":  # the remedy the message names loads back
        mp.load_checkpoint(mp.save_checkpoint(tmp_path / "both.safetensors", both, opt), both, opt)


def test_an_optimizer_over_another_model_is_refused_and_nothing_is_written(tmp_path):
    """save_checkpoint(path, model_a, optimizer_over_b) wrote b's Adam moments, names all
    "", and load_checkpoint then put them into c's optimizer by position, unsaid."""
    a, b = make_mlp(seed=0), make_mlp(seed=1)
    opt_b = torch.optim.Adam(b.parameters(), lr=0.1)
    b(torch.randn(2, 32)).sum().backward()
    opt_b.step()
    path = tmp_path / "mix.safetensors"
    with pytest.raises(mp.ArgumentError, match=r"save_checkpoint: the optimizer holds none of "
                       r"the model's parameters \(its 8 are another model's\)"):  # fmt: skip
        mp.save_checkpoint(path, a, opt_b)
    assert not path.exists()
    with pytest.raises(mp.ArgumentError, match=r"export_weights: the optimizer holds none"):
        mp.export_weights(a, tmp_path / "export.safetensors", optimizer=opt_b)
    # Loaded, a's moments went into b's optimizer the same way: refused, b's state kept.
    opt_a = torch.optim.Adam(a.parameters(), lr=0.1)
    a(torch.randn(2, 32)).sum().backward()
    opt_a.step()
    good = mp.save_checkpoint(tmp_path / "a.safetensors", a, opt_a)
    kept = opt_b.state[next(b.parameters())]["exp_avg"].clone()
    with pytest.raises(mp.ArgumentError, match=r"load_checkpoint: the optimizer holds none"):
        mp.load_checkpoint(good, make_mlp(seed=2), opt_b)
    assert torch.equal(opt_b.state[next(b.parameters())]["exp_avg"], kept)


def test_a_model_with_nan_weights_is_saved_and_said_to_load_only_with_ignore(tmp_path):
    model = make_mlp()
    with torch.no_grad():
        model[0].weight[0, 0] = float("nan")
    path = tmp_path / "nan.safetensors"
    with pytest.warns(UserWarning, match=r"1 parameter\(s\) hold inf/NaN \(0.weight\): saved "
                      r"as they are, but load_checkpoint refuses them unless "
                      r"on_range='ignore'"):  # fmt: skip
        mp.save_checkpoint(path, model)
    with pytest.raises(mp.CheckpointError, match="non-finite values"):
        mp.load_checkpoint(path, make_mlp())
    loaded = make_mlp()
    mp.load_checkpoint(path, loaded, on_range="ignore")
    assert torch.isnan(loaded[0].weight[0, 0])


def test_a_path_that_is_none_a_number_or_a_directory_is_refused_by_name(tmp_path):
    """path=None raised pathlib's TypeError from every entry point; export_weights and
    convert_checkpoint into a directory raised IsADirectoryError saying "the previous
    checkpoint there is intact"; check=5 raised "'int' object is not callable"."""
    model = make_mlp()
    saved = mp.save_checkpoint(tmp_path / "m.safetensors", model)
    for call in (
        lambda p: mp.save_checkpoint(p, model),
        lambda p: mp.load_checkpoint(p, model),
        lambda p: mp.read_checkpoint(p),
        lambda p: mp.export_weights(model, p),
        lambda p: mp.convert_checkpoint(saved, p),
        lambda p: mp.convert_checkpoint(p, tmp_path / "out.safetensors"),
    ):
        for bad in (None, 5):
            with pytest.raises(mp.ArgumentError, match=rf"=({bad}|{bad!r}) is invalid; valid: "
                               r"a file path"):  # fmt: skip
                call(bad)
    with pytest.raises(mp.ArgumentError, match=r"export_weights: path .* is a directory"):
        mp.export_weights(model, tmp_path)
    with pytest.raises(mp.ArgumentError, match=r"convert_checkpoint: destination .* is a dir"):
        mp.convert_checkpoint(saved, tmp_path)
    with pytest.raises(mp.ArgumentError, match=r"load_checkpoint\(check=5\) is invalid"):
        mp.load_checkpoint(saved, model, check=5)


def test_nan_masters_load_under_ignore_as_the_save_warning_says(tmp_path):
    """At O2 the optimizer's own check of non-finite masters refused what
    on_range="ignore" asks to load, after the model had loaded: load_checkpoint's
    on_range decides, before anything changes."""

    def build():
        torch.manual_seed(0)
        model = mp.auto_mixed_precision(nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2)),
                                        "mixed_bfloat16", "O2")  # fmt: skip
        return model, mp.LossScaleOptimizer(torch.optim.Adam(model.parameters(), lr=1e-3))

    model, opt = build()
    opt.backward(model(torch.randn(8, 4)).float().pow(2).mean())
    opt.step()
    with torch.no_grad():
        next(iter(opt.master_params()))[0, 0] = float("nan")
        model[0].weight[0, 0] = float("nan")
    path = tmp_path / "nan.safetensors"
    with pytest.warns(UserWarning, match="unless on_range='ignore'"):
        mp.save_checkpoint(path, model, opt)
    fresh, fresh_opt = build()
    before = [p.detach().clone() for p in fresh.parameters()]
    with pytest.raises(mp.CheckpointError, match="non-finite values"):
        mp.load_checkpoint(path, fresh, fresh_opt)
    assert all(torch.equal(a, p) for a, p in zip(before, fresh.parameters(), strict=True))
    mp.load_checkpoint(path, fresh, fresh_opt, on_range="ignore")
    assert torch.isnan(next(iter(fresh_opt.master_params()))[0, 0])
