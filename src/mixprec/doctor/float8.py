"""The float8 doctor: what torchao's float8 casts do to each converted Linear layer, and which
layers to keep in bfloat16.

``diagnose_float8`` prepares two copies of a float32 model, one under a float8 policy and one
under ``mixed_bfloat16`` (same level, same ``keep_float32``), and runs one batch through each.
For every converted layer it takes the first call's input, weight and output gradient from
the float8 run and

* redoes every float8 cast the recipe makes of them (the casts are read from torchao's
  ``Float8LinearConfig`` for the recipe; scales come from torchao's own ``tensor_to_scale``,
  casts from its ``to_fp8_saturated``): amax, scale, the fraction of values the cast clips at
  the format's max (saturate), and the fractions of non-zero values it turns into 0 (flush)
  or into subnormals (fewer significant bits than normal values);
* replays the layer on those same tensors twice, through torchao's float8 Linear and as the
  bfloat16 ``F.linear`` that ``mixed_bfloat16`` computes, and compares the output, the input
  gradient and the weight gradient. Replaying on the same tensors isolates the layer's own
  float8 error: errors made upstream do not count against it, so one bad layer does not
  make every layer after it look bad.

Why both: a relative error ``||a - b|| / ||b||`` is a norm, and a few huge values dominate
it. A layer whose input has outlier features (a column in raw units next to normalised ones,
or LLM-style "massive activations") gets a scale set by the outliers; every ordinary value
then sits below E4M3's smallest normal number or flushes to 0, yet the output error looks
small because the outliers' share of the output is computed fine. The underflow fraction
(values flushed or left subnormal) sees that; the error sees damage spread evenly.

Saturation is 0 by construction with torchao's dynamic scaling (each scale is
``max_of_format / amax`` of the very tensor it scales; the rowwise recipes round it down to
a power of two, which only lowers it); it is reported because a non-zero figure means the
scale did not come from the tensor (a bug, or a future static-scaling recipe).
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Callable, Iterable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from mixprec._calling import call
from mixprec._errors import ArgumentError
from mixprec._rng import same_draws
from mixprec.doctor._common import (
    Recorder,
    check_callable,
    check_finite_batch,
    float32_model,
    float32_upcast,
    relative_error,
)
from mixprec.doctor.float8_casts import (
    OPERANDS,
    CastStats,
    Float8Cast,
    cast_stats,
    layer_casts,
    recipe_casts,
)
from mixprec.doctor.float8_inputs import (
    check_float32_runs,
    keep_names,
    keep_with,
    scalar_loss,
    settings_text,
)
from mixprec.doctor.float8_report import Float8LayerReport, Float8Report
from mixprec.float8 import Float8Options, float8_choice, is_float8, torchao_float8
from mixprec.levels import KeepEntry, auto_mixed_precision, keep_list, resolve_level
from mixprec.policy import FLOAT8_PRESETS, PolicyLike, get_policy
from mixprec.region import get_region

__all__ = [
    "FLOAT8_GRAD_ERROR_LIMIT",
    "FLOAT8_OUTPUT_ERROR_LIMIT",
    "FLOAT8_UNDERFLOW_LIMIT",
    "CastStats",
    "Float8Cast",
    "Float8LayerReport",
    "Float8Report",
    "cast_stats",
    "diagnose_float8",
    "recipe_casts",
]

# -- thresholds: when float8 hurts a layer ------------------------------------------------------
#
# E4M3 keeps 3 mantissa bits: a cast rounds each value by at most 2**-4 relative, about 2.6%
# RMS; E5M2 by at most 2**-3, about 5.2% RMS. A matmul of two cast operands is then off by
# about sqrt(2.6**2 + 2.6**2) = 3.7% (E4M3 x E4M3) or 5.8% (E5M2 output gradient x E4M3
# weight, tensorwise's input gradient). Measured, a layer's own error against bfloat16 on
# healthy layers (random-init MLPs and test_float8's LM, CPU, all three recipes): output
# 0.022-0.041, input gradient 0.035-0.043 (rowwise) and 0.055-0.062 (tensorwise), weight
# gradient 0.025-0.065 (rowwise_with_gw_hp: 0, computed in bfloat16). The limits sit near 4x
# the worst healthy figure, so only a layer float8 really damages is named, not one that drew
# an unlucky batch.
FLOAT8_OUTPUT_ERROR_LIMIT = 0.15
FLOAT8_GRAD_ERROR_LIMIT = 0.25
# Fraction of a tensor's non-zero values that a cast flushes to 0 or leaves subnormal (fewer
# significant bits than a normal value; relative error up to 50% at the smallest). A scale of
# max / amax puts a value below the format's smallest normal number (E4M3: 2**-6) when it is
# below amax * 2**-6 / 448, about 3.5e-5 of amax (E5M2: 1e-9), so a Gaussian-like tensor
# loses almost nothing: at most 0.2% measured on the healthy layers above. 5% (the 16-bit
# doctor's gradient underflow limit) means a real part of the tensor lies more than four
# orders of magnitude below its largest values: outliers set the scale and the ordinary
# values are lost. (The test's sentinel column: 99.6% under tensorwise; 3% under rowwise,
# where only the two rows holding it lose.)
FLOAT8_UNDERFLOW_LIMIT = 0.05
# Any clipped value is damage (see the module docstring: dynamic scaling never clips).
FLOAT8_SATURATION_LIMIT = 0.0


def _replay(
    module: nn.Linear, x: torch.Tensor, grad_output: torch.Tensor | None, input_grad: bool
) -> tuple[float, float | None, float | None]:
    """The layer's own error: torchao's float8 Linear against a bfloat16 ``F.linear`` on the
    same input (and, backward, the same output gradient). Returns the relative errors of the
    output, the input gradient and the weight gradient."""
    weight, bias = module.weight, module.bias
    weight_grad = grad_output is not None and weight.requires_grad
    input_grad = grad_output is not None and input_grad
    with torch.enable_grad():
        x8 = x.detach().requires_grad_(input_grad)
        out8 = module(x8)
        x16 = x.detach().to(torch.bfloat16).requires_grad_(input_grad)
        w16 = weight.detach().to(torch.bfloat16).requires_grad_(weight_grad)
        b16 = None if bias is None else bias.detach().to(torch.bfloat16)
        out16 = F.linear(x16, w16, b16)
        output_error = relative_error(out8, out16)
        if grad_output is None or not (input_grad or weight_grad):
            return output_error, None, None
        wanted8 = [t for t, on in ((x8, input_grad), (weight, weight_grad)) if on]
        wanted16 = [t for t, on in ((x16, input_grad), (w16, weight_grad)) if on]
        grads8 = list(torch.autograd.grad(out8, wanted8, grad_output.to(out8.dtype)))
        grads16 = list(torch.autograd.grad(out16, wanted16, grad_output.to(torch.bfloat16)))
    gin = relative_error(grads8.pop(0), grads16.pop(0)) if input_grad else None
    gw = relative_error(grads8.pop(0), grads16.pop(0)) if weight_grad else None
    return output_error, gin, gw


def _worst(casts: list[Float8Cast], operand: str, what: str) -> float | None:
    values = [getattr(c.stats, what) for c in casts if c.operand == operand]
    return max(values) if values else None


def _first(casts: list[Float8Cast], operand: str) -> CastStats | None:
    return next((c.stats for c in casts if c.operand == operand), None)


def _as_seen(module: nn.Linear, entry: dict[str, Any]) -> dict[str, Any]:
    """A recorded call (``Recorder``) as the float8 layer meets it: ``input`` as its bfloat16
    region hands it to torchao, whether that input needs a gradient, and ``grad_output``
    (``None`` when no gradient reached the layer)."""
    region = get_region(module)
    x = entry["input"]
    if region is not None and region.cast_inputs:
        x = x.to(region.compute_dtype)
    return {"input": x, "input_needs_grad": entry["input_needs_grad"], "grad_output": entry["grad"]}


def _operands(module: nn.Linear, seen: dict[str, Any]) -> dict[str, torch.Tensor]:
    tensors = {"input": seen["input"], "weight": module.weight.detach()}
    if seen["grad_output"] is not None:
        tensors["grad_output"] = seen["grad_output"]
    return tensors


def _layer_report(name: str, module: nn.Linear, seen: dict[str, Any]) -> Float8LayerReport:
    x, grad_output = seen["input"], seen["grad_output"]
    # The config torchao's Float8Linear holds: the recipe's, with any change mixprec made.
    casts = layer_casts(module.config, _operands(module, seen))
    out_err, gin_err, gw_err = _replay(module, x, grad_output, seen["input_needs_grad"])
    first = {op: _first(casts, op) for op in OPERANDS}

    def flat(operand: str, what: str) -> Any:
        stats = first[operand]
        return None if stats is None else getattr(stats, what)

    report = Float8LayerReport(
        name=name,
        shape=(int(module.weight.shape[0]), int(module.weight.shape[1])),
        amax_input=flat("input", "amax"),
        amax_weight=flat("weight", "amax"),
        amax_grad_output=flat("grad_output", "amax"),
        scale_input=flat("input", "scale"),
        scale_weight=flat("weight", "scale"),
        scale_grad_output=flat("grad_output", "scale"),
        saturated_input=_worst(casts, "input", "saturated") or 0.0,
        saturated_weight=_worst(casts, "weight", "saturated") or 0.0,
        saturated_grad_output=_worst(casts, "grad_output", "saturated"),
        flushed_input=_worst(casts, "input", "flushed") or 0.0,
        flushed_weight=_worst(casts, "weight", "flushed") or 0.0,
        flushed_grad_output=_worst(casts, "grad_output", "flushed"),
        subnormal_input=_worst(casts, "input", "subnormal") or 0.0,
        subnormal_weight=_worst(casts, "weight", "subnormal") or 0.0,
        subnormal_grad_output=_worst(casts, "grad_output", "subnormal"),
        output_error=out_err,
        grad_input_error=gin_err,
        grad_weight_error=gw_err,
        casts=casts,
    )
    report.reasons = _reasons(report)
    return report


def _reasons(r: Float8LayerReport) -> list[str]:
    """Why float8 hurts the layer (empty: it does not); thresholds at the top of the module."""
    reasons = []
    for operand in OPERANDS:
        casts = [c for c in r.casts if c.operand == operand]
        if not casts:
            continue
        worst = max(casts, key=lambda c: c.stats.underflow)
        s = worst.stats
        where = f"{worst.dtype} {worst.granularity}, amax {s.amax:.3g}, scale {s.scale:.3g}"
        if s.underflow > FLOAT8_UNDERFLOW_LIMIT:
            reasons.append(
                f"{operand}: {100 * s.flushed:.0f}% flushes to 0, {100 * s.subnormal:.0f}% "
                f"subnormal ({where})"
            )
        clipped = max(casts, key=lambda c: c.stats.saturated)
        if clipped.stats.saturated > FLOAT8_SATURATION_LIMIT:
            reasons.append(
                f"{operand}: {100 * clipped.stats.saturated:.2g}% saturates at "
                f"{clipped.dtype} max ({clipped.granularity})"
            )
    for what, error, limit in (
        ("output", r.output_error, FLOAT8_OUTPUT_ERROR_LIMIT),
        ("input gradient", r.grad_input_error, FLOAT8_GRAD_ERROR_LIMIT),
        ("weight gradient", r.grad_weight_error, FLOAT8_GRAD_ERROR_LIMIT),
    ):
        if error is not None and error > limit:
            reasons.append(f"{what} error vs bfloat16 {error:.2g} > {limit}")
    return reasons


def _rowwise_would_do(
    report: Float8LayerReport, module: nn.Linear, seen: dict[str, Any]
) -> float | None:
    """For a tensorwise layer flagged for underflow only: the worst underflow fraction under
    the rowwise recipe's casts (one scale per row or column), or ``None``. Outliers confined
    to a few rows (tokens, samples) set the one scale of the whole tensor, and only their own
    rows' scales under rowwise scaling."""
    errors = (
        (report.output_error, FLOAT8_OUTPUT_ERROR_LIMIT),
        (report.grad_input_error, FLOAT8_GRAD_ERROR_LIMIT),
        (report.grad_weight_error, FLOAT8_GRAD_ERROR_LIMIT),
    )
    if (
        not report.hurts
        or any(error is not None and error > limit for error, limit in errors)
        or any(c.stats.saturated > FLOAT8_SATURATION_LIMIT for c in report.casts)
    ):
        return None
    rowwise = torchao_float8().Float8LinearConfig.from_recipe_name("rowwise")
    casts = layer_casts(rowwise, _operands(module, seen))
    return max(c.stats.underflow for c in casts)


