"""``auto_mixed_precision(model, plan=...)``: a per-module dtype plan (``mixprec.Plan``, from
``mixprec.autotune``) turned into the arguments the levels already take, so that a planned
model is prepared by the one path every other model goes through.

A plan names modules and gives each a dtype: ``float32``, ``bfloat16``, ``float16`` or
``float8``. A plan with float8 modules has a bfloat16 policy (``mixed_float8`` computes in
bfloat16, its float8 layers in bfloat16 regions); otherwise its 16-bit dtype with the most
modules is the policy's compute dtype. Its level is the plan's. Then:

* ``float32`` modules are ``keep_float32`` entries (float32 regions, float32 weights);
* modules in the other 16-bit dtype are ``to_float`` regions made before the level is
  applied, which the level leaves as they are (float32 weights cast on use; a float16
  region marks its weights for loss scaling, as ``to_float`` always does);
* ``float8`` modules are the Linear layers a ``mixed_float8`` policy converts, chosen by
  name (``Float8Options.module_filter_fn``) and not by torchao's size rule;
* modules the plan does not name follow the policy, as under any level.

A plan whose modules are all ``float32`` is the float32 policy at ``O0``.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch import nn

from mixprec._dtypes import closest
from mixprec._errors import ArgumentError
from mixprec._warn import warn_at_caller
from mixprec.float8 import Float8Options, linear_refusal
from mixprec.keep import keep_list
from mixprec.region import to_float

__all__ = ["PLAN_DTYPES", "PlanArguments", "PlanLike", "plan_arguments"]

#: The dtypes a plan gives a module, in the order a plan's table lists them.
PLAN_DTYPES: tuple[str, ...] = ("float32", "bfloat16", "float16", "float8")


class PlanLike(Protocol):
    """What ``auto_mixed_precision`` reads of a plan (``mixprec.Plan``)."""

    @property
    def level(self) -> str: ...

    @property
    def dtypes(self) -> Mapping[str, str]: ...


@dataclass(frozen=True)
class PlanArguments:
    """The ``auto_mixed_precision`` arguments a plan stands for, and its ``to_float``
    regions (``preset``), made once the model is known to be unprepared."""

    policy: str
    level: str
    keep_float32: tuple[nn.Module, ...]
    to_float: tuple[tuple[nn.Module, torch.dtype], ...]
    float8: Float8Options | None

    def preset(self) -> None:
        """Make the ``to_float`` regions of the modules in the plan's other 16-bit dtype."""
        for module, dtype in self.to_float:
            to_float(module, dtype)


def _refuse_others(given: Mapping[str, Any]) -> None:
    """``plan=`` sets policy, level, float32 modules and float8 layers: refuse them beside it."""
    defaults = {"policy": None, "level": "auto", "amp_level": None, "float8": None}
    for name, value in given.items():
        empty = not keep_list(value) if name in ("keep_float32", "keep_bfloat16") else None
        if (empty is False) or (empty is None and value != defaults[name]):
            raise ArgumentError(
                f"auto_mixed_precision(plan=...) sets the policy, level and per-module dtypes "
                f"itself; got {name}={value!r} beside it (change the plan instead)"
            )


def _float8_ready(name: str, module: nn.Module) -> None:
    """A float8 plan entry must be a Linear that torchao's float8 Linear can replace."""
    reason = linear_refusal(module)
    if reason is not None:
        raise ArgumentError(f"plan gives {name!r} float8, but {reason}, which float8 needs")


def _check_fits(plan: PlanLike, named: dict[str, nn.Module]) -> None:
    """A plan tuned on another model may name modules this one also has: refuse an entry
    whose module is of another kind than the one tuned (a layer inserted before it shifts
    a Sequential's names), and an entry inside another (the outer one's region wins)."""
    for layer in getattr(plan, "layers", ()):
        kind, found = getattr(layer, "kind", ""), named.get(getattr(layer, "name", ""))
        if kind and found is not None and type(found).__name__ != kind:
            raise ArgumentError(
                f"plan gives {layer.name!r} (a {kind} when tuned) dtype {layer.dtype!r}, but the "
                f"model's {layer.name!r} is a {type(found).__name__}; a plan applies to the "
                "model it was tuned for"
            )
    dtypes = plan.dtypes
    for inner in dtypes:
        outer = inner
        while "." in outer:  # each module around it, innermost first
            outer = outer.rpartition(".")[0]
            if outer in dtypes and dtypes[outer] != dtypes[inner]:
                raise ArgumentError(
                    f"plan gives {outer!r} {dtypes[outer]} and {inner!r}, inside it, "
                    f"{dtypes[inner]}; one would be ignored: give modules that do not nest"
                )


def plan_arguments(model: nn.Module, plan: PlanLike, **given: Any) -> PlanArguments:
    """The arguments ``auto_mixed_precision`` applies ``plan`` with (see the module
    docstring); ``given``: the other arguments the call received, which must be defaults."""
    dtypes = getattr(plan, "dtypes", None)
    if not isinstance(dtypes, Mapping) or not isinstance(getattr(plan, "level", None), str):
        raise ArgumentError(
            f"plan must be a mixprec.Plan (from mp.autotune or mp.Plan.load), got "
            f"{type(plan).__name__}"
        )
    _refuse_others(given)
    named = dict(model.named_modules())
    for name, dtype in dtypes.items():
        if name not in named or not name:
            hint = closest(name, [n for n in named if n])
            raise ArgumentError(
                f"plan names module {name!r}, which the model does not have"
                + (f" (closest: {hint!r})" if hint else "")
                + "; a plan applies to the model it was tuned for"
            )
        if dtype not in PLAN_DTYPES:
            raise ArgumentError(
                f"plan gives {name!r} dtype {dtype!r}; valid: {', '.join(PLAN_DTYPES)}"
            )
        if dtype == "float8":
            _float8_ready(name, named[name])
    _check_fits(plan, named)
    counts = Counter("bfloat16" if d == "float8" else d for d in dtypes.values())
    if counts["bfloat16"] + counts["float16"] == 0:
        return PlanArguments("float32", "O0", (), (), None)
    if plan.level == "O0":
        raise ArgumentError(
            f"plan level O0 computes everything in float32, but the plan gives "
            f"{counts['bfloat16'] + counts['float16']} module(s) 16-bit or float8 dtypes, "
            "which O0 would ignore; give the plan level O1, O2 or O3"
        )
    check = getattr(plan, "check", None)
    if check is not None and getattr(check, "passed", True) is False:
        warn_at_caller(
            f"auto_mixed_precision(plan=...): this plan failed its training check "
            f"({check.gap()}): it may not train like float32; tune again with a larger "
            "time_budget_s"
        )
    float8 = {n for n, d in dtypes.items() if d == "float8"}
    base = "bfloat16" if float8 or counts["bfloat16"] >= counts["float16"] else "float16"
    other = "float16" if base == "bfloat16" else "bfloat16"
    options = None
    if float8:
        # By name, not by torchao's size rule: the plan measured these layers.
        options = Float8Options(keep_head=False, module_filter_fn=lambda m, fqn: fqn in float8)

    def modules(dtype: str) -> Iterable[nn.Module]:
        return (named[n] for n, d in dtypes.items() if d == dtype)

    return PlanArguments(
        policy="mixed_float8" if float8 else f"mixed_{base}",
        level=plan.level,
        keep_float32=tuple(modules("float32")),
        to_float=tuple((m, getattr(torch, other)) for m in modules(other)),
        float8=options,
    )
