"""How close each module's tensors come to the 16-bit dtype's limits, and the keep list that
leaves room between them and the values training will reach.

A plan that fits at step 0 with nothing to spare fails a step later: one optimizer step moves
the weights and with them every activation. A kept-float32 ReLU that hands the float16
``Linear`` after it inputs of 6.45e4 (98% of float16's 65504) fits the batch the doctor saw,
and after one Adam step they pass 65504 and every later step overflows. So a tensor counts
as at risk before it leaves the range: once it comes within ``HEADROOM`` of a limit.

The fractions, per module, as a fraction of the range (above 1: beyond it):

* ``input_fraction``, ``output_fraction``: max |value| / the dtype's max;
* ``grad_fraction``: max |gradient| at the lowest loss scale training reaches (the dynamic
  scaler's floor, 1) / the dtype's max: above the headroom there, backing off cannot make
  room;
* ``small_grad_fraction``: the smallest subnormal (below it values flush to zero) of the dtype
  the module takes its output gradient in / the small |gradient| (1st percentile) at the
  loss scale training runs at (above 1: they flush).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import TYPE_CHECKING

import torch

from mixprec._dtypes import dtype_name

if TYPE_CHECKING:
    from mixprec.doctor.report import ModuleReport

__all__ = [
    "BEYOND_CAP",
    "EDGE_RISK",
    "HEADROOM",
    "flag_small_gradients",
    "headroom_text",
    "measure",
    "percent",
    "recommend",
    "smallest_subnormal",
]

# The margin: a 16-bit tensor within a factor 16 of a limit counts as at risk (values above
# 2**-4 of the max, 4096 for float16; small gradients below 16 x the smallest subnormal,
# 2**-20 for float16). Adam moves each weight by about its learning rate per step, which on
# the x1e5 block lifted the largest activation by ~3% a step: a factor 16 leaves
# dozens of steps for the dynamic scaler and the weights to settle, where 2 left one.
HEADROOM = 2.0**-4
# Risk added for a tensor inside the headroom but within the range: above underflow (2-3)
# and large errors (1-11), below values beyond the range (100+) and the inf/NaN origin (1000+).
# The most that values or gradients beyond the range add to a module's risk (over 100):
# enough to order such modules by how far beyond they go, and below where inf/NaN starts.
BEYOND_CAP = 800.0
EDGE_RISK = 20.0


def headroom_text(headroom: float) -> str:
    """``2**-4`` for a power of two, else the number."""
    exponent = math.log2(headroom)
    return f"2**{exponent:g}" if exponent == round(exponent) else f"{headroom:g}"


def percent(fraction: float) -> str:
    """A fraction of the range as a percentage, in 7 characters at most: "98.5%",
    "0.0123%", "<0.01%", "275%", ">999%"."""
    if fraction > 9.99:
        return ">999%"
    if fraction >= 1:
        return f"{100 * fraction:.0f}%"
    if fraction == 0:
        return "0%"
    return f"{100 * fraction:.3g}%" if fraction >= 1e-4 else "<0.01%"


def smallest_subnormal(dtype: torch.dtype) -> float:
    """The dtype's smallest positive value: 2**-24 for float16, 2**-133 for bfloat16."""
    info = torch.finfo(dtype)
    return float(info.tiny * info.eps)


def measure(reports: list[ModuleReport], limit: float, floor: float) -> None:
    """Set each module's ``input_fraction``, ``output_fraction`` and ``grad_fraction`` (see
    the module docstring) against ``limit``, the 16-bit dtype's max, with gradients at
    ``floor``, the lowest loss scale training reaches."""
    for r in reports:
        r.input_fraction = r.max_input / limit
        r.output_fraction = r.max_output / limit
        r.grad_fraction = floor * r.max_backward / limit