def _options_text(options: Float8Options) -> str:
    """``Float8Options(...)`` with the fields that differ from their defaults."""
    changed = [
        f"{f.name}={getattr(options, f.name)!r}"
        for f in dataclasses.fields(options)
        if getattr(options, f.name) != f.default
    ]
    return f"Float8Options({', '.join(changed)})"


def _advice(
    report: Float8Report, options: Float8Options | None, rowwise: dict[str, float], settings: str
) -> list[str]:
    advice = []
    hurt = [r.name for r in report.layers if r.hurts]
    if hurt:
        extra = "" if options is None else f", float8={_options_text(options)}"
        advice.append(
            f"float8 hurts {len(hurt)} of {len(report.layers)} float8 layers; keep them in "
            f"bfloat16: auto_mixed_precision(model, {report.policy!r}{settings}{extra}, "
            f"keep_bfloat16={report.recommended_keep_bfloat16!r})"
        )
    else:
        advice.append(
            f"healthy: float8 costs each of the {len(report.layers)} float8 layers no more than "
            f"its usual rounding (output error <= {FLOAT8_OUTPUT_ERROR_LIMIT}, gradient error "
            f"<= {FLOAT8_GRAD_ERROR_LIMIT}, underflow <= {FLOAT8_UNDERFLOW_LIMIT:.0%})"
        )
    helped = {n: f for n, f in rowwise.items() if f <= FLOAT8_UNDERFLOW_LIMIT}
    if helped:
        worst = max(helped.values())
        advice.append(
            f"{', '.join(helped)}: per-row scales would leave at most {100 * worst:.2g}% "
            "flushed or subnormal: "
            "policy 'mixed_float8_rowwise' may keep them in float8 (the outliers sit in a "
            "few rows); run diagnose_float8 with it to check"
        )
    if report.not_run:
        advice.append(f"not called by this batch, not diagnosed: {', '.join(report.not_run)}")
    return advice


