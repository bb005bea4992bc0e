"""A checkpoint resumed at another policy or level than it was trained at: the switch is
said (``auto`` picks float32 on a machine without fast bfloat16, and the run went on in it
unsaid), and an O3 run's Kahan compensation joins its weights in the masters of a resume
at O2."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from mixprec._errors import ArgumentError
from mixprec._warn import warn_at_caller
from mixprec.levels import applied
from mixprec.optim import LossScaleOptimizer
from mixprec.policy import Policy

__all__ = ["compensations", "say_if_trained_otherwise"]


def _precision(policy: str | None, level: str | None) -> tuple[str, str]:
    """A policy's name and its level, as a header or ``applied`` holds them; every way of
    training in float32 (``None``: a model never prepared; level O0; the float32 policy at
    any level, where a level changes nothing) as one."""
    if policy is None or level in (None, "O0"):
        return "float32", "O0"
    try:
        parsed = Policy(policy)
    except (ArgumentError, ValueError):  # a name this version does not know
        return policy, level
    if parsed.compute_dtype == torch.float32:
        return "float32", "O0"
    return parsed.name, level


def say_if_trained_otherwise(path: str, header: dict[str, Any], model: nn.Module) -> None:
    """A resume into a model prepared with another policy or level than the checkpoint's
    (``auto`` picks float32 on a machine without fast bfloat16; another ``policy=`` by
    hand) went on in the new precision unsaid: 4.9e-4 off the uninterrupted run after an
    epoch, and at O3 its float32 masters rounded to 16 bits."""
    if "policy" not in header:  # written before the header held it
        return
    done = applied(model)
    was = _precision(header.get("policy"), header.get("level"))
    now = _precision(str(done.policy), done.level) if done else ("float32", "O0")
    if was == now:
        return
    rounded = ", its float32 masters rounded to 16 bits" if now[1] == "O3" != was[1] else ""
    warn_at_caller(
        f"{path} was trained with {was[0]} at {was[1]}; this model is prepared with "
        f"{now[0]} at {now[1]}: training resumes so, from the checkpoint's values"
        f"{rounded} (LoadReport.converted lists the casts). To go on as it was trained, "
        f"prepare the model with policy={was[0]!r}, level={was[1]!r} (policy='auto' picks "
        "by machine)"
    )


def compensations(
    optimizer: LossScaleOptimizer, inner: list[Any], masters: set[int]
) -> dict[int, torch.Tensor]:
    """The Kahan compensation an O3 run's ``CompensatedAdamW`` saved for each weight that
    now has a master (ids in ``masters``), by the master's id, taken out of the state (a
    master needs none): the masters of a resume at O2 start from the weight plus it. They
    started from the weight alone, 23% of 30 steps' movement lost. (A parameter float32 at
    O2, a norm layer's, loads its weight alone.)"""
    found: dict[int, torch.Tensor] = {}
    for each, saved in zip(optimizer.optimizers, inner, strict=True):
        if not isinstance(saved, dict) or not isinstance(saved.get("state"), dict):
            continue
        params = [p for g in each.param_groups for p in g["params"]]
        indices = [i for g in saved.get("param_groups", []) for i in g.get("params", [])]
        by_index = {str(i): p for i, p in zip(indices, params, strict=False)}
        for index, entry in saved["state"].items():
            param = by_index.get(str(index))
            if param is None or id(param) not in masters or not isinstance(entry, dict):
                continue
            kept = entry.get("compensation")
            if isinstance(kept, torch.Tensor) and kept.shape == param.shape:
                found[id(param)] = entry.pop("compensation")
    return found
