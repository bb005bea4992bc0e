"""The headroom (``mixprec.doctor.headroom``), on hand-made figures: how close each tensor
came to a limit, the keep list that leaves a margin below float16's max (for values and for
gradients at the scale floor), and small gradients named at the edge of the flush to zero."""

from __future__ import annotations

import pytest
import torch

from mixprec.doctor.headroom import (
    HEADROOM,
    flag_small_gradients,
    headroom_text,
    measure,
    percent,
    recommend,
    smallest_subnormal,
)
from tests.doctor.cases import module

F16 = torch.float16
F16_MAX = float(torch.finfo(F16).max)


def test_the_margin_is_a_factor_16_and_fractions_read_as_percentages():
    assert HEADROOM == 2.0**-4 and headroom_text(HEADROOM) == "2**-4"
    assert headroom_text(0.1) == "0.1"
    assert smallest_subnormal(F16) == 2.0**-24
    assert smallest_subnormal(torch.bfloat16) == 2.0**-133
    fractions = (0.0, 5e-6, 1.234e-4, 0.0625, 0.9847, 0.9974, 2.75, 12.0)
    assert [percent(f) for f in fractions] == [
        "0%", "<0.01%", "0.0123%", "6.25%", "98.5%", "99.7%", "275%", ">999%",
    ]  # fmt: skip


def test_measure_gives_each_tensors_share_of_the_range():
    rep = module("a", 0, max_input=F16_MAX / 2, max_output=F16_MAX / 4, max_param_grad=8.0)
    measure([rep], F16_MAX, floor=1.0)
    assert rep.input_fraction == 0.5 and rep.output_fraction == 0.25
    assert rep.grad_fraction == 8.0 / F16_MAX  # gradients at the floor's scale
    assert rep.range_used == 0.5


def test_values_within_the_headroom_are_kept_with_the_reason():
    """The issue's case: the ReLU after a kept block hands the float16 Linear inputs at 98%
    of the max. Kept, with how close they came; values beyond the range keep their reason
    from ``risk.score``; values well inside the range and float32 islands are left."""
    leaves = {"relu", "linear", "fine", "beyond", "island"}
    reports = [
        module("relu", 0, max_output=0.98 * F16_MAX),
        module("linear", 1, max_input=0.98 * F16_MAX, max_output=1e3),
        module("fine", 2, max_input=1e3, max_output=1e3),
        module("beyond", 3, max_output=2 * F16_MAX),
        module("island", 4, max_output=0.98 * F16_MAX, float32=True),
    ]
    measure(reports, F16_MAX, 1.0)
    keep = recommend(reports, leaves, F16, F16_MAX, 1.0, HEADROOM)
    assert keep == ["relu", "linear", "beyond"]
    relu = reports[0]
    assert relu.reasons == [
        "values up to 6.42e+04 are 98% of float16 max 6.55e+04, within the headroom (2**-4): "
        "a few optimizer steps can push them over"
    ]
    assert 20 < relu.risk < 100  # below values beyond the range, above underflow
    assert reports[3].reasons == [] and reports[2].reasons == []
    # No margin (headroom 1): only what leaves the range, as at step 0.
    assert recommend(reports, leaves, F16, F16_MAX, 1.0, 1.0) == ["beyond"]


def test_gradients_within_the_headroom_at_the_scale_floor_are_kept():
    """A dynamic scaler backs off until the backward fits, but not below its floor (1): a
    leaf whose gradients come within the headroom even there has no room to back off into."""
    near = module("near", 0, max_param_grad=0.1 * F16_MAX)
    over = module("over", 1, max_input_grad=2 * F16_MAX)
    fine = module("fine", 2, max_grad=0.01 * F16_MAX)
    reports = [near, over, fine]
    measure(reports, F16_MAX, 1.0)
    assert recommend(reports, {"near", "over", "fine"}, F16, F16_MAX, 1.0, HEADROOM) == [
        "near", "over",
    ]  # fmt: skip
    assert near.reasons == [
        "gradients up to 6.55e+03 are 10% of float16 max even at loss scale 1, within the "
        "headroom (2**-4)"
    ]
    assert over.reasons == [
        "gradients up to 1.31e+05 exceed float16 max 6.55e+04 even at loss scale 1"
    ]
    assert over.risk > 100 > near.risk > 20 and fine.risk == 0


def test_small_gradients_near_the_flush_are_named_at_the_edge():
    """Within a factor 16 of float16's smallest subnormal (2**-24) at the scale training
    runs at: named, not kept (a larger loss scale is the remedy)."""
    scale = 2.0**4
    edge = module("edge", 0, min_grad=2.0**-22 / scale)  # 2**-22 once scaled: 1/4 of the range
    roomy = module("roomy", 1, min_grad=2.0**-12 / scale)
    flushed = module("flushed", 2, min_grad=2.0**-26 / scale, grad_underflow=0.3)
    flushed.reasons.append("30% of gradients flush to zero")
    kept = module("kept", 3, min_grad=2.0**-22 / scale)
    reports = [edge, roomy, flushed, kept]
    at_edge = flag_small_gradients(reports, {"edge", "roomy", "flushed"}, F16, scale, HEADROOM)
    assert at_edge == ["edge"]  # "flushed" is past the edge, and says so
    assert edge.small_grad_fraction == pytest.approx(0.25) and edge.range_used == 0.25
    assert roomy.small_grad_fraction == pytest.approx(2.0**-12)
    assert edge.reasons == [
        "at the edge: small gradients (1.49e-08) x loss scale 16 sit within the headroom "
        "(2**-4) of float16's flush to zero (5.96e-08)"
    ]
    assert flushed.reasons == ["30% of gradients flush to zero"]  # not flagged twice
    assert kept.reasons == [] and kept.small_grad_fraction == pytest.approx(0.25)


def test_small_gradients_past_the_flush_say_how_many_flush_not_at_the_edge():
    """Small gradients x the scale below the smallest subnormal are gone, not "within the
    headroom": flagged with the share of gradients that flushes at that scale (where the
    doctor measured it), and not named at the edge. A module whose output gradient is
    float32 is measured against float32's flush point: nothing. All of a module's small
    gradients rounding up to the subnormal (none flushed): at the edge."""
    scale = 2.0**4
    past = module("past", 0, min_grad=2.0**-28 / scale)  # 2**-28 once scaled: 16x below
    unknown = module("unknown", 1, min_grad=2.0**-28 / scale)
    rounded = module("rounded", 2, min_grad=1.5 * 2.0**-25 / scale)
    wide = module("wide", 3, min_grad=2.0**-28 / scale, grad_dtype="float32")
    reports = [past, unknown, rounded, wide]
    half = {"past", "unknown", "rounded", "wide"}
    flushed = {"past": 0.25, "rounded": 0.0}
    at_edge = flag_small_gradients(reports, half, F16, scale, HEADROOM, flushed)
    assert at_edge == ["rounded"]
    assert past.reasons == [
        "small gradients (2.33e-10) x loss scale 16 = 3.73e-09, 16x below float16's smallest "
        "subnormal (5.96e-08): 25% of its gradients flush to zero at that scale"
    ]
    assert past.risk == pytest.approx(2.25) and past.small_grad_fraction == pytest.approx(16)
    assert unknown.reasons[0].endswith("(5.96e-08): they flush to zero")
    assert rounded.reasons[0].startswith("at the edge: ")
    assert wide.reasons == [] and wide.risk == 0 and wide.small_grad_fraction < 1e-30