def recommend(
    reports: list[ModuleReport],
    leaves: set[str],
    compute: torch.dtype,
    limit: float,
    floor: float,
    headroom: float,
) -> list[str]:
    """The leaves to keep in float32, in forward order, then backward finds.

    Forward: leaves whose inputs or outputs come within ``headroom`` of the 16-bit range or
    leave it (the overflowing layer and its consumer), and those whose output turns inf/NaN
    from finite inputs. Backward: the gradient a float32 block sends back to the 16-bit
    layers before it is as large as the block's forward gain. A dynamic scaler backs off
    until the 16-bit backward fits, but not below its floor: a leaf whose gradients come
    within ``headroom`` of the range even there (float32 figures; power-of-two scaling is
    exact, so floor x gradient is what the 16-bit backward would hold) is kept too.

    Adds the reasons (and risk) of the leaves kept for being inside the headroom; those
    beyond the range carry ``risk.score``'s reason already."""
    edge = headroom * limit
    name = dtype_name(compute)
    margin = headroom_text(headroom)
    keep = []
    for r in sorted(reports, key=lambda r: r.order):
        if r.name not in leaves or r.float32:
            continue
        peak = max(r.max_input, r.max_output)
        if peak > edge or r.overflow_origin:
            keep.append(r.name)
        if edge < peak <= limit:
            r.risk += EDGE_RISK + peak / limit
            r.reasons.append(
                f"values up to {peak:.3g} are {percent(peak / limit)} of {name} max "
                f"{limit:.4g}, within the headroom ({margin}): a few optimizer steps can "
                "push them over"
            )
    for r in reports:
        if r.name not in leaves or r.float32 or floor * r.max_backward <= edge:
            continue
        if floor * r.max_backward > limit:
            r.risk += 100 + min(floor * r.max_backward / limit, BEYOND_CAP)
            r.reasons.append(
                f"gradients up to {r.max_backward:.3g} exceed {name} max "
                f"{limit:.4g} even at loss scale {floor:g}"
            )
        else:
            r.risk += EDGE_RISK + r.grad_fraction
            r.reasons.append(
                f"gradients up to {r.max_backward:.3g} are {percent(r.grad_fraction)} of "
                f"{name} max even at loss scale {floor:g}, within the headroom ({margin})"
            )
        if r.name not in keep:
            keep.append(r.name)
    return keep


def flag_small_gradients(
    reports: list[ModuleReport],
    half: set[str],
    compute: torch.dtype,
    scale: float,
    headroom: float,
    flushed: Mapping[str, float] | None = None,
) -> list[str]:
    """Set each module's ``small_grad_fraction`` at loss scale ``scale`` (where training
    runs), against the flush point of the dtype it takes its output gradient in
    (``grad_dtype``), and name the leaves left in 16 bits (``half``) whose small gradients
    sit within ``headroom`` of the flush to zero: they are at the edge, and the report says
    so (a larger loss scale, not float32, is the remedy).

    Past the edge, not named: modules already flagged for gradients that flush, and those
    whose small gradients x ``scale`` fall below the smallest subnormal, which are flagged
    as flushing, with the share of their gradients that does (``flushed``: name -> that
    fraction at ``scale``, where known)."""
    at_edge = []
    for r in sorted(reports, key=lambda r: r.order):
        grad_dtype = getattr(torch, r.grad_dtype) if r.grad_dtype else compute
        name, flush = dtype_name(grad_dtype), smallest_subnormal(grad_dtype)
        small = r.min_grad * scale
        r.small_grad_fraction = flush / small if small > 0 else 0.0
        if r.name not in half or r.float32 or compute == torch.float32:
            continue
        # ``risk.score``'s reason for gradients that flush (over its underflow limit).
        if any(reason.endswith("of gradients flush to zero") for reason in r.reasons):
            continue
        product = f"small gradients ({r.min_grad:.3g}) x loss scale {scale:g}"
        share = (flushed or {}).get(r.name)
        # Below the smallest subnormal they are gone, not at the edge (unless all of them
        # round up to it: values above half of it do).
        if r.small_grad_fraction > 1 and share != 0:
            r.risk += 2 + (share or 0.0)
            r.reasons.append(
                f"{product} = {small:.3g}, {flush / small:.3g}x below {name}'s smallest "
                f"subnormal ({flush:.3g}): "
                + ("they flush to zero" if share is None else
                   f"{percent(share)} of its gradients flush to zero at that scale")
            )  # fmt: skip
        elif r.small_grad_fraction > headroom:
            at_edge.append(r.name)
            r.risk += 1 + min(r.small_grad_fraction, 1.0)
            r.reasons.append(
                f"at the edge: {product} sit within the headroom ({headroom_text(headroom)}) "
                f"of {name}'s flush to zero ({flush:.3g})"
            )
    return at_edge
