"""The 16-bit doctor's passes over one batch: a forward and a backward with every module's
input, output and gradients kept (``run``), the figures read from those tensors (largest
and smallest magnitudes, inf/NaN counts, what a cast to 16 bits loses, the error against
the float32 pass), and the passes that check a float16 recommendation the way training
would meet it (``back_off``: what ``DynamicLossScaler`` does on that batch)."""

from __future__ import annotations

import copy
import math
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn

from mixprec._calling import call
from mixprec._dtypes import finite_peak
from mixprec.doctor._common import Recorder, relative_error
from mixprec.doctor.report import ModuleReport
from mixprec.dtype_table import module_dtypes
from mixprec.keep import named_modules
from mixprec.levels import auto_mixed_precision
from mixprec.policy import Policy

__all__ = [
    "back_off",
    "error",
    "finite_run",
    "first_nonfinite_leaf",
    "lost",
    "max_abs",
    "min_nonzero",
    "nonfinite",
    "nonfinite_start",
    "run",
]

Calls = dict[str, dict[str, Any]]


# Both read 16-bit tensors through float32: the same values, and 16-bit reductions are
# emulated (slow) on CPUs.
def max_abs(t: torch.Tensor | None) -> float:
    """Max |value| over the finite values; 0 for an absent or empty tensor."""
    return 0.0 if t is None else finite_peak(t)


def nonfinite(t: torch.Tensor | None) -> int:
    """The number of inf/NaN values; 0 for an absent tensor."""
    return 0 if t is None else int((~torch.isfinite(t.detach().float())).sum())


def finite_run(calls: Calls, loss: float) -> bool:
    """A recorded run had a finite loss and no inf/NaN in any output or backward."""
    return math.isfinite(loss) and not any(
        c["nonfinite_backward"] or c["nonfinite_out"] for c in calls.values()
    )


def lost(t: torch.Tensor | None, dtype: torch.dtype) -> tuple[float, float]:
    """Fractions of non-zero float32 values that flush to zero / are subnormal in ``dtype``."""
    if t is None or dtype == torch.float32:
        return 0.0, 0.0
    values = t.float()
    nonzero = values[(values != 0) & torch.isfinite(values)]
    if nonzero.numel() == 0:
        return 0.0, 0.0
    cast = nonzero.to(dtype)
    tiny = torch.finfo(dtype).tiny  # smallest normal number
    zero = float((cast == 0).float().mean())
    sub = float(((cast != 0) & (cast.abs() < tiny)).float().mean())
    return zero, sub


def error(mixed: torch.Tensor | None, ref: torch.Tensor | None) -> float:
    """The mixed run's relative error against the float32 run's (``relative_error``); 0 when
    there is nothing to compare: a tensor one run lacks (no gradient reached it, or the
    module did not run) or one of another shape."""
    if mixed is None or ref is None or mixed.shape != ref.shape:
        return 0.0
    return relative_error(mixed, ref)


def min_nonzero(t: torch.Tensor | None) -> float:
    """A small non-zero |value|: the 1st percentile, so a handful of stray tiny values do
    not dictate the loss scale."""
    if t is None:
        return 0.0
    values = t.float().abs()
    values = values[(values > 0) & torch.isfinite(values)]
    if values.numel() == 0:
        return 0.0
    return float(torch.quantile(values[:1_000_000], 0.01))


def run(
    model: nn.Module,
    inputs: Any,
    targets: Any,
    loss_fn: Callable[..., torch.Tensor],
    scale: float,
    rewind: Callable[[], None],
) -> tuple[Calls, float]:
    """One forward and backward, the loss multiplied by ``scale``, after ``rewind()`` (every
    pass draws the same random numbers); the recorded gradients are divided by the scale
    again (in float32) so they compare with the float32 run.

    Per module besides the recorder's entries: ``param_grad_max`` (unscaled, finite values)
    and ``nonfinite_backward``, the inf/NaN count of its output, input and parameter
    gradients as computed (scaled), which is what the scaler's check sees."""
    modules = named_modules(model)
    with Recorder(modules) as recorder:
        rewind()
        model.zero_grad(set_to_none=True)
        loss = loss_fn(call(model, inputs), targets)
        if loss.requires_grad:
            (loss * scale).backward()
    for entry in recorder.calls.values():
        module = entry.pop("module")
        params = [p.grad for p in module.parameters(recurse=False) if p.grad is not None]
        entry["param_grad_max"] = max((max_abs(g) for g in params), default=0.0) / scale
        entry["nonfinite_backward"] = (  # every call's output gradients
            entry["nonfinite_grad_all"]
            + nonfinite(entry["input_grad"])
            + sum(nonfinite(g) for g in params)
        )
        entry["peak_grad"] /= scale
        if scale != 1.0:
            if entry["grad"] is not None:
                entry["scaled_grad"] = entry["grad"]
                entry["grad"] = entry["grad"].float() / scale
            if entry["input_grad"] is not None:
                entry["input_grad"] = entry["input_grad"].float() / scale
    return recorder.calls, float(loss.detach().float())


