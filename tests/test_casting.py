"""Cast rules: only floating tensors are cast; regions; to_float; float32 islands."""

from __future__ import annotations

from collections import namedtuple

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import mixprec as mp
from mixprec.casting import FLOAT32_FUNCTIONS, Float32Functions, cast_floating, get_region

ALL_DTYPES = [
    torch.float32, torch.float64, torch.float16, torch.bfloat16,
    torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8, torch.bool,
    torch.complex64,
]  # fmt: skip

Pair = namedtuple("Pair", "a b")


@settings(max_examples=60, deadline=None)
@given(
    dtypes=st.lists(st.sampled_from(ALL_DTYPES), min_size=1, max_size=5),
    target=st.sampled_from([torch.float16, torch.bfloat16, torch.float32]),
    extra=st.one_of(st.none(), st.integers(), st.text(max_size=3), st.floats(allow_nan=False)),
)
def test_only_floating_tensors_are_cast(dtypes, target, extra):
    tensors = [torch.ones(2).to(d) for d in dtypes]
    tree = {"list": list(tensors), "tuple": tuple(tensors), "pair": Pair(tensors[0], extra)}
    out = cast_floating(tree, target)
    for original, cast in zip(tensors, out["list"], strict=True):
        if original.is_floating_point():
            assert cast.dtype == target
        else:
            assert cast is original  # integer, bool and complex: the very same object
    assert isinstance(out["pair"], Pair) and out["pair"].b == extra
    assert isinstance(out["tuple"], tuple)


def test_region_casts_inputs_outputs_and_never_integers():
    seen = {}

    class Probe(nn.Module):
        def forward(self, x, ids, mask=None, scale=2.0):
            seen.update(x=x.dtype, ids=ids.dtype, mask=mask.dtype, scale=scale)
            return {"y": x * scale, "ids": ids}

    m = mp.to_float(Probe(), "bf16")
    ids = torch.tensor([1, 2])
    out = m(torch.ones(2), ids, mask=torch.tensor([True, False]), scale=3.0)
    assert seen == {"x": torch.bfloat16, "ids": torch.int64, "mask": torch.bool, "scale": 3.0}
    assert out["y"].dtype == torch.bfloat16 and out["ids"] is ids


def test_to_float_float32_restores_storage_and_disables_autocast():
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    original = model[1].weight.detach().clone()
    mp.auto_mixed_precision(model, "mixed_bfloat16", level="O2")
    assert model[1].weight.dtype == torch.bfloat16
    mp.to_float(model[1], torch.float32)
    assert model[1].weight.dtype == torch.float32
    assert torch.equal(model[1].weight, original)  # the float32 values, not rounded ones
    captured = {}
    model[1].register_forward_hook(lambda m, a, o: captured.update(out=o.dtype))
    model(torch.randn(3, 4))
    assert captured["out"] == torch.float32  # autocast is off inside the float32 module


def test_to_float_errors():
    with pytest.raises(TypeError, match="needs a torch.nn.Module, got str"):
        mp.to_float("layer", torch.float32)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"to_float dtype='int8' is not a known dtype"):
        mp.to_float(nn.Linear(2, 2), "int8")


def test_region_context_is_closed_when_forward_raises():
    class Boom(nn.Module):
        def forward(self, x):
            raise ValueError("boom")

    m = mp.to_float(Boom(), torch.bfloat16)
    with pytest.raises(ValueError, match="boom"):
        m(torch.ones(2))
    assert not torch.is_autocast_enabled("cpu")
    assert torch.randn(2, 2) @ torch.randn(2, 2) is not None
    assert (torch.ones(2, 2) @ torch.ones(2, 2)).dtype == torch.float32


def test_float32_functions_run_in_float32_under_cpu_autocast():
    x = torch.randn(4, 8)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        h = nn.functional.linear(x, torch.randn(8, 8))
        assert nn.functional.softmax(h, -1).dtype == torch.bfloat16  # CPU autocast alone
        with Float32Functions():
            assert nn.functional.softmax(h, -1).dtype == torch.float32
            assert h.log_softmax(-1).dtype == torch.float32
            assert nn.functional.layer_norm(h, (8,)).dtype == torch.float32
            assert torch.logsumexp(h, -1).dtype == torch.float32
            assert (h @ h.T).dtype == torch.bfloat16  # matmuls are untouched
    assert nn.functional.softmax in FLOAT32_FUNCTIONS


def test_region_recorded():
    m = mp.to_float(nn.Linear(2, 2), "float16")
    region = get_region(m)
    assert region is not None and region.compute_dtype == torch.float16
