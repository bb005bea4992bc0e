"""How the 16-bit doctor weighs a module: the limits it flags errors and underflow at, where
inf/NaN first appears, each module's risk and reasons, and the range of loss scales that
keeps the 16-bit gradients between the smallest normal number and the largest value."""

from __future__ import annotations

import math

import torch

from mixprec._dtypes import dtype_name
from mixprec.doctor.report import ModuleReport
from mixprec.scaling import DynamicConfig

__all__ = [
    "GRAD_ERROR_LIMIT",
    "OUTPUT_ERROR_LIMIT",
    "SCALE_FLOOR",
    "UNDERFLOW_LIMIT",
    "loss_scale_range",
    "nonfinite_origin",
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


def score(
    rep: ModuleReport, compute: torch.dtype, limit: float, origin: tuple[str, str] | None
) -> None:
    """Risk: where an overflow starts first, then values beyond the range, then gradient
    underflow, then large errors. Non-finite values inherited from upstream are symptoms,
    not causes, and are not flagged."""
    if origin is not None and origin[0] == rep.name:
        rep.risk += 1000
        what = "output" if origin[1] == "forward" else "gradient of its output"
        rep.reasons.append(f"{what} becomes inf/NaN here first ({rep.dtype})")
    if rep.float32:
        return
    peak = max(rep.max_input, rep.max_output)
    if peak > limit:
        rep.risk += 100 + peak / limit
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