def diagnose_float8(
    model: nn.Module,
    inputs: Any,
    targets: Any,
    loss_fn: Callable[..., torch.Tensor],
    policy: PolicyLike = "mixed_float8",
    level: str = "auto",
    *,
    float8: Float8Options | None = None,
    keep_bfloat16: Iterable[KeepEntry] = (),
    keep_float32: Iterable[KeepEntry] = (),
) -> Float8Report:
    """Run one batch under the float8 ``policy`` and under ``mixed_bfloat16`` and report, per
    float8 Linear layer, what each float8 cast does to its input, weight and output gradient
    (amax, scale, saturated, flushed and subnormal fractions) and its own error against
    bfloat16; name the layers float8 hurts in ``recommended_keep_bfloat16`` (see the module
    docstring).

    ``model`` is a float32 model (a 16-bit one is diagnosed as its float32 upcast copy, with
    one warning); it is copied, never modified. ``policy``: a float8 policy (``mixed_float8``,
    ``mixed_float8_rowwise``, ``mixed_float8_rowwise_with_gw_hp``, or a ``Policy`` with a
    ``float8_recipe``). ``level``, ``float8``, ``keep_bfloat16`` and
    ``keep_float32``: as ``auto_mixed_precision`` takes them, to diagnose the model as it
    will be trained. Refused in one line: a batch holding inf/NaN (every layer would look
    hurt), an empty one, one the float32 model fails on too, and a ``loss_fn`` that does not
    return one floating-point value."""
    model = float32_model(model, "diagnose_float8")
    check_callable("diagnose_float8", "loss_fn", loss_fn, "a callable (output, targets) -> loss")
    check_finite_batch(inputs, targets, "diagnose_float8")  # and not empty
    resolved = get_policy(policy)
    recipe = resolved.float8_recipe
    if recipe is None:
        raise ArgumentError(
            f"diagnose_float8(policy={resolved.name!r}) needs a float8 policy; valid: "
            f"{', '.join(FLOAT8_PRESETS)} (for other policies use mixprec.diagnose)"
        )
    lvl = resolve_level(level, resolved)
    if lvl == "O0":
        raise ArgumentError(
            f"diagnose_float8(level={level!r}): O0 runs everything in float32 and converts no "
            "layer to float8; valid: O1, O2, O3, auto (O2)"
        )
    # By name: the copies below hold other modules than any given here.
    given = keep_names(model, keep_list(keep_bfloat16, "keep_bfloat16"), "keep_bfloat16")
    kept32 = keep_names(model, keep_list(keep_float32), "keep_float32")
    # A 16-bit model is diagnosed as its float32 upcast, from which both copies below start.
    model = float32_upcast(model, "diagnose_float8")
    mixed = auto_mixed_precision(
        copy.deepcopy(model),
        resolved,
        lvl,
        kept32,
        keep_bfloat16=given,
        float8=float8,
    )
    layers = {n: m for n, m in mixed.named_modules() if is_float8(m) and isinstance(m, nn.Linear)}
    if not layers:
        considered = [(n, c) for n, m in mixed.named_modules() if (c := float8_choice(m))]
        why = "; ".join(f"{n}: {c.reason}" for n, c in considered[:3])
        more = f"; and {len(considered) - 3} more" if len(considered) > 3 else ""
        by_size = float8 is None or float8.min_features is None
        hint = " Pass float8=Float8Options(min_features=...) to convert smaller layers." * by_size
        raise ArgumentError(
            f"diagnose_float8: policy {resolved.name!r} at level {lvl} converts no Linear "
            "layer of this model to float8 "
            f"({len(considered)} considered{': ' + why + more if considered else ''}).{hint}"
        )
    with same_draws() as rewind:
        with Recorder(layers) as recorder:
            rewind()
            try:
                loss8 = loss_fn(call(mixed, inputs), targets)
            except Exception:
                check_float32_runs(model, inputs, targets, loss_fn)
                raise
            if scalar_loss(loss8).requires_grad:
                loss8.backward()
        reference = auto_mixed_precision(copy.deepcopy(model), "mixed_bfloat16", lvl, kept32)
        rewind()
        with torch.no_grad():
            loss16 = loss_fn(call(reference, inputs), targets)

    # Forward order; a Linear's first floating-point argument is its input.
    seen = {n: _as_seen(layers[n], entry) for n, entry in recorder.calls.items()}
    reports = [_layer_report(name, layers[name], seen[name]) for name in seen]
    report = Float8Report(
        policy=resolved.name,
        recipe=recipe,
        level=lvl,
        loss_float8=float(loss8.detach().float()),
        loss_bfloat16=float(loss16.float()),
        layers=reports,
        recommended_keep_bfloat16=keep_with(given, [r.name for r in reports if r.hurts]),
        not_run=[n for n in layers if n not in seen],
        advice=[],
    )
    rowwise: dict[str, float] = {}
    # FSDP's float8 all-gather needs one scale per tensor: no rowwise hint then.
    if recipe == "tensorwise" and not getattr(float8, "fsdp_float8_all_gather", False):
        for r in reports:
            underflow = _rowwise_would_do(r, layers[r.name], seen[r.name])
            if underflow is not None:
                rowwise[r.name] = underflow
    report.advice = _advice(report, float8, rowwise, settings_text(level, lvl, kept32))
    return report
