"""Precision policies: an immutable value saying how weights are stored and math is done.

A policy has three dtypes (``param_dtype`` for storage, ``compute_dtype`` for the math,
``output_dtype`` for what the model returns) and implies its loss scaling: float16 compute
needs dynamic loss scaling because small gradients underflow its 5-bit exponent; bfloat16
shares float32's exponent range and needs none.

``mixed_float8`` is ``mixed_bfloat16`` plus float8 matmuls in eligible Linear layers through
torchao (see ``mixprec.float8``); the torchao recipe is part of the policy value, so
``mixed_float8`` and ``mixed_bfloat16`` are different policies, and every place that takes a
policy name (``Trainer``, the CLI, a checkpoint's header) carries the recipe with it.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Literal

import torch

from mixprec._dtypes import CANONICAL, closest, dtype_name, parse_dtype
from mixprec._errors import ArgumentError
from mixprec._hardware import probe_hardware

LossScaling = Literal["none", "dynamic"]

# name -> (params, compute, output)
PRESETS: dict[str, tuple[torch.dtype, torch.dtype, torch.dtype]] = {
    "float32": (torch.float32, torch.float32, torch.float32),
    "float16": (torch.float16, torch.float16, torch.float16),
    "bfloat16": (torch.bfloat16, torch.bfloat16, torch.bfloat16),
    # Mixed policies keep float32 storage (the master weights) and return float32 outputs so
    # that losses and metrics are computed at full precision.
    "mixed_float16": (torch.float32, torch.float16, torch.float32),
    "mixed_bfloat16": (torch.float32, torch.bfloat16, torch.float32),
}
#: torchao's float8 training recipes (``Float8LinearConfig.from_recipe_name``); the first is
#: the default. float8 names: float32 variables, bfloat16 compute, float8 matmuls.
FLOAT8_RECIPES: tuple[str, ...] = ("tensorwise", "rowwise", "rowwise_with_gw_hp")
FLOAT8_PRESETS: dict[str, str] = {
    "mixed_float8": "tensorwise",
    "mixed_float8_rowwise": "rowwise",
    "mixed_float8_rowwise_with_gw_hp": "rowwise_with_gw_hp",
}
NAMES: tuple[str, ...] = (*PRESETS, *FLOAT8_PRESETS, "auto")

_KEYS = {
    "params": "params",
    "param": "params",
    "p": "params",
    "compute": "compute",
    "c": "compute",
    "output": "output",
    "o": "output",
    "float8": "float8",
}


@dataclass(frozen=True, init=False)
class Policy:
    """How a model stores its weights, computes, and returns its outputs.

    ``Policy("mixed_bfloat16")``, ``Policy("auto")``,
    ``Policy("params=float32,compute=float16,output=float32")`` or
    ``Policy(param_dtype=..., compute_dtype=..., output_dtype=...)``. ``Policy()`` (or
    ``Policy(None)``) copies the global policy, as Keras 3's ``DTypePolicy(None)`` does.
    ``str(policy)`` gives the ``params=...,compute=...,output=...`` form, which parses back to
    an equal policy. Equality compares the three dtypes and the float8 recipe.

    ``Policy("mixed_float8")`` (torchao's ``tensorwise`` recipe), ``"mixed_float8_rowwise"``,
    ``"mixed_float8_rowwise_with_gw_hp"``, or ``...,float8=<recipe>`` in the string form:
    float8 matmuls in eligible Linear layers (``auto_mixed_precision`` picks them).
    """

    param_dtype: torch.dtype
    compute_dtype: torch.dtype
    output_dtype: torch.dtype
    #: Why this policy was chosen; set for ``"auto"``, ``None`` otherwise.
    reason: str | None = field(default=None, compare=False)
    #: torchao float8 training recipe (one of ``FLOAT8_RECIPES``), or ``None``: no float8.
    float8_recipe: str | None = None

    def __init__(
        self,
        name: str | None = None,
        *,
        param_dtype: str | torch.dtype | None = None,
        compute_dtype: str | torch.dtype | None = None,
        output_dtype: str | torch.dtype | None = None,
    ) -> None:
        reason = None
        recipe: str | None = None
        if name is None and param_dtype is None and compute_dtype is None and output_dtype is None:
            # Keras 3's DTypePolicy(None): the global policy at construction time.
            now = global_policy()
            params, compute, output = now.param_dtype, now.compute_dtype, now.output_dtype
            reason, recipe = now.reason, now.float8_recipe
        elif name is not None:
            if any(d is not None for d in (param_dtype, compute_dtype, output_dtype)):
                raise ArgumentError(
                    f"Policy({name!r}, ...) takes either a name or dtype keywords, not both"
                )
            if isinstance(name, Policy):  # Policy(policy): the same policy
                params, compute, output = name._dtypes()
                reason, recipe = name.reason, name.float8_recipe
            else:
                params, compute, output, reason, recipe = _parse(name)
        else:
            # `is None`, not falsiness: 0, False, "" or [] must be refused, not read as float32.
            params = parse_dtype(
                torch.float32 if param_dtype is None else param_dtype, argument="param_dtype"
            )
            compute = parse_dtype(
                params if compute_dtype is None else compute_dtype, argument="compute_dtype"
            )
            output = parse_dtype(
                params if output_dtype is None else output_dtype, argument="output_dtype"
            )
        _check_combination(params, compute, output)
        object.__setattr__(self, "param_dtype", params)
        object.__setattr__(self, "compute_dtype", compute)
        object.__setattr__(self, "output_dtype", output)
        object.__setattr__(self, "reason", reason)
        object.__setattr__(self, "float8_recipe", recipe)

    @property
    def name(self) -> str:
        """The preset name when the dtypes match one, else the ``params=...`` string."""
        if self.float8_recipe is not None:
            for preset, recipe in FLOAT8_PRESETS.items():
                if recipe == self.float8_recipe and self._dtypes() == PRESETS["mixed_bfloat16"]:
                    return preset
            return str(self)
        for preset, dtypes in PRESETS.items():
            if dtypes == self._dtypes():
                return preset
        return str(self)

    def _dtypes(self) -> tuple[torch.dtype, torch.dtype, torch.dtype]:
        return self.param_dtype, self.compute_dtype, self.output_dtype

    @property
    def variable_dtype(self) -> torch.dtype:
        """Keras' name for ``param_dtype``."""
        return self.param_dtype

    @property
    def loss_scaling(self) -> LossScaling:
        """``"dynamic"`` for float16 compute (gradients underflow), ``"none"`` otherwise."""
        return "dynamic" if self.compute_dtype == torch.float16 else "none"

    @property
    def is_mixed(self) -> bool:
        """True when the math runs in a 16-bit dtype."""
        return self.compute_dtype != torch.float32

    def __str__(self) -> str:
        return (
            f"params={dtype_name(self.param_dtype)},compute={dtype_name(self.compute_dtype)},"
            f"output={dtype_name(self.output_dtype)}"
            + (f",float8={self.float8_recipe}" if self.float8_recipe else "")
        )

    def __repr__(self) -> str:
        extra = f", reason={self.reason!r}" if self.reason else ""
        return f"Policy({self.name!r}{extra})"


_Parsed = tuple[torch.dtype, torch.dtype, torch.dtype, str | None, str | None]


def is_policy_text(text: str) -> bool:
    """Whether ``text`` is a policy name or ``params=...`` string (the grammar alone: a
    checkpoint's header records the policy its model was prepared with, which an earlier
    mixprec may have taken in a combination ``Policy`` now refuses)."""
    try:
        _parse(text)
    except (ValueError, TypeError):
        return False
    return True


def _check_combination(params: torch.dtype, compute: torch.dtype, output: torch.dtype) -> None:
    """Refuse what ``auto_mixed_precision`` cannot honour, rather than ignore part of it:
    16-bit weights compute in their own dtype, and float32 math keeps float32 weights and
    outputs."""
    names = (dtype_name(params), dtype_name(compute), dtype_name(output))
    given = "params={}, compute={}, output={}".format(*names)
    if params != torch.float32 and compute != params:
        raise ArgumentError(
            f"policy {given}: 16-bit weights compute in their own dtype; valid: params=float32 "
            "(float32 masters) with any compute, or params equal to compute"
        )
    if compute == torch.float32 and output != torch.float32:
        raise ArgumentError(
            f"policy {given}: float32 math returns float32; valid: output=float32, or a "
            "16-bit compute dtype"
        )


def _parse(text: str) -> _Parsed:
    """``(params, compute, output, reason, float8_recipe)`` of a policy name or string."""
    if not isinstance(text, str):
        raise ArgumentError(f"policy must be a str or Policy, got {type(text).__name__}: {text!r}")
    key = text.strip().lower()
    if key in PRESETS:
        return (*PRESETS[key], None, None)
    if key in FLOAT8_PRESETS:
        return (*PRESETS["mixed_bfloat16"], None, FLOAT8_PRESETS[key])
    if key == "auto":
        return (*_auto(), None)
    if "=" in key:
        params, compute, output, recipe = _parse_grammar(text)
        return params, compute, output, None, recipe
    hint = closest(key, list(NAMES))
    raise ArgumentError(
        f"policy={text!r} is not a known policy; valid names: {', '.join(NAMES)}, or "
        "'params=<dtype>,compute=<dtype>,output=<dtype>'"
        + (f" (closest: {hint!r})" if hint else "")
    )


def _parse_grammar(text: str) -> tuple[torch.dtype, torch.dtype, torch.dtype, str | None]:
    """``params=float32,compute=bf16,output=float32`` (and ``,float8=<recipe>``).

    As with the keyword form, a missing ``params`` means float32 and a missing ``compute`` or
    ``output`` means the ``params`` dtype.
    """
    seen: dict[str, torch.dtype] = {}
    recipe: str | None = None
    for part in text.split(","):
        key, sep, value = part.partition("=")
        key = key.strip().lower()
        if not sep or key not in _KEYS:
            raise ArgumentError(
                f"policy={text!r}: bad entry {part.strip()!r}; expected key=dtype with key in "
                f"{', '.join(sorted(set(_KEYS.values()) - {'float8'}))} and dtype in "
                f"{', '.join(CANONICAL)}, or float8=<recipe> with recipe in "
                f"{', '.join(FLOAT8_RECIPES)}"
            )
        canonical = _KEYS[key]
        if canonical in seen or (canonical == "float8" and recipe is not None):
            raise ArgumentError(f"policy={text!r}: {canonical!r} is given twice")
        if canonical == "float8":
            recipe = parse_float8_recipe(value, argument="policy float8")
            continue
        seen[canonical] = parse_dtype(value, argument=f"policy {canonical}")
    params = seen.get("params", torch.float32)
    compute = seen.get("compute", params)
    if recipe is not None and compute != torch.bfloat16:
        # torchao's float8 Linear returns its input's dtype and runs everything around the
        # matmuls there; mixprec feeds it bfloat16, the dtype its recipes are tuned and tested
        # with (float16 would also need loss scaling on top of float8's own scales).
        raise ArgumentError(
            f"policy={text!r}: float8={recipe} needs compute=bfloat16, got "
            f"compute={dtype_name(compute)}; write e.g. "
            f"'params=float32,compute=bfloat16,output=float32,float8={recipe}'"
        )
    return params, compute, seen.get("output", params), recipe


def parse_float8_recipe(value: object, *, argument: str = "float8_recipe") -> str:
    """A torchao float8 recipe name (case-insensitive), or ``ValueError`` listing them."""
    if not isinstance(value, str):
        raise ArgumentError(f"{argument} must be a str, got {type(value).__name__}: {value!r}")
    key = value.strip().lower()
    if key in FLOAT8_RECIPES:
        return key
    hint = closest(key, list(FLOAT8_RECIPES))
    raise ArgumentError(
        f"{argument}={value!r} is not a float8 recipe; valid: {', '.join(FLOAT8_RECIPES)}"
        + (f" (closest: {hint!r})" if hint else "")
    )


def _auto() -> tuple[torch.dtype, torch.dtype, torch.dtype, str]:
    hw = probe_hardware()
    if hw.bf16_fast:
        return (*PRESETS["mixed_bfloat16"], f"{hw.detail}: fast bfloat16, no loss scaling needed")
    if hw.device == "cuda" and hw.fp16_fast:
        return (
            *PRESETS["mixed_float16"],
            f"{hw.detail}: no fast bfloat16; float16 with dynamic loss scaling",
        )
    return (*PRESETS["float32"], f"{hw.detail}: no fast 16-bit matrix units; float32 is fastest")


PolicyLike = Policy | str | None

#: The global policy before any is set: float32 to read, and, to ``auto_mixed_precision``,
#: "none chosen" (``policy=None`` then resolves to ``"auto"``).
UNSET = Policy("float32")
_GLOBAL: list[Policy] = [UNSET]


@dataclass
class _Scope:
    """One ``policy_scope``: its policy, the scope it is inside, and whether it is open;
    or a ``set_global_policy`` inside one (``base``), open while that scope is."""

    policy: Policy
    outer: _Scope | None
    open: bool = True
    base: _Scope | None = None

    def is_open(self) -> bool:
        return (self.base or self).open


#: The innermost ``policy_scope`` of this thread (or task), if any: a scope in one thread
#: does not change what another sees, and scopes that end in any order across threads
#: leave the process-wide policy as it was. A scope that ends in another context than the
#: one it began in (a generator closed from another thread) is marked closed, and skipped.
_SCOPED: contextvars.ContextVar[_Scope | None] = contextvars.ContextVar(
    "mixprec_policy_scope", default=None
)


def _open_scope() -> _Scope | None:
    scope = _SCOPED.get()
    while scope is not None and not scope.is_open():
        scope = scope.outer
    return scope


def get_policy(policy: PolicyLike = None) -> Policy:
    """A ``Policy`` from a policy, a name or string, or ``None`` (the global policy)."""
    if policy is None:
        return global_policy()
    if isinstance(policy, Policy):
        return policy
    return Policy(policy)


def global_policy() -> Policy:
    """The policy used where none is given: the innermost ``policy_scope``'s in this thread,
    else the process-wide one (``float32`` until set)."""
    scope = _open_scope()
    return _GLOBAL[0] if scope is None else scope.policy


def set_global_policy(policy: PolicyLike) -> None:
    """Set the process-wide default policy, as Keras' ``set_global_policy``; ``None`` sets
    float32, as Keras' reset does (a choice: ``policy=None`` then means float32, not
    ``"auto"``). Inside a ``policy_scope`` it sets that scope's policy, which ends with it,
    in this thread (or asyncio task) only."""
    chosen = Policy("float32") if policy is None else get_policy(policy)
    scope = _open_scope()
    if scope is not None:
        # A scope of its own in this context, not a write to the shared one: tasks and
        # threads (asyncio.to_thread) that copied the context hold the same object, and
        # a worker's set_global_policy("float32") prepared the caller's models in float32.
        _SCOPED.set(_Scope(chosen, scope.outer, base=scope.base or scope))
    else:
        _GLOBAL[0] = chosen


@contextlib.contextmanager
def policy_scope(policy: PolicyLike) -> Iterator[Policy]:
    """Use ``policy`` as the global policy inside a ``with`` block, in this thread (or
    asyncio task) only; ``None``: float32, as ``set_global_policy(None)``."""
    scope = _Scope(Policy("float32") if policy is None else get_policy(policy), _open_scope())
    token = _SCOPED.set(scope)
    try:
        yield scope.policy
    finally:
        scope.open = False
        with contextlib.suppress(ValueError):  # ended in another context: skipped as closed
            _SCOPED.reset(token)
