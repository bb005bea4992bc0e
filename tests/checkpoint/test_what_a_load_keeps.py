"""What a save and a load must not lose or mix up without a word: a clamp the masters
would undo, float64 values past float32's range, a transposed view taken for a tied
weight, two tensors under one name, an untied checkpoint into a tied model, optimizer
state by position, and a mask buffer in a conversion."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file
from torch import nn

import mixprec as mp
from mixprec.checkpoint import CheckpointError


def two_layers() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))


def test_a_clamped_weight_stays_clamped_with_an_optimizer(tmp_path):
    source = mp.auto_mixed_precision(two_layers(), "mixed_float16", "O1")
    with torch.no_grad():
        source[0].weight[0, 0] = 1e6  # float32 storage: a legal value, past float16's max
    opt = mp.LossScaleOptimizer(torch.optim.SGD(source.parameters(), lr=0.1))
    path = mp.save_checkpoint(tmp_path / "big.safetensors", source, opt)
    model = mp.auto_mixed_precision(two_layers(), "mixed_float16", "O2")
    target = mp.LossScaleOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    report = mp.load_checkpoint(path, model, target, on_range="clamp")
    assert report.out_of_range == [("0.weight", 1e6, "float16", "clamp")]
    assert model[0].weight[0, 0].item() == 65504.0
    master = dict((id(p), m) for p, m in target.master_weights())[id(model[0].weight)]
    assert master[0, 0].item() == 65504.0


def test_float64_past_float32s_range_is_refused_or_clamped(tmp_path):
    weights = {"weight": torch.tensor([[1e300, 1.0]], dtype=torch.float64), "bias": torch.zeros(1)}
    torch.save(weights, tmp_path / "f64.pt")
    model = nn.Linear(2, 1)
    with pytest.raises(CheckpointError, match=r"'weight' has max \|value\| 1e\+300, beyond "
                       r"float32's 3.40282e\+38"):  # fmt: skip
        mp.load_checkpoint(tmp_path / "f64.pt", model)
    mp.load_checkpoint(tmp_path / "f64.pt", model, on_range="clamp")
    assert model.weight[0, 0].item() == torch.finfo(torch.float32).max
    with pytest.raises(CheckpointError, match="beyond float32's"):
        mp.convert_checkpoint(tmp_path / "f64.pt", tmp_path / "out.safetensors")


class WithTranspose(nn.Module):
    """A square weight and a buffer holding its transpose: same storage, offset and shape."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(3, 3, bias=False)
        self.register_buffer("wt", self.lin.weight.detach().t())


def test_a_transposed_view_is_not_taken_for_a_tied_weight(tmp_path):
    torch.manual_seed(0)
    model = WithTranspose()
    path = mp.save_checkpoint(tmp_path / "t.safetensors", model)
    other = WithTranspose()
    mp.load_checkpoint(path, other)
    assert torch.equal(other.lin.weight, model.lin.weight)


def test_two_tensors_under_one_name_are_refused(tmp_path):
    state = {"ema": {"w": torch.zeros(2)}, "ema/w": torch.ones(2)}
    with pytest.raises(ValueError, match=r"two tensors under one name 'trainer/ema/w'"):
        mp.save_checkpoint(tmp_path / "c.safetensors", nn.Linear(2, 2), trainer_state=state)
    assert not (tmp_path / "c.safetensors").exists()


class Tied(nn.Module):
    def __init__(self, tie: bool) -> None:
        super().__init__()
        self.emb = nn.Embedding(4, 3)
        self.head = nn.Linear(3, 4, bias=False)
        if tie:
            self.head.weight = self.emb.weight


