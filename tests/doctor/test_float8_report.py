"""The float8 doctor's report (``mixprec.doctor.float8_report``): its text and JSON forms."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("torchao")


@pytest.mark.float8  # runs float8 matmuls on the CPU
def test_report_text_and_json(tensorwise):
    text = str(tensorwise)
    lines = text.splitlines()
    assert (
        lines[0].startswith("float8 doctor: policy mixed_float8 (tensorwise), level O2: loss ")
        and "(bfloat16 " in lines[0]
    )
    assert lines[1].split()[:4] == ["layer", "shape", "amax", "in/w/go"]
    embed_line = next(line for line in lines if line.startswith("embed"))
    assert "64x32" in embed_line and "1e+05/" in embed_line and "input: 1" in embed_line
    assert (
        "- float8 hurts 1 of 3 float8 layers; keep them in bfloat16: auto_mixed_precision("
        "model, 'mixed_float8', float8=Float8Options(min_features=16), keep_bfloat16=['embed'])"
    ) in lines
    data = json.loads(tensorwise.to_json())
    assert data["recommended_keep_bfloat16"] == ["embed"]
    assert data["loss_gap"] == pytest.approx(tensorwise.loss_float8 - tensorwise.loss_bfloat16)
    embed = data["layers"][0]
    assert embed["name"] == "embed" and embed["shape"] == [64, 32]
    assert embed["grad_input_error"] is None
    first = embed["casts"][0]
    assert {k: first[k] for k in ("operand", "gemm", "dtype", "granularity")} == {
        "operand": "input",
        "gemm": "output",
        "dtype": "float8_e4m3fn",
        "granularity": "tensorwise",
    }
    stats = tensorwise.layers[0].casts[0].stats
    assert first["stats"]["amax"] == stats.amax and first["stats"]["flushed"] == stats.flushed
    assert set(first["stats"]) == {
        "amax", "scale", "scale_max", "saturated", "flushed", "subnormal", "nonfinite"
    }  # fmt: skip
