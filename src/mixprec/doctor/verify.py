"""The 16-bit doctor checks its own float16 plan over the next optimizer steps, not only at
step 0: on a copy of the model prepared with the recommended keep list, it trains a few steps
on the batch with the user's optimizer (else Adam, lr 1e-3) and a ``DynamicLossScaler``
started at the recommended scale, as the user will, then runs one more forward.

What a step that does not apply says about the plan:

* inf/NaN in the forward, or in a backward at the scaler's floor: a 16-bit leaf that the
  weights' first moves push over the range. It is kept in float32 and the round starts
  again from the float32 model;
* an overflow in the backward above the floor: the scaler backs off, as it will in
  training; the next round starts at the scale reached, to confirm that it holds.

Rounds go on until one applies every step with a finite forward after them, or there is
nothing left to revise (no 16-bit leaf to blame), or ``MAX_ROUNDS`` have run.
"""

from __future__ import annotations

import inspect
import math
import warnings
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from mixprec._calling import call
from mixprec._errors import ArgumentError
from mixprec.casting import first_floating
from mixprec.doctor.passes import nonfinite, nonfinite_start, prepared_keeping, run
from mixprec.doctor.report import PlanCheck
from mixprec.dtype_table import module_dtypes
from mixprec.optim import LossScaleOptimizer
from mixprec.policy import Policy
from mixprec.scaling import DynamicLossScaler

__all__ = [
    "CHECK_STEPS",
    "MAX_ROUNDS",
    "OptimizerLike",
    "build_optimizer",
    "check_optimizer",
    "check_plan",
]

#: What ``diagnose(optimizer=...)`` takes: an optimizer (one of the same class and
#: hyperparameters is built over the copy's parameters), or a function of the parameters
#: that builds one; ``None``: Adam, lr 1e-3.
OptimizerLike = torch.optim.Optimizer | Callable[[list[nn.Parameter]], torch.optim.Optimizer]

# Optimizer steps per round, each about one training step on the batch. Without the
# headroom, the plans failed at steps 2 to 8 of 30 (draws of its model); the check
# backs the headroom up where a plan still fails soon after step 0.
CHECK_STEPS = 10
# Rounds at most: each adds a leaf to the keep list or lowers the starting scale.
MAX_ROUNDS = 8


def check_optimizer(optimizer: OptimizerLike | None) -> None:
    """Refuse what ``build_optimizer`` cannot build from."""
    if optimizer is None:
        return
    if isinstance(optimizer, LossScaleOptimizer):
        raise ArgumentError(
            "diagnose(optimizer=...) takes the optimizer a LossScaleOptimizer wraps (or a "
            "function of the parameters that builds it), not the LossScaleOptimizer"
        )
    if not (isinstance(optimizer, torch.optim.Optimizer) or callable(optimizer)):
        raise ArgumentError(
            f"diagnose(optimizer=...) needs a torch.optim.Optimizer or a function of the "
            f"parameters that builds one, got {type(optimizer).__name__}"
        )


def build_optimizer(
    optimizer: OptimizerLike | None, params: list[nn.Parameter]
) -> torch.optim.Optimizer:
    """The optimizer the check steps over ``params``: see ``OptimizerLike``. An optimizer is
    rebuilt with its class and the hyperparameters of its first parameter group (what a
    scheduler set, e.g. its learning rate) that its constructor takes."""
    if optimizer is None:
        # Pure float16 weights (O3) make Adam compute in float16, where eps=1e-8 rounds to
        # 0 and a zero gradient gives NaN weights: the smallest eps float16 holds well.
        pure16 = any(p.dtype == torch.float16 for p in params)
        return torch.optim.Adam(params, lr=1e-3, eps=1e-4 if pure16 else 1e-8)
    if isinstance(optimizer, torch.optim.Optimizer):
        accepted = inspect.signature(type(optimizer)).parameters
        settings = {**optimizer.defaults, **optimizer.param_groups[0]}
        kwargs = {k: v for k, v in settings.items() if k in accepted and k != "params"}
        return type(optimizer)(params, **kwargs)
    built = optimizer(params)
    if not isinstance(built, torch.optim.Optimizer):
        raise ArgumentError(
            "diagnose(optimizer=...): the function must return a torch.optim.Optimizer, "
            f"got {type(built).__name__}"
        )
    return built


def _describe(optimizer: torch.optim.Optimizer) -> str:
    lr = optimizer.param_groups[0].get("lr") if optimizer.param_groups else None
    name = type(optimizer).__name__
    return f"{name}(lr={lr:g})" if isinstance(lr, float) else name


