"""float64 models given to ``auto_mixed_precision``: lowered to float32 first, with one
warning, at every level, so that O2's masters hold the float32 values, not 16-bit roundings;
a value past float32's range is refused before anything changes."""

from __future__ import annotations

import re
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import mixprec as mp
from mixprec import ArgumentError


def net64(seed: int = 0) -> nn.Sequential:
    """Float64 from the start (values that float32 does not hold exactly): 6 floating
    parameters (2 Linear, BatchNorm) and 2 floating buffers."""
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 4))
    model.double()
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, dtype=torch.float64) * 0.3)
    return model


def note(level: str, what: str = "6 parameters and 2 buffers") -> str:
    return (
        "^"
        + re.escape(
            f"auto_mixed_precision: {what} of the model were float64; stored in float32, the "
            f"widest dtype {level} keeps (digits past float32's 24 bits are rounded off). Call "
            "model.float() first to make this explicit"
        )
        + "$"
    )


@pytest.mark.parametrize("level", ["O0", "O1", "O2", "O3"])
def test_a_float64_model_is_lowered_to_float32_with_one_warning_at_the_users_line(level):
    model = net64()
    params = [id(p) for p in model.parameters()]
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        mp.auto_mixed_precision(model, "mixed_bfloat16", level=level)
    lowered = [w for w in seen if "float64" in str(w.message)]
    assert len(lowered) == 1 and re.match(note(level), str(lowered[0].message))
    assert lowered[0].filename == __file__
    assert [id(p) for p in model.parameters()] == params
    floats = [t.dtype for t in [*model.parameters(), *model.buffers()] if t.is_floating_point()]
    assert torch.float64 not in floats


@pytest.mark.parametrize("level", ["O0", "O1"])
def test_o0_and_o1_weights_are_the_float32_roundings_of_the_float64_values(level):
    model = net64()
    wanted = {n: p.detach().float() for n, p in model.named_parameters()}
    with pytest.warns(UserWarning, match=note(level)):
        mp.auto_mixed_precision(model, "mixed_bfloat16", level=level)
    for name, p in model.named_parameters():
        assert p.dtype == torch.float32 and torch.equal(p.detach(), wanted[name]), name


def test_o2_masters_hold_the_float32_roundings_not_16_bit_ones():
    """Before the lowering, O2 stored the float64 weights straight in bfloat16 and its
    masters started from those roundings: an error of up to 2**-9 relative, not 2**-24."""
    model = net64()
    wanted = {id(p): p.detach().float() for p in model.parameters()}
    with pytest.warns(UserWarning, match=note("O2")):
        mp.auto_mixed_precision(model, "mixed_bfloat16", level="O2")
    opt = mp.LossScaleOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    masters = opt.master_weights()
    assert len(masters) == 4  # the two Linear layers' weights and biases
    for weight, master in masters:
        assert weight.dtype == torch.bfloat16 and master.dtype == torch.float32
        assert torch.equal(master, wanted[id(weight)])


def test_o2_from_a_float64_model_trains_as_o2_from_its_float32_copy():
    """Same float32 starting values, same steps: the two runs agree bit for bit."""
    x = torch.randn(32, 8, generator=torch.Generator().manual_seed(1))
    y = torch.randint(0, 4, (32,), generator=torch.Generator().manual_seed(2))
    runs = []
    for source in (net64(), net64().float()):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            model = mp.auto_mixed_precision(source, "mixed_bfloat16", level="O2")
        opt = mp.LossScaleOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-2))
        for _ in range(3):
            opt.zero_grad()
            opt.backward(F.cross_entropy(model(x), y))
            opt.step()
        runs.append([m.clone() for _, m in opt.master_weights()])
    for lowered, plain in zip(*runs, strict=True):
        assert torch.equal(lowered, plain)


def test_a_float64_value_past_float32s_range_is_refused_and_nothing_changes():
    model = net64()
    with torch.no_grad():
        model[3].weight[1, 2] = -1e300
    before = {n: t.clone() for n, t in model.state_dict().items()}
    expected = (
        "auto_mixed_precision(model=...): parameter '3.weight' is float64 with max |value| "
        "1e+300, beyond float32's 3.40282e+38; mixed precision keeps float32 at most, where "
        "it would become inf. Rescale it, or keep the model in float64"
    )
    with pytest.raises(ArgumentError, match=re.escape(expected)):
        mp.auto_mixed_precision(model, "mixed_bfloat16")
    after = model.state_dict()
    assert all(after[n].dtype == v.dtype and torch.equal(after[n], v) for n, v in before.items())
    assert not hasattr(model, "_mixprec_applied")


def test_inf_in_a_float64_buffer_is_not_out_of_range_and_a_tied_weight_counts_once():
    model = nn.Sequential(nn.Embedding(5, 4), nn.Linear(4, 5, bias=False)).double()
    model[1].weight = model[0].weight
    model.register_buffer("mask", torch.tensor([0.0, float("-inf")], dtype=torch.float64))
    with pytest.warns(UserWarning, match=note("O0", "1 parameter and 1 buffer")):
        mp.auto_mixed_precision(model, "float32", level="O0")
    assert model.mask.dtype == torch.float32 and model.mask[1] == float("-inf")


def test_a_float32_model_gets_no_float64_note():
    model = net64().float()
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        mp.auto_mixed_precision(model, "mixed_bfloat16", level="O2")
    assert not [w for w in seen if "float64" in str(w.message)]


def test_finite_peak_reads_float8_and_leaves_out_what_is_not_here():
    # float8 has no isfinite: read in float32. A meta tensor has no values.
    from mixprec._dtypes import finite_peak

    values = torch.tensor([1.0, -3.0, float("inf")])
    assert finite_peak(values) == 3.0
    assert finite_peak(values.to(torch.float8_e5m2)) == 3.0
    assert finite_peak(torch.empty(3, device="meta")) == 0.0
    assert finite_peak(torch.empty(0)) == 0.0
