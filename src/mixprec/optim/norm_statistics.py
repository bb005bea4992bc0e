"""Normalisation statistics that a skipped step's forward made inf or NaN.

A step is skipped for inf/NaN gradients, but the forward that led to them has already
updated BatchNorm's running statistics in place: one outlier batch that overflows float16
leaves ``running_var`` inf. Training goes on looking healthy (batch statistics are used),
while every evaluation output is NaN, and stays so (a NaN average never recovers). So on a
skipped step, the prepared model's running statistics are looked at; those not finite are
reset (``reset_running_stats()``: they build up again over the next batches) and named in
a warning. Skips are rare once the loss scale has settled, and the look costs one host
read for all the layers.
"""

from __future__ import annotations

import torch
from torch import nn

from mixprec._warn import warn_at_caller
from mixprec.trace import models_of

__all__ = ["reset_nonfinite_statistics"]


def _tracked(model: nn.Module) -> list[tuple[str, nn.Module]]:
    return [
        (name, m)
        for name, m in model.named_modules()
        if callable(getattr(m, "reset_running_stats", None))
        and isinstance(getattr(m, "running_mean", None), torch.Tensor)
        and isinstance(getattr(m, "running_var", None), torch.Tensor)
    ]


def _reset(params: list[torch.Tensor]) -> list[str]:
    """After a skipped step: reset the running statistics of the models behind ``params``
    (every one: an optimizer may step several) that are inf or NaN, warn naming them, and
    return their names."""
    seen: set[int] = set()
    tracked = []
    for model in models_of(params):
        for name, m in _tracked(model):
            if id(m) not in seen:  # a prepared model inside another: its layers once
                seen.add(id(m))
                tracked.append((name, m))
    if not tracked:
        return []
    finite = torch.stack(
        [
            torch.isfinite(m.running_mean).all() & torch.isfinite(m.running_var).all()  # type: ignore[operator, arg-type]
            for _, m in tracked
        ]
    ).tolist()
    bad = [(name, m) for (name, m), ok in zip(tracked, finite, strict=True) if not ok]
    for _, m in bad:
        m.reset_running_stats()  # type: ignore[operator]
    if bad:
        names = ", ".join(name or "(model)" for name, _ in bad[:5])
        more = f" and {len(bad) - 5} more" if len(bad) > 5 else ""
        warn_at_caller(
            f"the step was skipped for inf/NaN gradients, but its forward had already made the "
            f"running statistics of {len(bad)} normalisation layer(s) inf/NaN ({names}{more}), "
            "which would turn every evaluation output NaN: they were reset "
            "(reset_running_stats()) and build up again over the next batches. An input "
            "batch far out of range overflows the 16-bit forward: check the data, or keep "
            "the layer before them in float32"
        )
    return [name for name, _ in bad]


# Under torch.compile(opt.step) this runs eagerly (as the health watch does): only skipped
# steps reach it, and traced its module walk would be guards.
reset_nonfinite_statistics = torch._disable_dynamo(_reset)  # type: ignore[attr-defined]
