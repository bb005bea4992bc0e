"""The small private modules several subpackages share: each does one thing, tested here
directly (``_device``, ``_dist``, ``_calling``, ``_rng``, ``_hardware``, ``_version``,
``keep``, ``_plain_optimizers``)."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

import mixprec as mp
from mixprec import _calling, _device, _dist, _hardware, _plain_optimizers, _rng, _version, keep


def test_resolve_device():
    assert _device.resolve_device("cpu") == torch.device("cpu")
    assert _device.resolve_device(torch.device("cpu")) == torch.device("cpu")
    expected = "cuda" if torch.cuda.is_available() else "cpu"
    assert _device.resolve_device("auto").type == expected


def test_dist_primitives_in_one_process():
    assert not _dist.is_distributed()
    flag = torch.tensor(1.0)
    assert _dist.agree_found_inf(flag) is flag and flag.item() == 1.0  # nothing to agree with
    assert not _dist.is_dtensor(torch.zeros(2))


def test_call_spreads_tuples_and_lists_only():
    seen = []

    class Probe(nn.Module):
        def forward(self, *args):
            seen.append(len(args))
            return torch.zeros(())

    model = Probe()
    _calling.call(model, (torch.zeros(1), torch.zeros(1)))
    _calling.call(model, [torch.zeros(1)] * 3)
    _calling.call(model, {"x": torch.zeros(1)})  # a mapping is one argument
    assert seen == [2, 3, 1]


def test_same_draws_rewinds_and_restores_the_caller_state():
    torch.manual_seed(0)
    with _rng.same_draws() as rewind:
        first = torch.rand(3)
        rewind()
        assert torch.equal(torch.rand(3), first)  # every pass draws the same numbers
        torch.rand(100)
    after = torch.rand(3)
    torch.manual_seed(0)
    assert torch.equal(after, torch.rand(3))  # as if the block never drew anything


def test_hardware_probe_is_cached_and_says_why():
    hw = _hardware.probe_hardware()
    assert hw is _hardware.probe_hardware()
    assert hw.device in ("cpu", "cuda") and hw.detail
    assert _hardware.cpuinfo_field("no such field") is None


def test_version_is_the_root_one():
    assert _version.__version__ == mp.__version__


def test_kept_modules_by_type_pattern_and_module():
    model = nn.Sequential(nn.Linear(2, 2), nn.LayerNorm(2), nn.Linear(2, 2))
    assert keep.keep_list("0") == ("0",) and keep.keep_list(["0", nn.LayerNorm]) == (
        "0",
        nn.LayerNorm,
    )
    assert set(keep.kept_modules(model, [nn.LayerNorm])) == {"1"}
    assert set(keep.kept_modules(model, ["[02]"])) == {"0", "2"}
    assert set(keep.kept_modules(model, [model[2]])) == {"2"}
    with pytest.raises(mp.ArgumentError, match=r"keep_float32 entry 'head' matches no module"):
        keep.kept_modules(model, ["head"])
    with pytest.raises(mp.ArgumentError, match=r"entries must be nn.Module subclasses"):
        keep.kept_modules(model, [3])  # type: ignore[list-item]
    assert keep.inside([model]) >= {id(model[0]), id(model[1])}


def test_plain_optimizer_over_o2_weights_warns_once_and_a_wrapped_one_never():
    assert not _plain_optimizers.needs_master(torch.zeros(2))  # float32: no master
    model = mp.auto_mixed_precision(nn.Sequential(nn.Linear(4, 4)), "mixed_bfloat16", "O2")
    assert all(_plain_optimizers.needs_master(p) for p in model.parameters())
    plain = torch.optim.SGD(model.parameters(), lr=0.1)
    model(torch.randn(2, 4)).float().sum().backward()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        plain.step()
        plain.step()
    said = [w for w in caught if "no float32 master weights" in str(w.message)]
    assert len(said) == 1 and said[0].filename == __file__  # once, at the caller's line
    wrapped = mp.LossScaleOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    wrapped.zero_grad()
    wrapped.backward(model(torch.randn(2, 4)).float().sum())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        wrapped.step()
    assert not [w for w in caught if "no float32 master weights" in str(w.message)]
