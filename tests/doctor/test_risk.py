"""How the 16-bit doctor weighs a module (``mixprec.doctor.risk``), on hand-made figures:
where inf/NaN starts (in a module, or in the model's own forward code), what each finding
adds to a module's risk, and the loss-scale range."""

from __future__ import annotations

import math

import pytest
import torch

from mixprec.doctor.risk import (
    OUTPUT_ERROR_LIMIT,
    between,
    loss_scale_range,
    nonfinite_origin,
    own_code_origin,
    score,
)
from tests.doctor.cases import module

F16_MAX = float(torch.finfo(torch.float16).max)


def test_nonfinite_origin_is_the_first_leaf_to_make_inf_from_finite_input():
    leaves = {"a", "b", "c"}
    # 'b' makes inf from finite input; 'c' only inherits it; the container is no leaf.
    reports = [
        module("a", 0),
        module("b", 1, nonfinite_output=4, overflow_origin=True),
        module("c", 2, nonfinite_output=4, nonfinite_input=4),
        module("(model)", 3, nonfinite_output=4),
    ]
    assert nonfinite_origin(reports, leaves) == ("b", "forward")
    # No forward origin: the leaf run last in the backward with a non-finite gradient.
    reports = [module("a", 0, nonfinite_grad=1), module("b", 1, nonfinite_grad=2), module("c", 2)]
    assert nonfinite_origin(reports, leaves) == ("b", "backward")
    assert nonfinite_origin([module("a", 0), module("b", 1)], leaves) is None


def test_score_ranks_origin_then_range_then_underflow_then_error():
    compute = torch.float16
    origin = module("o", 0, nonfinite_output=1)
    score(origin, compute, F16_MAX, ("o", "forward"))
    assert origin.risk >= 1000
    assert origin.reasons == ["output becomes inf/NaN here first (float16)"]

    beyond = module("r", 1, max_output=2 * F16_MAX)
    score(beyond, compute, F16_MAX, ("o", "forward"))
    assert beyond.risk == pytest.approx(102.0)
    assert beyond.reasons == [f"values up to {2 * F16_MAX:.3g} exceed float16 max 6.55e+04"]

    flushed = module("u", 2, grad_underflow=0.5)
    score(flushed, compute, F16_MAX, None)
    assert flushed.risk == pytest.approx(2.5)
    assert flushed.reasons == ["50% of gradients flush to zero"]

    wrong = module("e", 3, output_rel_error=0.5)
    score(wrong, compute, F16_MAX, None)
    assert wrong.risk == pytest.approx(1.5)
    assert wrong.reasons == [f"output error vs float32 0.5 > {OUTPUT_ERROR_LIMIT[compute]}"]

    # A module computing in float32 is flagged only as an origin.
    island = module("f", 4, max_output=2 * F16_MAX, float32=True)
    score(island, compute, F16_MAX, None)
    assert island.risk == 0 and island.reasons == []


def test_own_code_origin_is_where_the_models_code_between_modules_made_inf():
    leaves = {"a", "b", "c"}
    # 'a' gave finite values, 'b' was handed inf: the model's code between them made it.
    reports = [
        module("a", 0),
        module("b", 1, nonfinite_output=4, nonfinite_input=3),
        module("c", 2, nonfinite_output=4, nonfinite_input=4),
        module("(model)", 3, nonfinite_output=4, overflow_origin=True),
    ]
    assert own_code_origin(reports, leaves) == ("a", "b")
    assert between(("a", "b")) == "after 'a', before 'b'"
    # After the last module: no module was handed inf/NaN.
    last = [module("a", 0), module("b", 1), module("(model)", 2, overflow_origin=True)]
    assert own_code_origin(last, leaves) == ("b", None)
    assert between(("b", None)) == "after 'b', the last module"
    # Before the first module: its first module was handed inf/NaN.
    first = [module("a", 0, nonfinite_input=1), module("(model)", 1, overflow_origin=True)]
    assert own_code_origin(first, leaves) == (None, "a")
    # A module inside started it; a model without children is a leaf itself.
    started = [module("a", 0, overflow_origin=True), module("(model)", 1, overflow_origin=True)]
    assert own_code_origin(started, leaves) is None
    assert own_code_origin(last, leaves | {"(model)"}) is None
    assert own_code_origin([module("(model)", 0, nonfinite_output=1)], leaves) is None


def test_where_inf_starts_outranks_values_and_gradients_far_beyond_the_range():
    # 1e9 x float16's max, in values and in gradients, once counted 1e9 and ranked the
    # origin (1000) second: the ranking is origin first, then the range.
    far = module("far", 0, max_output=1e9 * F16_MAX, max_input=1e9 * F16_MAX)
    score(far, torch.float16, F16_MAX, ("o", "forward"))
    origin = module("o", 1, nonfinite_output=1)
    score(origin, torch.float16, F16_MAX, ("o", "forward"))
    root = module("(model)", 2, max_output=2 * F16_MAX)
    score(root, torch.float16, F16_MAX, None, own_code=("a", "b"))
    assert origin.risk > far.risk and root.risk > far.risk > 100
    assert root.reasons[0] == "inf/NaN starts in its own forward code, after 'a', before 'b'"
    # With the model's code the origin, the leaf origin is not flagged as one too.
    leaf = module("o", 1, nonfinite_output=1)
    score(leaf, torch.float16, F16_MAX, ("o", "backward"), own_code=("a", "b"))
    assert leaf.risk == 0


def test_an_infinite_error_is_not_scored_as_an_error():
    # inf comes from inf/NaN (flagged where it starts) or from an all-zero float32
    # reference (relative_error): neither is a rounding error to rank by size.
    for figures in ({"output_rel_error": math.inf}, {"grad_rel_error": math.inf}):
        rep = module("z", 0, **figures)
        score(rep, torch.float16, F16_MAX, None)
        assert rep.risk == 0 and rep.reasons == []


def test_loss_scale_range_lifts_small_gradients_and_keeps_large_ones_in_range():
    info = torch.finfo(torch.float16)
    reports = [
        module("a", 0, min_grad=1e-9, max_grad=1e-2),
        module("b", 1, min_grad=1e-7, max_grad=1e-3, max_param_grad=0.5),
        module("f", 2, min_grad=1e-20, max_grad=1e3, float32=True),  # not in float16
    ]
    scale, (low, high) = loss_scale_range(reports, torch.float16)
    assert low == pytest.approx(info.tiny / 1e-9) and high == pytest.approx(info.max / 0.5)
    # A power of two near the middle of the range in log space, and inside it.
    assert scale == 2.0 ** math.floor(math.log2(math.sqrt(low * high)))
    assert low <= scale <= high
    # No loss scale for bfloat16 or float32, nor without gradients to place.
    assert loss_scale_range(reports, torch.bfloat16) == (None, None)
    assert loss_scale_range([module("a", 0, min_grad=0.0)], torch.float16) == (None, None)