@dataclass
class _Round:
    """What one round of the check saw."""

    applied: int  # steps applied
    scale: float  # the loss scale at the end
    finite: bool  # the forward after the last step was finite
    culprit: tuple[str, str, int] | None = None  # 16-bit leaf, pass, step: keep it
    stuck: bool = False  # skipped at the floor with no 16-bit leaf to blame


def _round(
    prepared: nn.Module,
    batch: tuple[Any, Any, Callable[..., torch.Tensor]],
    optimizer: torch.optim.Optimizer,
    start: float,
    floor: float,
    steps: int,
    half: set[str],
    rewind: Callable[[], None],
) -> _Round:
    """One round: ``steps`` steps from loss scale ``start``, then a forward; it stops at the
    first culprit (a 16-bit leaf that overflows in the forward, or in the backward at
    ``floor``)."""
    inputs, targets, loss_fn = batch
    # No ceiling below the start: the doctor's own advice can name a scale past 2**24.
    scaler = DynamicLossScaler(init_scale=start, min_scale=floor, max_scale=max(start, 2.0**24))
    opt = LossScaleOptimizer(optimizer, loss_scaler=scaler)
    opt.health = None  # the check's skips are reported, not warned about
    applied = 0
    for step in range(1, steps + 1):
        scale = opt.loss_scaler.get_scale()
        rewind()  # each step draws the same random numbers, as every doctor pass does
        opt.zero_grad()
        opt.backward(loss_fn(call(prepared, inputs), targets))
        if opt.step().applied:
            applied += 1
            continue
        # A skipped step changed no weight: the same pass again, recorded, says where.
        calls, loss = run(prepared, inputs, targets, loss_fn, scale, rewind)
        origin = nonfinite_start(calls, half)
        if origin is not None and (origin[1] == "forward" or scale <= floor):
            return _Round(applied, scale, True, (origin[0], origin[1], step))
        if scale <= floor:  # the forward's loss says whether the forward is finite still
            return _Round(applied, scale, math.isfinite(loss), stuck=True)
    end = opt.loss_scaler.get_scale()
    rewind()
    with torch.no_grad():
        finite = not nonfinite(first_floating(call(prepared, inputs)))
    if finite:
        return _Round(applied, end, True)
    calls, _ = run(prepared, inputs, targets, loss_fn, end, rewind)
    origin = nonfinite_start(calls, half)
    return _Round(applied, end, False, None if origin is None else (*origin, steps + 1))


def check_plan(
    model: nn.Module,
    batch: tuple[Any, Any, Callable[..., torch.Tensor]],
    policy: Policy,
    level: str,
    keep: Iterable[str],
    start: float,
    floor: float,
    leaves: set[str],
    optimizer: OptimizerLike | None,
    steps: int,
    rewind: Callable[[], None],
) -> tuple[list[str], PlanCheck, set[str]]:
    """Check the plan (``keep`` in float32, the scaler started at ``start``) over ``steps``
    optimizer steps on ``batch`` (inputs, targets, loss function) and revise it (see the
    module docstring). Returns the revised keep list, the check, and the modules left in 16
    bits."""
    keep = list(keep)
    check = PlanCheck(optimizer="", steps=steps, applied=0, rounds=0, finite=True, scale=start)
    half: set[str] = set()
    with warnings.catch_warnings():
        # The user's training warns about its own steps; the check's would repeat them.
        warnings.simplefilter("ignore")
        for _ in range(MAX_ROUNDS):
            prepared = prepared_keeping(model, policy, level, keep)
            half = {r.name for r in module_dtypes(prepared) if r.compute != "float32"}
            trained = [p for p in prepared.parameters() if p.requires_grad]
            inner = build_optimizer(optimizer, trained)
            check.optimizer = _describe(inner)
            check.rounds += 1
            check.scale = start
            done = _round(prepared, batch, inner, start, floor, steps, half & leaves, rewind)
            check.applied, check.finite = done.applied, done.finite
            if done.culprit is not None:
                name, phase, step = done.culprit
                when = f"step {step}" if step <= steps else f"the forward after step {steps}"
                check.findings.append(f"{name!r} inf/NaN in the {phase} at {when}: kept")
                keep.append(name)
                check.added.append(name)
                continue
            if done.stuck:
                check.findings.append(
                    f"steps skipped at loss scale {floor:g} with no 16-bit layer to blame"
                )
            elif done.applied < steps and done.scale < start and done.finite:
                check.findings.append(f"the scaler backed off to {done.scale:g}: started there")
                start = done.scale
                continue
            break
    return keep, check, half
