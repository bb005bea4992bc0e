"""Dtype conversion of loaded tensors: which conversions mean something, NaN/inf counts, what
``on_range`` does with values beyond a narrower destination's range (16 bits, float64 into
float32, integers), and how many non-zero values a narrower dtype flushes to 0."""

from __future__ import annotations

from typing import get_args

import torch

from mixprec._dtypes import dtype_name
from mixprec._errors import ArgumentError
from mixprec.checkpoint.format import CheckpointError, LoadReport, OnRange

_ON_RANGE: tuple[str, ...] = get_args(OnRange)  # error, clamp, ignore
_FLOATS = frozenset({torch.float16, torch.bfloat16, torch.float32, torch.float64})
_INTS = frozenset({torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64})
_FLOAT8_NAMES = ("float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz")
_FLOAT8 = frozenset(
    getattr(torch, n) for n in (*_FLOAT8_NAMES, "float8_e8m0fnu") if hasattr(torch, n)
)


def _check_on_range(on_range: object) -> None:
    """Raises ``ArgumentError`` unless ``on_range`` is one of 'error', 'clamp', 'ignore'."""
    if on_range not in _ON_RANGE:
        raise ArgumentError(
            f"on_range={on_range!r} is invalid; valid: {', '.join(map(repr, _ON_RANGE))}"
        )


def _refusal(saved: torch.dtype, target: torch.dtype) -> str | None:
    """Why a ``saved`` tensor does not convert meaningfully to ``target``, or None."""
    if saved == target:
        return None
    if target in _FLOATS:
        if saved in _FLOATS:
            return None
    elif target in _INTS:
        if saved in _INTS:
            return None  # range-checked in _convert
    elif target.is_complex and (saved.is_complex or saved in _FLOATS):
        return None
    if saved in _FLOAT8:
        return "float8 values mean something only with the scales stored beside them"
    if target in _FLOAT8:
        return "a float8 destination needs scales; mixprec does not quantize"
    if saved.is_complex:
        return "the imaginary parts would be dropped"
    if saved == torch.bool:
        return "booleans are flags, not values"
    if target.is_floating_point:
        return "integers in a floating-point parameter are quantized or foreign data"
    if saved.is_floating_point:
        return "the fractions would be cut off"
    return "the values would be reinterpreted"


def _count_non_finite(name: str, value: torch.Tensor, report: LoadReport) -> bool:
    """Whether every value is finite; if not, the counts go into ``report.non_finite``."""
    if not (value.is_floating_point() or value.is_complex()) or not value.numel():
        return True
    wide = value.float() if value.dtype in _FLOAT8 else value  # no isfinite for float8
    finite = torch.isfinite(wide)
    if bool(finite.all()):
        return True
    bad, nan = int((~finite).sum()), int(torch.isnan(wide).sum())
    report.non_finite.append((name, nan, bad - nan))
    return False


def _raise_non_finite(report: LoadReport, on_range: OnRange, buffers_listed: bool = True) -> None:
    """NaN and inf are refused under 'error' and under 'clamp' (no finite value can stand
    in for a NaN, and an inf master means training diverged: saturating would hide it);
    'ignore' loads them as they are, listed in ``report.non_finite``. ``buffers_listed``:
    whether the buffers (exempt) were told from the weights."""
    if not report.non_finite or on_range == "ignore":
        return
    listed = [f"{name!r} ({nan} NaN, {inf} inf)" for name, nan, inf in report.non_finite]
    more = f" and {len(listed) - 8} more" if len(listed) > 8 else ""
    unlisted = (
        ""
        if buffers_listed
        else " (this file, unlike mixprec's checkpoints, does not say which of its tensors "
        "are buffers: a mask of -inf is refused like a weight's inf)"
    )
    raise CheckpointError(
        f"{report.path}: non-finite values in {len(listed)} tensor(s): "
        f"{', '.join(listed[:8])}{more}; a model or optimizer loaded with them skips every "
        f"step. on_range='ignore' loads them as they are{unlisted}"
    )


def _convert(
    name: str,
    value: torch.Tensor,
    target: torch.dtype,
    on_range: OnRange,
    report: LoadReport,
    check_finite: bool = True,
) -> torch.Tensor:
    """``value`` as ``target``: refused where the dtype does not convert meaningfully;
    non-finite values counted (see ``_raise_non_finite``) unless ``check_finite`` is off
    (buffers: a causal mask of -inf is normal); out-of-range values per ``on_range``."""
    reason = _refusal(value.dtype, target)
    if reason is not None:
        raise CheckpointError(
            f"{report.path}: tensor {name!r} is {dtype_name(value.dtype)} in the checkpoint; it "
            f"does not convert to {dtype_name(target)} ({reason})"
        )
    finite = _count_non_finite(name, value, report) if check_finite else None
    if value.dtype == target:
        return value
    report.converted.append((name, dtype_name(value.dtype), dtype_name(target)))
    if target in _INTS and value.numel():
        low, high, info = int(value.min()), int(value.max()), torch.iinfo(target)
        if low < info.min or high > info.max:
            raise CheckpointError(
                f"{report.path}: tensor {name!r} holds {low}..{high}, beyond "
                f"{dtype_name(target)}'s {info.min}..{info.max}"
            )
    if _narrows(value.dtype, target) and value.numel():
        limit = float(torch.finfo(target).max)
        if finite:  # known finite: one read, no copy of the finite values
            least, most = torch.aminmax(value)
            peak = max(-float(least), float(most))
        else:
            kept = value[torch.isfinite(value)]
            peak = float(kept.abs().max()) if kept.numel() else 0.0
        if peak > limit:
            report.out_of_range.append((name, peak, dtype_name(target), on_range))
            if on_range == "error":
                raise CheckpointError(
                    f"{report.path}: tensor {name!r} has max |value| {peak:.6g}, beyond "
                    f"{dtype_name(target)}'s {limit:.6g}; pass on_range='clamp' to "
                    "saturate or on_range='ignore' to cast as is (values become inf)"
                )
            if on_range == "clamp":
                value = saturate(value, target)
    converted = value.to(target)
    if _narrows(value.dtype, target) and converted.numel():
        # Below the target's smallest subnormal (float16: 6e-8) a value becomes 0.
        lost = int(torch.count_nonzero((converted == 0) & (value != 0)))
        if lost:
            report.underflow.append((name, lost, dtype_name(target)))
    return converted


def saturate(value: torch.Tensor, target: torch.dtype) -> torch.Tensor:
    """``value``'s finite values clamped to ``target``'s range, in float32 or wider (65504 is
    no bfloat16 value: it rounds to 65536, float16's inf). inf and NaN stay: a buffer's -inf
    mask is meant, and a parameter's are refused before this."""
    limit = float(torch.finfo(target).max)
    wide = value if value.dtype in (torch.float32, torch.float64) else value.float()
    return torch.where(torch.isfinite(wide), wide.clamp(-limit, limit), wide)


def _narrows(source: torch.dtype, target: torch.dtype) -> bool:
    """A floating conversion to a smaller range (float64 to float32 as well as 16 bits),
    where finite values can become inf."""
    return (
        source.is_floating_point
        and target.is_floating_point
        and torch.finfo(target).max < torch.finfo(source).max
    )
