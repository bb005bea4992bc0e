"""Precision policies: an immutable value saying how weights are stored and math is done.

A policy has three dtypes (``param_dtype`` for storage, ``compute_dtype`` for the math,
``output_dtype`` for what the model returns) and implies its loss scaling: float16 compute
needs dynamic loss scaling because small gradients underflow its 5-bit exponent; bfloat16
shares float32's exponent range and needs none.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Literal

import torch

from mixprec._dtypes import CANONICAL, closest, dtype_name, parse_dtype, probe_hardware

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
NAMES: tuple[str, ...] = (*PRESETS, "auto")

_KEYS = {
    "params": "params",
    "param": "params",
    "p": "params",
    "compute": "compute",
    "c": "compute",
    "output": "output",
    "o": "output",
}


@dataclass(frozen=True, init=False)
class Policy:
    """How a model stores its weights, computes, and returns its outputs.

    ``Policy("mixed_bfloat16")``, ``Policy("auto")``,
    ``Policy("params=float32,compute=float16,output=float32")`` or
    ``Policy(param_dtype=..., compute_dtype=..., output_dtype=...)``. ``Policy()`` (or
    ``Policy(None)``) copies the global policy, as Keras 3's ``DTypePolicy(None)`` does.
    ``str(policy)`` gives the ``params=...,compute=...,output=...`` form, which parses back to
    an equal policy. Equality compares the three dtypes only.
    """

    param_dtype: torch.dtype
    compute_dtype: torch.dtype
    output_dtype: torch.dtype
    #: Why this policy was chosen; set for ``"auto"``, ``None`` otherwise.
    reason: str | None = field(default=None, compare=False)

    def __init__(
        self,
        name: str | None = None,
        *,
        param_dtype: str | torch.dtype | None = None,
        compute_dtype: str | torch.dtype | None = None,
        output_dtype: str | torch.dtype | None = None,
    ) -> None:
        reason = None
        if name is None and param_dtype is None and compute_dtype is None and output_dtype is None:
            # Keras 3's DTypePolicy(None): the global policy at construction time.
            now = _GLOBAL[0]
            params, compute, output = now.param_dtype, now.compute_dtype, now.output_dtype
            reason = now.reason
        elif name is not None:
            if any(d is not None for d in (param_dtype, compute_dtype, output_dtype)):
                raise ValueError(
                    f"Policy({name!r}, ...) takes either a name or dtype keywords, not both"
                )
            params, compute, output, reason = _parse(name)
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
        object.__setattr__(self, "param_dtype", params)
        object.__setattr__(self, "compute_dtype", compute)
        object.__setattr__(self, "output_dtype", output)
        object.__setattr__(self, "reason", reason)

    @property
    def name(self) -> str:
        """The preset name when the dtypes match one, else the ``params=...`` string."""
        for preset, dtypes in PRESETS.items():
            if dtypes == (self.param_dtype, self.compute_dtype, self.output_dtype):
                return preset
        return str(self)

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
        )

    def __repr__(self) -> str:
        extra = f", reason={self.reason!r}" if self.reason else ""
        return f"Policy({self.name!r}{extra})"


def _parse(text: str) -> tuple[torch.dtype, torch.dtype, torch.dtype, str | None]:
    if not isinstance(text, str):
        raise TypeError(f"policy must be a str or Policy, got {type(text).__name__}: {text!r}")
    key = text.strip().lower()
    if key in PRESETS:
        return (*PRESETS[key], None)
    if key == "auto":
        return _auto()
    if "=" in key:
        return (*_parse_grammar(text), None)
    hint = closest(key, list(NAMES))
    raise ValueError(
        f"policy={text!r} is not a known policy; valid names: {', '.join(NAMES)}, or "
        "'params=<dtype>,compute=<dtype>,output=<dtype>'"
        + (f" (closest: {hint!r})" if hint else "")
    )


def _parse_grammar(text: str) -> tuple[torch.dtype, torch.dtype, torch.dtype]:
    """``params=float32,compute=bf16,output=float32``.

    As with the keyword form, a missing ``params`` means float32 and a missing ``compute`` or
    ``output`` means the ``params`` dtype.
    """
    seen: dict[str, torch.dtype] = {}
    for part in text.split(","):
        key, sep, value = part.partition("=")
        key = key.strip().lower()
        if not sep or key not in _KEYS:
            raise ValueError(
                f"policy={text!r}: bad entry {part.strip()!r}; expected key=dtype with key in "
                f"{', '.join(sorted(set(_KEYS.values())))} and dtype in {', '.join(CANONICAL)}"
            )
        canonical = _KEYS[key]
        if canonical in seen:
            raise ValueError(f"policy={text!r}: {canonical!r} is given twice")
        seen[canonical] = parse_dtype(value, argument=f"policy {canonical}")
    params = seen.get("params", torch.float32)
    return params, seen.get("compute", params), seen.get("output", params)


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

_GLOBAL: list[Policy] = [Policy("float32")]


def get_policy(policy: PolicyLike = None) -> Policy:
    """A ``Policy`` from a policy, a name or string, or ``None`` (the global policy)."""
    if policy is None:
        return _GLOBAL[0]
    if isinstance(policy, Policy):
        return policy
    return Policy(policy)


def global_policy() -> Policy:
    """The policy used where none is given (``float32`` until set)."""
    return _GLOBAL[0]


def set_global_policy(policy: PolicyLike) -> None:
    """Set the process-wide default policy, as Keras' ``set_global_policy``; ``None`` resets."""
    _GLOBAL[0] = Policy("float32") if policy is None else get_policy(policy)


@contextlib.contextmanager
def policy_scope(policy: PolicyLike) -> Iterator[Policy]:
    """Use ``policy`` as the global policy inside a ``with`` block."""
    previous = _GLOBAL[0]
    set_global_policy(policy)
    try:
        yield _GLOBAL[0]
    finally:
        _GLOBAL[0] = previous
