"""``mixprec convert``: non-finite values and ``--on-range``; what OUT may be."""

from __future__ import annotations

import os
import re

import pytest

from mixprec import cli


def test_convert_refuses_nan_by_default_and_lists_it_when_ignored(tmp_path, capsys):
    import torch

    import mixprec as mp
    from tests.conftest import make_mlp

    model = make_mlp()
    with torch.no_grad():
        model[0].weight[0, :3] = torch.tensor([float("nan"), float("inf"), 1.0])
    ckpt = mp.save_checkpoint(tmp_path / "c.safetensors", model)
    out = tmp_path / "half.safetensors"
    assert cli.main(["convert", str(ckpt), str(out), "--dtype", "bfloat16"]) == 2
    err = capsys.readouterr().err
    assert "'0.weight' (1 NaN, 1 inf)" in err and not out.exists()
    # The option as typed, not the API's keyword.
    assert "--on-range ignore loads them" in err and "on_range" not in err
    assert "buffers" not in err  # this file says which tensors are buffers
    # A plain state dict does not: its -inf mask is refused like a weight's inf, and said.
    plain = tmp_path / "plain.pt"
    torch.save({"w": torch.ones(2), "mask": torch.tensor([0.0, float("-inf")])}, plain)
    assert cli.main(["convert", str(plain), str(out), "--dtype", "bfloat16"]) == 2
    err = capsys.readouterr().err
    assert "'mask' (0 NaN, 1 inf)" in err and "does not say which of its tensors are buffers" in err
    argv = ["convert", str(ckpt), str(out), "--dtype", "bfloat16", "--on-range", "ignore"]
    assert cli.main(argv) == 0
    assert "  0.weight: 1 NaN, 1 inf (kept: --on-range ignore)" in capsys.readouterr().out