def test_an_untied_checkpoint_into_a_tied_model_is_refused(tmp_path):
    untied = Tied(tie=False)
    with torch.no_grad():
        untied.emb.weight.fill_(1.0)
        untied.head.weight.fill_(2.0)
    path = mp.save_checkpoint(tmp_path / "u.safetensors", untied)
    with pytest.raises(CheckpointError, match=r"emb.weight, head.weight are one tensor in this "
                       r"model \(tied\) and hold different values"):  # fmt: skip
        mp.load_checkpoint(path, Tied(tie=True))
    # The documented way out, which said nothing of the value it lost: the report does.
    tied = Tied(tie=True)
    report = mp.load_checkpoint(path, tied, strict=False)
    assert report.tied_conflicts == [["emb.weight", "head.weight"]]
    assert (
        "tied: emb.weight, head.weight are one tensor here and differ in the file; "
        "head.weight's value was loaded" in str(report)
    )
    assert torch.equal(tied.emb.weight, torch.full_like(tied.emb.weight, 2.0))

    # A key skipped for its shape loads nothing, and loses nothing: no conflict to name.
    class Wide(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.emb, self.head = nn.Embedding(4, 3), nn.Linear(3, 5, bias=False)

    wide = mp.save_checkpoint(tmp_path / "w.safetensors", Wide())
    report = mp.load_checkpoint(wide, Tied(tie=True), strict=False)
    assert report.tied_conflicts == [] and [k for k, _, _ in report.mismatched] == ["head.weight"]
    same = mp.save_checkpoint(tmp_path / "t.safetensors", Tied(tie=True))
    mp.load_checkpoint(same, Tied(tie=True))


class AB(nn.Module):
    def __init__(self, order: str) -> None:
        super().__init__()
        for name in order:
            setattr(self, name, nn.Linear(3, 3, bias=False))


def test_optimizer_state_of_parameters_in_another_order_is_refused(tmp_path):
    source = AB("ab")
    opt = torch.optim.Adam(source.parameters(), lr=0.1)
    source.a.weight.grad, source.b.weight.grad = torch.ones(3, 3), torch.full((3, 3), 100.0)
    opt.step()
    path = mp.save_checkpoint(tmp_path / "ab.safetensors", source, opt)
    target = AB("ba")
    with pytest.raises(CheckpointError, match=r"param_groups\[0\] position 0 holds the state of "
                       r"'a.weight' in the checkpoint and is 'b.weight' here"):  # fmt: skip
        mp.load_checkpoint(path, target, torch.optim.Adam(target.parameters(), lr=0.1))
    same = AB("ab")
    mp.load_checkpoint(path, same, torch.optim.Adam(same.parameters(), lr=0.1))


def test_optimizer_state_for_a_weight_not_loaded_is_refused(tmp_path):
    small = nn.Linear(3, 3)
    opt = torch.optim.Adam(small.parameters())
    small(torch.randn(2, 3)).sum().backward()
    opt.step()
    path = mp.save_checkpoint(tmp_path / "n3.safetensors", small, opt)
    large = nn.Linear(5, 5)
    with pytest.raises(CheckpointError, match=r"holds state for bias, weight, whose saved "
                       r"weights have other shapes and were not loaded"):  # fmt: skip
        mp.load_checkpoint(path, large, torch.optim.Adam(large.parameters()), strict=False)


class Masked(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(3, 3)
        self.register_buffer("mask", torch.triu(torch.full((3, 3), float("-inf")), 1))


def test_a_conversion_keeps_a_mask_buffer_of_minus_inf(tmp_path):
    path = mp.save_checkpoint(tmp_path / "m.safetensors", Masked())
    mp.convert_checkpoint(path, tmp_path / "half.safetensors", torch.float16)
    out = load_file(tmp_path / "half.safetensors")
    assert out["mask"].dtype == torch.float16 and torch.isinf(out["mask"]).sum() == 3


def test_a_replaced_checkpoint_keeps_its_files_mode(tmp_path):
    """A private checkpoint (0600) stays private when saved over or converted in place."""
    import os
    import stat

    path = mp.save_checkpoint(tmp_path / "c.safetensors", nn.Linear(2, 2))
    os.chmod(path, 0o600)
    mp.save_checkpoint(path, nn.Linear(2, 2))
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    mp.convert_checkpoint(path, path, torch.float16, in_place=True)
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600


def test_a_torch_save_file_with_tied_or_strided_tensors_converts(tmp_path):
    """safetensors writes neither shared memory nor views: such tensors of a torch.save
    file are written as separate contiguous copies."""
    weight = torch.randn(4, 3)
    torch.save({"emb.weight": weight, "head.weight": weight, "t": weight.t()}, tmp_path / "s.pt")
    mp.convert_checkpoint(tmp_path / "s.pt", tmp_path / "s.safetensors")
    out = load_file(tmp_path / "s.safetensors")
    assert torch.equal(out["emb.weight"], weight) and torch.equal(out["head.weight"], weight)
    assert torch.equal(out["t"], weight.t())


def test_a_diverged_tied_model_still_loads_with_on_range_ignore(tmp_path):
    """NaN != NaN: the tied check compares values NaN-aware, so the documented way to load
    non-finite values still works for a tied model."""
    tied = Tied(tie=True)
    with torch.no_grad():
        tied.emb.weight[0, 0] = float("nan")
    path = mp.save_checkpoint(tmp_path / "nan.safetensors", tied)
    report = mp.load_checkpoint(path, Tied(tie=True), on_range="ignore")
    assert [name for name, *_ in report.non_finite] == ["emb.weight", "head.weight"]


def test_a_header_policy_an_earlier_mixprec_took_still_reads():
    """The header records the policy the model was prepared with; one whose combination
    Policy now refuses (an earlier mixprec took it) must not make the file unreadable."""
    from mixprec.checkpoint._schema import _check_policy
    from mixprec.checkpoint.format import _BadValueError

    _check_policy("params=float32,compute=float32,output=bfloat16", "policy")
    with pytest.raises(_BadValueError):
        _check_policy("params=float33", "policy")


def test_restore_rng_restores_numpys_global_generator_too(tmp_path):
    """Data augmentation often draws from NumPy's global generator: a resumed run must
    draw what the uninterrupted one drew."""
    import numpy

    model = nn.Linear(2, 2)
    numpy.random.seed(7)
    numpy.random.normal()  # a cached Gaussian in the state, too
    path = mp.save_checkpoint(tmp_path / "rng.safetensors", model)
    expected = numpy.random.rand(5)
    numpy.random.seed(99)
    mp.load_checkpoint(path, model, restore_rng=True)
    assert numpy.array_equal(numpy.random.rand(5), expected)


def test_a_loss_scale_optimizers_state_into_a_plain_optimizer_says_what_to_do(tmp_path):
    model = mp.auto_mixed_precision(two_layers(), "mixed_bfloat16", "O2")
    opt = mp.LossScaleOptimizer(torch.optim.AdamW(model.parameters()))
    path = mp.save_checkpoint(tmp_path / "lso.safetensors", model, opt)
    target = mp.auto_mixed_precision(two_layers(), "mixed_bfloat16", "O2")
    with pytest.raises(CheckpointError, match=r"is a LossScaleOptimizer's .* plain AdamW: wrap "
                       r"it, mp.LossScaleOptimizer\(optimizer\)"):  # fmt: skip
        mp.load_checkpoint(path, target, torch.optim.AdamW(target.parameters()))
