"""How the 16-bit doctor weighs a module: the limits it flags errors and underflow at, where
inf/NaN first appears, each module's risk and reasons, and the range of loss scales that
keeps the 16-bit gradients between the smallest normal number and the largest value."""

from __future__ import annotations

import math

import torch

from mixprec._dtypes import dtype_name
from mixprec.doctor.headroom import BEYOND_CAP
from mixprec.doctor.report import ModuleReport
from mixprec.keep import ROOT_NAME
from mixprec.scaling import DynamicConfig

__all__ = [
    "GRAD_ERROR_LIMIT",
    "ORIGIN_RISK",
    "OUTPUT_ERROR_LIMIT",
    "SCALE_FLOOR",
    "UNDERFLOW_LIMIT",
    "between",
    "loss_scale_range",
    "nonfinite_origin",
    "own_code_origin",
    "score",
]

# Relative error (||mixed - float32|| / ||float32||) above which a module is flagged. Healthy
# layers measured ~4e-4 (float16) and ~3e-3 (bfloat16) on outputs; gradients are noisier
# (ReLU gates flip on rounding near zero): up to 0.05 (float16) and 0.08 (bfloat16). The
# limits sit well above that, so only real damage shows.
OUTPUT_ERROR_LIMIT = {torch.bfloat16: 0.1, torch.float16: 0.02, torch.float32: 1e-4}
GRAD_ERROR_LIMIT = {torch.bfloat16: 0.5, torch.float16: 0.25, torch.float32: 1e-4}
# Fraction of non-zero gradient values that vanish in 16 bits before flagging a module.
UNDERFLOW_LIMIT = 0.05
# The lowest loss scale a float16 run reaches: DynamicLossScaler's default min_scale. Backing
# off below it is not possible, so a backward that overflows float16 there overflows at every
# step: such modules must compute in float32 (or the run needs bfloat16).
SCALE_FLOOR = DynamicConfig().floor
# Risk for where inf/NaN starts: above anything else a module can add up (values and
# gradients beyond the range count at most 100 + BEYOND_CAP each), so it ranks first.
ORIGIN_RISK = 10_000.0


def nonfinite_origin(reports: list[ModuleReport], leaves: set[str]) -> tuple[str, str] | None:
    """Where inf/NaN first appeared: the first leaf (forward order) whose output is
    non-finite from finite inputs; failing that, the first gradient to go non-finite in
    backward order (the leaf run last whose output gradient is non-finite)."""
    ordered = sorted((r for r in reports if r.name in leaves), key=lambda r: r.order)
    for r in ordered:
        if r.overflow_origin:
            return r.name, "forward"
    for r in reversed(ordered):
        if r.nonfinite_grad:
            return r.name, "backward"
    return None


def own_code_origin(
    reports: list[ModuleReport], leaves: set[str]
) -> tuple[str | None, str | None] | None:
    """Where inf/NaN first appeared when the model's own forward code made it (``h * 1e5``
    between two layers): the model, which has children, turned a finite input into a
    non-finite output while no module inside did. Given as the modules around that code:
    (the module finished just before it, the first module handed inf/NaN), either ``None``
    where there is none (before the first module, after the last). ``None`` otherwise."""
    root = next((r for r in reports if r.name == ROOT_NAME), None)
    if root is None or ROOT_NAME in leaves or not root.overflow_origin:
        return None
    inside = sorted((r for r in reports if r.name != ROOT_NAME), key=lambda r: r.order)
    if not inside or any(r.overflow_origin for r in inside):
        return None
    first = next((r for r in inside if r.nonfinite_input), None)
    before = [r.name for r in inside if first is None or r.order < first.order]
    return (before[-1] if before else None), (None if first is None else first.name)


def between(around: tuple[str | None, str | None]) -> str:
    """``own_code_origin``'s place in words: "after 'a', before 'b'"."""
    after, before = around
    said = [f"after {after!r}" if after else "", f"before {before!r}" if before else ""]
    return ", ".join(part for part in said if part) + ("" if before else ", the last module")


def score(
    rep: ModuleReport,
    compute: torch.dtype,
    limit: float,
    origin: tuple[str, str] | None,
    own_code: tuple[str | None, str | None] | None = None,
) -> None:
    """Risk: where an overflow starts first, then values beyond the range, then gradient
    underflow, then large errors. Non-finite values inherited from upstream are symptoms,
    not causes, and are not flagged. ``own_code``: where the model's own forward code made
    the first inf/NaN (``own_code_origin``), which the model's row then carries."""
    if own_code is not None and rep.name == ROOT_NAME:
        rep.risk += ORIGIN_RISK
        rep.reasons.append(f"inf/NaN starts in its own forward code, {between(own_code)}")
    elif own_code is None and origin is not None and origin[0] == rep.name:
        rep.risk += ORIGIN_RISK
        what = "output" if origin[1] == "forward" else "gradient of its output"
        rep.reasons.append(f"{what} becomes inf/NaN here first ({rep.dtype})")
    if rep.float32:
        return
    peak = max(rep.max_input, rep.max_output)
    if peak > limit:
        rep.risk += 100 + min(peak / limit, BEYOND_CAP)
        rep.reasons.append(f"values up to {peak:.3g} exceed {dtype_name(compute)} max {limit:.4g}")
    if rep.grad_underflow > UNDERFLOW_LIMIT:
        rep.risk += 2 + rep.grad_underflow
        rep.reasons.append(f"{100 * rep.grad_underflow:.0f}% of gradients flush to zero")
    for what, error, limits in (
        ("output", rep.output_rel_error, OUTPUT_ERROR_LIMIT),
        ("gradient", rep.grad_rel_error, GRAD_ERROR_LIMIT),
    ):
        # An infinite error is not scored: it comes from inf/NaN, which the origin flags
        # where it starts, or from a float32 reference that is exactly zero, where the
        # ratio says the runs differ but not by how much.
        if not rep.reasons and math.isfinite(error) and error > limits[compute]:
            rep.risk += 1 + min(error, 10.0)
            rep.reasons.append(f"{what} error vs float32 {error:.2g} > {limits[compute]}")


def loss_scale_range(
    reports: list[ModuleReport], compute: torch.dtype
) -> tuple[float | None, tuple[float, float] | None]:
    """The range of loss scales that lifts small gradients above the smallest normal
    number without pushing the largest past the maximum, and a power of two inside it."""
    if compute != torch.float16:
        return None, None
    info = torch.finfo(compute)
    # Large: every gradient the 16-bit backward holds (of outputs, inputs, parameters).
    small = [r.min_grad for r in reports if r.min_grad > 0 and not r.float32]
    large = [r.max_backward for r in reports if r.max_backward > 0 and not r.float32]
    if not small or not large:
        return None, None
    low = info.tiny / min(small)
    high = info.max / max(large)
    # Aim for the middle in log space, then round down to a power of two.
    middle = math.sqrt(max(low, 1e-30) * high) if low < high else high
    scale = 2.0 ** math.floor(math.log2(max(middle, 2.0**-24)))
    return scale, (low, high)
