"""Optimizer state laid out as its parameter, for torch's fused kernels.

The fused Adam, AdamW and SGD kernels walk a parameter and its state (``exp_avg``,
``momentum_buffer``) as flat memory; torch's unfused loop indexes elements. A parameter
re-laid after its state was made (``model.to(memory_format=torch.channels_last)`` after a
step: ``param.data`` is replaced, its version counter does not move) was then updated with
other elements' moments: a CNN's first conv weight ended 19% off float32 in 20 SGD steps,
unsaid, where plain torch (unfused on CPU by default) trained as before. Before a fused
step, a state tensor whose strides differ from its parameter's is copied into its
parameter's layout. Only parameters of 4 or more dimensions can change layout that way;
their list and strides are kept per optimizer, and a step compares the strides.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch

from mixprec._errors import ArgumentError
from mixprec._strides import is_dense, laid_out_as

__all__ = [
    "is_dense",
    "lay_state_as_params",
    "match_state_layouts",
    "misshapen_state",
    "refuse_misshapen",
]

# State that torch's optimizers keep shaped as the parameter. Their fused kernels (and
# mixprec's direct calls of them) index it as the parameter without a check: a moment of
# another shape, loaded from another model's state, wrote past its memory and the process
# died later ("free(): invalid next size"), after a step reported as applied.
_PARAM_SHAPED = ("exp_avg", "exp_avg_sq", "max_exp_avg_sq", "momentum_buffer", "sum")

# Each optimizer -> the state dict its shapes were last checked in (torch's load_state_dict
# replaces it): a step checks again only after a load.
_CHECKED: weakref.WeakKeyDictionary[torch.optim.Optimizer, object] = weakref.WeakKeyDictionary()
# Each optimizer -> (its parameter count when listed, its fused groups' 4+-dim parameters,
# their strides when last matched).
_LISTED: weakref.WeakKeyDictionary[
    torch.optim.Optimizer, tuple[int, list[torch.Tensor], list[tuple[int, ...]]]
] = weakref.WeakKeyDictionary()


def _listed(inner: torch.optim.Optimizer) -> tuple[list[torch.Tensor], list[tuple[int, ...]]]:
    count = sum(len(group["params"]) for group in inner.param_groups)
    known = _LISTED.get(inner)
    if known is None or known[0] != count:
        params = [
            p
            for group in inner.param_groups
            if group.get("fused")
            for p in group["params"]
            if p.dim() >= 4
        ]
        known = _LISTED[inner] = (count, params, [p.stride() for p in params])
    return known[1], known[2]


def match_state_layouts(inner: torch.optim.Optimizer) -> None:
    """Copy into its parameter's layout each state tensor of a fused group's parameter
    whose strides differ from the parameter's (see the module's docstring). Each step reads
    the 4+-dim parameters' strides (a list compare: 24 us for 160 conv weights), and the
    state only where one changed."""
    if torch.compiler.is_compiling():
        return
    params, strides = _listed(inner)
    now = [p.stride() for p in params]
    if now == strides:
        return
    strides[:] = now
    _lay(inner, params)


def lay_state_as_params(inner: torch.optim.Optimizer) -> None:
    """After a load: state tensors are laid out as saved (a checkpoint writes them
    contiguous, and torch's load keeps that), so a channels_last conv's or a transposed
    weight's ``exp_avg`` no longer matched its parameter, and the fused kernel updated it
    with other elements' moments (0.35 of the update off after a resume, unsaid). Every
    parameter, of any dimension, once a load."""
    _lay(inner, [p for group in inner.param_groups for p in group["params"]])


def _lay(inner: torch.optim.Optimizer, params: list[torch.Tensor]) -> None:
    for p in params:
        state: Any = inner.state.get(p)
        if not state:
            continue
        for key, value in list(state.items()):
            if isinstance(value, torch.Tensor) and not value.is_sparse and value.shape == p.shape:
                state[key] = laid_out_as(value, p)


def misshapen_state(
    inner: torch.optim.Optimizer,
    params: list[torch.Tensor] | None = None,
    states: list[Any] | None = None,
) -> str | None:
    """What is wrong where one of torch's optimizers holds a param-shaped state tensor
    (``exp_avg``, ``momentum_buffer``, ...) of another shape than its parameter: said with
    the parameter's place and both shapes; ``None`` where every one fits. ``params`` and
    ``states``: a state about to be loaded, each parameter's (default: ``inner``'s own)."""
    if not type(inner).__module__.startswith("torch.optim"):
        return None  # another optimizer may keep its state in shapes of its own
    if params is None:
        params = [p for group in inner.param_groups for p in group["params"]]
        states = [inner.state.get(p) for p in params]
    for i, (p, state) in enumerate(zip(params, states or [], strict=False)):
        if not isinstance(state, dict):
            continue
        for key in _PARAM_SHAPED:
            value = state.get(key)
            if isinstance(value, torch.Tensor) and value.shape != p.shape:
                return (
                    f"the state of parameter {i} of {type(inner).__name__} has {key!r} of "
                    f"shape {tuple(value.shape)}, its parameter {tuple(p.shape)}: a state "
                    "saved from another model (torch's fused kernels would write past its "
                    "memory)"
                )
    return None


def refuse_misshapen(inner: torch.optim.Optimizer, always: bool = False) -> None:
    """Before a step: raise where a state tensor does not fit its parameter
    (``misshapen_state``). Checked once per state dict (after each load), or ``always``."""
    if torch.compiler.is_compiling() or (not always and _CHECKED.get(inner) is inner.state):
        return  # a compiled step: checked by the eager steps around it
    wrong = misshapen_state(inner)
    if wrong is not None:
        raise ArgumentError(f"step: {wrong}; load a state saved from this model")
    _CHECKED[inner] = inner.state