def test_convert_onto_the_input_is_refused_unless_in_place_and_says_what_it_drops(
    tmp_path, capsys, monkeypatch
):
    import torch

    import mixprec as mp
    from tests.conftest import make_mlp

    model = mp.auto_mixed_precision(make_mlp(), "mixed_bfloat16", "O2")
    opt = mp.LossScaleOptimizer(torch.optim.AdamW(model.parameters()))
    ckpt = mp.save_checkpoint(tmp_path / "ck.safetensors", model, opt, {"global_step": 7})
    (tmp_path / "link.safetensors").symlink_to(ckpt)
    original = ckpt.read_bytes()
    monkeypatch.chdir(tmp_path)
    for output in ("ck.safetensors", str(ckpt), "./link.safetensors"):
        assert cli.main(["convert", "ck.safetensors", output, "--dtype", "bfloat16"]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and "is the input file" in err and "--in-place" in err
        assert ckpt.read_bytes() == original
    argv = ["convert", "ck.safetensors", "link.safetensors", "--dtype", "bfloat16", "--in-place"]
    assert cli.main(argv) == 0
    out = capsys.readouterr().out
    assert "in place: kept the model weights (8 tensors, now bfloat16)" in out
    for dropped in (
        "optimizer state (LossScaleOptimizer over AdamW)",
        "loss scaler state",
        "RNG states",
        "trainer state (global_step)",
        "float32 master weights of 6 parameter(s) (written rounded to bfloat16)",
    ):
        assert f"  dropped: {dropped}\n" in out  # fmt: skip
    _, header = mp.read_checkpoint(ckpt)
    assert header.keys() == {"aliases"} and (tmp_path / "link.safetensors").is_symlink()
    # --in-place with another output is a plain conversion.
    assert cli.main(["convert", "ck.safetensors", "o.safetensors", "--in-place"]) == 0
    assert "in place" not in capsys.readouterr().out


def test_convert_names_its_option_as_typed_and_counts_values_flushed_to_zero(tmp_path, capsys):
    import torch

    import mixprec as mp
    from tests.conftest import make_mlp

    model = make_mlp()
    with torch.no_grad():
        model[0].weight[0, :2] = 1e-9  # below float16's smallest subnormal, 6e-8
    ckpt = mp.save_checkpoint(tmp_path / "c.safetensors", model)
    out = tmp_path / "half.safetensors"
    assert cli.main(["convert", str(ckpt), str(out), "--dtype", "float13"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("mixprec convert: error: --dtype='float13' is not a known dtype; valid:")
    assert not out.exists()
    assert cli.main(["convert", str(ckpt), str(out), "--dtype", "float16"]) == 0
    line = "  0.weight: 2 non-zero values below float16's range became 0\n"
    assert line in capsys.readouterr().out
    with torch.no_grad():
        model[0].weight[0, 0] = 1e6  # beyond float16's 65504
    mp.save_checkpoint(ckpt, model)
    assert cli.main(["convert", str(ckpt), str(out), "--dtype", "float16", "--overwrite"]) == 2
    err = capsys.readouterr().err
    assert "pass --on-range clamp to saturate or --on-range ignore to cast as is" in err


def test_a_nested_torch_checkpoints_other_entries_are_named(tmp_path, capsys):
    """A Lightning-style file ({"state_dict", "optimizer_states", "epoch"}): converted in
    place, the other entries were lost while the command said "dropped: nothing"."""
    import torch

    model = torch.nn.Linear(2, 2)
    path = tmp_path / "run.ckpt"
    torch.save({"state_dict": model.state_dict(), "epoch": 7,
                "optimizer_states": [torch.optim.Adam(model.parameters()).state_dict()]},
               path)  # fmt: skip
    assert cli.main(["inspect", str(path)]) == 0
    assert "entries beside the state dict (not read): epoch, optimizer_states" in (
        capsys.readouterr().out
    )
    assert cli.main(["convert", str(path), str(path), "--in-place", "--dtype", "bfloat16"]) == 0
    assert "dropped: the file's other entries (epoch, optimizer_states)" in capsys.readouterr().out


def test_tensors_a_checkpoint_cannot_hold_are_refused_before_anything_is_loaded(tmp_path):
    import pytest
    import torch

    import mixprec as mp

    class Two(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.register_buffer("a", torch.zeros(2))
            self.register_buffer("b", torch.zeros(2))

    cases = {
        "meta": (torch.empty(2, device="meta"), "on the meta device"),
        "sparse": (torch.ones(2).to_sparse(), "sparse_coo (not dense)"),
        "complex": (torch.ones(2, dtype=torch.complex128), "complex128, which"),
        "nested": (torch.nested.nested_tensor([torch.ones(2), torch.ones(3)]), "nested"),
    }
    for name, (bad, said) in cases.items():
        path = tmp_path / f"{name}.pt"
        torch.save({"a": torch.full((2,), 7.0), "b": bad}, path)
        model = Two()
        with pytest.raises(mp.CheckpointError, match=rf"tensor 'b' is {re.escape(said)}"):
            mp.load_checkpoint(path, model)
        assert not model.a.any()  # nothing loaded: 'a' was written before the failure


def test_complex64_in_a_torch_file_loads_and_converts_as_safetensors_does(tmp_path, capsys):
    # safetensors holds complex64 (rotary embeddings' frequencies): a .pt file's was refused.
    import torch

    import mixprec as mp
    from mixprec import cli

    class Rotary(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.proj = torch.nn.Linear(2, 2)
            self.register_buffer("freq", torch.zeros(3, dtype=torch.complex64))
            self.register_buffer("count", torch.tensor(0))

    source = Rotary()
    source.freq.copy_(torch.tensor([1 + 2j, 3 - 1j, 0.5j]))
    path = tmp_path / "rotary.pt"
    torch.save(source.state_dict(), path)
    model = Rotary()
    mp.load_checkpoint(path, model)
    assert torch.equal(model.freq, source.freq)
    out = tmp_path / "half.safetensors"
    assert cli.main(["convert", str(path), str(out), "--dtype", "bfloat16"]) == 0
    said = capsys.readouterr().out
    assert (
        "2 tensors in bfloat16 (2 converted from another dtype), 2 kept in their own dtype "
        "(complex64, int64)" in said
    )
    tensors, _ = mp.read_checkpoint(out)
    assert tensors["model/freq"].dtype == torch.complex64
    assert torch.equal(tensors["model/freq"], source.freq)


@pytest.fixture
def training_checkpoint(tmp_path):
    """A checkpoint with optimizer, trainer and RNG state, as ``mixprec train --save``
    writes one."""
    import torch

    import mixprec as mp
    from tests.conftest import make_mlp

    model = make_mlp()
    optimizer = torch.optim.Adam(model.parameters())
    return mp.save_checkpoint(tmp_path / "run.safetensors", model, optimizer, {"global_step": 7})


def test_convert_refuses_an_existing_output_unless_overwrite(training_checkpoint, capsys):
    """An OUT that is another training checkpoint was replaced silently: its optimizer and
    trainer state were lost. Only OUT == IN was guarded."""
    other = training_checkpoint.with_name("other.safetensors")
    other.write_bytes(training_checkpoint.read_bytes())
    before = other.read_bytes()
    assert cli.main(["convert", str(training_checkpoint), str(other)]) == 2
    out, err = capsys.readouterr()
    assert out == "" and other.read_bytes() == before
    assert err == (
        f"mixprec convert: error: output {str(other)!r} exists (a mixprec checkpoint with "
        "optimizer, trainer and RNG state) and would be replaced; give another output, or "
        "--overwrite to replace it\n"
    )
    assert cli.main(["convert", str(training_checkpoint), str(other), "--overwrite"]) == 0
    assert capsys.readouterr().out.startswith(
        f"wrote {other} (replaced a mixprec checkpoint with optimizer, trainer and RNG state): "
    )
    # A weights file is named as what it is.
    assert cli.main(["convert", str(training_checkpoint), str(other)]) == 2
    assert "exists (a safetensors file of 8 tensors) and would be" in capsys.readouterr().err


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="needs mkfifo")
def test_convert_refuses_an_output_that_is_a_fifo(training_checkpoint, capsys):
    """The atomic write renamed a regular file over the FIFO (or device) at OUT."""
    import stat

    fifo = training_checkpoint.with_name("pipe.safetensors")
    os.mkfifo(fifo)
    assert cli.main(["convert", str(training_checkpoint), str(fifo), "--overwrite"]) == 2
    assert capsys.readouterr().err == (
        f"mixprec convert: error: output {str(fifo)!r} is not a regular file (a device, pipe "
        "or socket); give a file path\n"
    )
    assert stat.S_ISFIFO(os.stat(fifo).st_mode)


def test_convert_refuses_an_empty_output(training_checkpoint, capsys):
    """``convert IN ""`` said that '' is a directory."""
    assert cli.main(["convert", str(training_checkpoint), ""]) == 2
    assert (
        capsys.readouterr().err == "mixprec convert: error: output '' is empty; give a file path\n"
    )


@pytest.mark.parametrize(
    ("name", "said"),
    [
        ("out.pt", "has the suffix '.pt'"),
        ("out", "has no suffix"),
        ("o.ckpt", "has the suffix '.ckpt'"),
    ],
)
def test_convert_refuses_an_output_that_is_not_named_safetensors(
    name, said, training_checkpoint, capsys
):
    """``convert ckpt.safetensors out.pt`` wrote safetensors under a name torch.load fails on."""
    out = training_checkpoint.with_name(name)
    assert cli.main(["convert", str(training_checkpoint), str(out)]) == 2
    assert capsys.readouterr().err == (
        f"mixprec convert: error: output {str(out)!r} {said}; convert writes safetensors, not a "
        "torch.save file: give a .safetensors file path\n"
    )
    assert not out.exists()


def test_convert_in_place_says_a_torch_file_becomes_safetensors(tmp_path, capsys):
    """In place on a torch.save file, the output did not say that its format changed."""
    import torch

    path = tmp_path / "model.pt"
    torch.save(torch.nn.Linear(2, 2).state_dict(), path)
    assert cli.main(["convert", str(path), str(path), "--in-place"]) == 0
    assert (
        f"  in place: {path} is now a safetensors file, not a torch.save one: torch.load no "
        "longer reads it (mixprec and safetensors do)\n" in capsys.readouterr().out
    )
    # A safetensors file converted in place says nothing of the kind.
    assert cli.main(["convert", str(path), str(path), "--in-place", "--dtype", "bfloat16"]) == 0
    assert "is now a safetensors file" not in capsys.readouterr().out
