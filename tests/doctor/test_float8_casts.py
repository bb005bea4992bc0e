"""The float8 casts (``mixprec.doctor.float8_casts``): the cast arithmetic on hand-made
tensors, and the casts of each torchao recipe."""

from __future__ import annotations

import math

import pytest

pytest.importorskip("torchao")

import torch

from mixprec.doctor.float8_casts import cast_stats, recipe_casts
from tests.doctor.float8_cases import E4M3, E5M2


def test_tensorwise_scale_flush_and_subnormals_by_hand():
    x = torch.tensor([2.0, -1.0, 1.03, -1.04, 0.5, 0.0, 1e-6, 3e-6, 5e-6])
    s = cast_stats(x, E4M3)
    # amax 2: scale = 448 / 2, exact in float32.
    assert (s.amax, s.scale, s.scale_max) == (2.0, 224.0, 224.0)
    # E4M3's smallest subnormal is 2**-9 and its smallest normal 2**-6; below 2**-10 rounds
    # to 0. Scaled: 1e-6 -> 2.2e-4 and 3e-6 -> 6.7e-4 flush; 5e-6 -> 1.1e-3 is subnormal.
    # Of the 8 non-zero values (the 0 does not count):
    assert (s.flushed, s.subnormal, s.underflow) == (2 / 8, 1 / 8, 3 / 8)
    # The dynamic scale maps amax onto max: nothing clips.
    assert s.saturated == 0.0 and s.nonfinite == 0

    # E5M2: scale 57344 / 2; its smallest normal is 2**-14, so 1e-6 * 28672 = 0.029 is normal.
    s = cast_stats(x, E5M2)
    assert (s.scale, s.flushed, s.subnormal) == (28672.0, 0.0, 0.0)


def test_a_given_scale_saturates_past_max_plus_half_an_ulp():
    x = torch.tensor([2.0, -1.0, 1.03, -1.04, 0.5, 0.0, 1e-6, 3e-6, 5e-6])
    s = cast_stats(x, E4M3, scale=448.0)
    # E4M3's max is 448 and the next step would be 480: up to 464 rounds to max, beyond it is
    # clipped. Scaled: 2 -> 896 and -1.04 -> -465.9 clip; 1.03 -> 461.4 and -1 -> -448 do not.
    assert s.saturated == 2 / 9  # of the 9 finite values
    # 1e-6 -> 4.5e-4 flushes; 3e-6 -> 1.3e-3 and 5e-6 -> 2.2e-3 are subnormal.
    assert (s.flushed, s.subnormal) == (1 / 8, 2 / 8)
    assert (s.scale, s.scale_max) == (448.0, 448.0)


def test_rowwise_scales_are_per_row_and_rounded_down_to_powers_of_two():
    t = torch.tensor([[4.0, 2e-6], [0.5, 2e-6]])
    s = cast_stats(t, E4M3, axis=-1, round_scales_to_power_of_2=True)
    # Row scales 448 / 4 = 112 -> 64 and 448 / 0.5 = 896 -> 512 (rounded down).
    assert (s.amax, s.scale, s.scale_max) == (4.0, 64.0, 512.0)
    # Row 0: 2e-6 * 64 = 1.3e-4 flushes; row 1: 2e-6 * 512 = 1.02e-3 rounds up to 2**-9.
    assert (s.flushed, s.subnormal) == (1 / 4, 1 / 4)
    # One scale (112) for both rows: the row with the small amax loses its small value too.
    assert cast_stats(t, E4M3).flushed == 2 / 4


def test_a_nonfinite_value_zeroes_the_scale():
    s = cast_stats(torch.tensor([1.0, 0.5, math.inf]), E4M3)
    # torchao: scale = 448 / inf = 0, so every finite value flushes.
    assert (s.amax, s.scale, s.nonfinite, s.flushed) == (math.inf, 0.0, 1, 1.0)


def test_cast_stats_wants_a_float8_dtype():
    with pytest.raises(ValueError, match=r"float8_dtype=torch.bfloat16 is not a float8 dtype; "):
        cast_stats(torch.ones(4), torch.bfloat16)


@pytest.mark.parametrize(
    ("recipe", "expected"),
    [
        ("tensorwise", [("input", "output", E4M3, None), ("weight", "output", E4M3, None),
                        ("grad_output", "grad_input", E5M2, None),
                        ("weight", "grad_input", E4M3, None),
                        ("input", "grad_weight", E4M3, None),
                        ("grad_output", "grad_weight", E5M2, None)]),
        ("rowwise", [("input", "output", E4M3, -1), ("weight", "output", E4M3, 0),
                     ("grad_output", "grad_input", E4M3, -1),
                     ("weight", "grad_input", E4M3, -1),
                     ("input", "grad_weight", E4M3, 0),
                     ("grad_output", "grad_weight", E4M3, 0)]),
        # The weight gradient's matmul takes input and output gradient in high precision.
        ("rowwise_with_gw_hp", [("input", "output", E4M3, -1), ("weight", "output", E4M3, 0),
                                ("grad_output", "grad_input", E4M3, -1),
                                ("weight", "grad_input", E4M3, None)]),
    ],
)  # fmt: skip
def test_recipe_casts_follow_torchaos_configs(recipe, expected):
    casts = recipe_casts(recipe)
    assert [c[:4] for c in casts] == expected
    # The rowwise recipes round scales down to powers of two; tensorwise does not.
    assert {c[4] for c in casts} == {recipe != "tensorwise"}


def test_recipe_casts_names_the_valid_recipes():
    with pytest.raises(ValueError, match=r"recipe='blockwise' is not a float8 recipe; valid: "
                       r"tensorwise, rowwise, rowwise_with_gw_hp"):  # fmt: skip
        recipe_casts("blockwise")
