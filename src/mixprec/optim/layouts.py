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

from mixprec._strides import is_dense, laid_out_as

__all__ = ["is_dense", "lay_state_as_params", "match_state_layouts"]

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
