"""The 16-bit doctor's advice: the sentences ``Report.advice`` holds, each a remedy with the
call that applies it (a keep list, bfloat16, a loss scaler's starting scale or range)."""

from __future__ import annotations

import math

import torch

from mixprec.doctor.headroom import smallest_subnormal
from mixprec.doctor.report import Report
from mixprec.doctor.risk import UNDERFLOW_LIMIT, between

__all__ = ["advice"]


def _scale(value: float) -> str:
    """A loss scale as the advice writes it: ``2**k`` for a power of two (``:g`` rounded
    2**49 to 5.6295e+14, which copied is no power of two, and scaling is then inexact)."""
    k = math.log2(value) if value > 0 else math.nan
    return f"2**{int(k)}" if math.isfinite(k) and k == int(k) and abs(k) >= 16 else f"{value:g}"


def advice(report: Report, compute: torch.dtype, left: set[str]) -> list[str]:
    """What to do about what ``report`` found. ``compute``: the policy's compute dtype;
    ``left``: the leaves still computing in 16 bits with the recommendation applied."""
    said: list[str] = []
    float32_fails = not math.isfinite(report.loss_float32)
    if float32_fails:
        said.append(
            f"the float32 model's loss is {report.loss_float32} on this batch too: it "
            "overflows in float32, so no 16-bit dtype or keep list fixes it; bring the "
            "weights or inputs back into range (a lower learning rate if training diverged)"
        )
    if report.inputs_overflow:
        where, largest = max(report.inputs_overflow, key=lambda found: found[1])
        said.append(
            f"the batch's {where} reach {largest:.3g}, past {report.compute_dtype}'s range: at "
            f"{report.level} the model casts its inputs to {report.compute_dtype} before any "
            "layer runs, so they arrive as inf and no list of layers to keep helps while they "
            "do. Scale them into range (normalise the features) and diagnose again, as layers "
            "may need keeping too, or use level 'O1', where a layer kept in float32 takes its "
            "input as it comes (diagnose at level='O1' for that keep list)"
        )
    if report.own_code is not None:
        # Code after a kept module takes its float32 output (O1 to O3).
        after = report.own_code[0]
        said.append(
            f"inf/NaN starts in {report.model or 'the model'}.forward's own code, not in a "
            f"module: an operation there ({between(report.own_code)}) overflows "
            f"{report.compute_dtype}; "
            + (
                f"with {after!r} kept in float32 (below) it runs on float32 values"
                if after is not None and after in report.recommended_keep_float32
                else "compute it in float32 (.float() on its operands) or keep it in range"
            )
        )
    if report.recommended_keep_float32:
        said.append(
            "keep in float32: auto_mixed_precision(..., keep_float32="
            f"{report.recommended_keep_float32!r})"
        )
        if not left:
            # The gain reason is a module's; the model's own code is placed in its own line.
            why = (
                ""
                if report.own_code is not None
                else " (the gradients before the overflowing layers are as large as their gain)"
            )
            said.append(
                "that keeps every module in float32: no float16 keep list fixes this model"
                + why
                + ("" if report.bfloat16_would_help or float32_fails else "; train it in float32")
            )
    if report.bfloat16_would_help:
        said.append(
            "every value fits bfloat16's range: policy 'mixed_bfloat16' avoids the overflow "
            "without keeping layers in float32"
        )
    reached = report.loss_scale_reached
    if report.backoff_steps and reached is not None and left:
        top = max((m for m in report.modules if m.name in left), key=lambda m: m.max_backward)
        said.append(
            f"{'with that, ' if report.recommended_keep_float32 else ''}the float16 backward "
            f"holds gradients up to {top.max_backward:.3g} (in {top.name!r}): a "
            f"DynamicLossScaler starting at {_scale(report.loss_scale)} skips the first "
            f"{report.backoff_steps} steps backing off to {_scale(reached)}; start it there: "
            f"LossScaleOptimizer(..., loss_scaler=DynamicLossScaler(init_scale={_scale(reached)}))"
        )
    check = report.check
    if check is not None and check.added:
        said.append(
            f"the plan's check over {check.steps} {check.optimizer} steps found "
            f"{', '.join(map(repr, check.added))} overflowing after the weights moved: kept "
            "in float32 (in the list above)"
        )
    if check is not None and not check.passed:
        said.append(
            f"the plan still fails its check after {check.rounds} rounds: {check.applied} of "
            f"{check.steps} {check.optimizer} steps applied, forward "
            f"{'finite' if check.finite else 'not finite'} after them: use bfloat16, or a "
            "lower learning rate if training diverges in float32 too"
        )
    # The loss scales that fit every 16-bit gradient, if any: an empty range has no example.
    fits = (
        report.loss_scale_range is not None
        and report.loss_scale_range[0] <= report.loss_scale_range[1]
    )
    scale = report.loss_scale_reached or report.loss_scale
    # Written as the scalers take it: 5.49756e+11 copied was no power of two, and above
    # DynamicLossScaler's default max_scale it was refused as an init_scale.
    suggested = report.suggested_loss_scale or 0.0
    larger = (
        f" (suggested: {_scale(suggested)}"
        + (", with max_scale raised past its default 2**24" if suggested > 2.0**24 else "")
        + ")"
        if fits and suggested > scale
        else ""
    )
    if report.at_edge:
        said.append(
            f"at the edge: the small gradients of {', '.join(map(repr, report.at_edge))} "
            f"sit within the headroom of {report.compute_dtype}'s flush to zero at loss "
            f"scale {scale:g}; a larger loss scale gives them room{larger}"
        )
    # Past it: below the smallest subnormal at that scale (flagged by flag_small_gradients;
    # those over the underflow limit at report.loss_scale have the range lines below).
    past = [
        m.name
        for m in sorted(report.modules, key=lambda m: m.order)
        if m.name in left
        and m.name not in report.at_edge
        and m.small_grad_fraction > 1
        and m.grad_underflow <= UNDERFLOW_LIMIT
    ]
    if past:
        said.append(
            f"past the edge: at loss scale {scale:g} some small gradients of "
            f"{', '.join(map(repr, past))} fall below {report.compute_dtype}'s smallest "
            f"subnormal ({smallest_subnormal(compute):.3g}) and flush to zero"
            + (f"; a larger loss scale lifts them{larger}" if larger else "")
        )
    if compute == torch.float16 and report.loss_scale_range is not None:
        low, high = report.loss_scale_range
        scale = report.suggested_loss_scale or 1.0
        # DynamicLossScaler's default max_scale is 2**24: raise it when more is needed.
        ceiling = ""
        if scale > 2.0**24:
            ceiling = f", max_scale={_scale(2.0 ** math.floor(math.log2(max(high, scale))))}"
        if low > high:  # no range to pick from: what to do instead
            said.append(
                "no single float16 loss scale fits both the smallest and the largest "
                "gradients: use bfloat16, or keep the layers with the largest gradients in "
                "float32"
            )
        elif any(m.grad_underflow > UNDERFLOW_LIMIT for m in report.modules):
            said.append(
                f"gradients underflow float16 at loss scale {report.loss_scale:g}: use a "
                f"loss scale in [{low:.3g}, "
                f"{high:.3g}], e.g. StaticLossScaler({_scale(scale)}) or "
                f"DynamicLossScaler(init_scale={_scale(scale)}{ceiling})"
            )
    return said