def prepared_keeping(
    model: nn.Module, policy: Policy, level: str, keep: Iterable[str]
) -> nn.Module:
    """A copy of ``model`` at ``policy`` and ``level`` with the modules named in ``keep``
    (doctor names) in float32; ``model`` is left as it is."""
    prepared = copy.deepcopy(model)
    named = named_modules(prepared)
    auto_mixed_precision(prepared, policy, level, keep_float32=[named[n] for n in keep])
    return prepared


def back_off(
    model: nn.Module,
    inputs: Any,
    targets: Any,
    loss_fn: Callable[..., torch.Tensor],
    policy: Policy,
    level: str,
    keep: list[str],
    reports: list[ModuleReport],
    start: float,
    floor: float,
    limit: float,
    leaves: set[str],
    rewind: Callable[[], None],
) -> tuple[list[str], float, int, set[str]]:
    """Check the recommendation the way training would meet it: on a copy prepared with
    ``keep`` in float32, do what ``DynamicLossScaler`` does on this batch (a skipped step
    changes no weight, so every retry sees the same batch and weights): halve the scale
    while the 16-bit backward overflows, down to ``floor``. If it still overflows there,
    keep the 16-bit leaf where the inf/NaN starts and start again.

    Each pass first runs at ``floor``: a further culprit is found with one run. Once the
    floor passes, the scale reached is searched from a prediction made with the float32
    gradients of the leaves left in 16 bits (exact for powers of two), confirmed by real
    backwards. Returns the keep list, the scale reached, the number of steps skipped
    reaching it, and the modules left in 16 bits."""
    keep = list(keep)
    peaks = {r.name: r.max_backward for r in reports}
    steps_to_floor = math.ceil(math.log2(start / floor)) if start > floor else 0
    half: set[str] = set()
    for _ in range(len(leaves) + 1):
        prepared = prepared_keeping(model, policy, level, keep)
        half = {r.name for r in module_dtypes(prepared) if r.compute != "float32"}
        calls, loss = run(prepared, inputs, targets, loss_fn, floor, rewind)
        if not finite_run(calls, loss):
            culprit = first_nonfinite_leaf(calls, half & leaves)
            if culprit is None:  # nothing left in 16 bits to keep: float32 itself overflows
                return keep, floor, steps_to_floor, half
            keep.append(culprit)
            continue
        peak = max((peaks.get(n, 0.0) for n in half & leaves), default=0.0)
        scale, steps = start, 0
        while scale > floor and scale * peak > limit:
            scale, steps = max(scale / 2, floor), steps + 1
        while scale > floor:
            calls, loss = run(prepared, inputs, targets, loss_fn, scale, rewind)
            if finite_run(calls, loss):
                break
            scale, steps = max(scale / 2, floor), steps + 1
        return keep, scale, steps, half
    return keep, floor, steps_to_floor, half


def nonfinite_start(calls: Calls, half: set[str]) -> tuple[str, str] | None:
    """The 16-bit leaf where inf/NaN starts and in which pass: ``"forward"`` (forward order
    first: a call of it made a non-finite output from finite input), else ``"backward"``
    (the leaf run last whose output, input or parameter gradients are non-finite)."""
    ordered = sorted((n for n in calls if n in half), key=lambda n: calls[n]["order"])
    for name in ordered:
        if calls[name]["origin"]:
            return name, "forward"
    for name in reversed(ordered):
        if calls[name]["nonfinite_backward"]:
            return name, "backward"
    return None


def first_nonfinite_leaf(calls: Calls, half: set[str]) -> str | None:
    """The 16-bit leaf where inf/NaN starts, in either pass (``nonfinite_start``)."""
    start = nonfinite_start(calls, half)
    return None if start is None else start[0]
