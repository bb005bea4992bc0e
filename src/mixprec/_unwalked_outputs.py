"""A word for a model output that ``cast_floating`` does not walk.

A region's output is cast to the policy's output dtype through tensors, tuples (named
ones too), lists, dicts, ``UserDict`` and dataclasses. Any other object (a
``SimpleNamespace``, a plain class, a ``deque``) is returned as it is: its 16-bit tensors
would reach the loss where the policy promises float32, without a word. Said once per type.
"""

from __future__ import annotations

import collections
from typing import Any

import torch

from mixprec._dtypes import dtype_name
from mixprec._warn import warn_at_caller

__all__ = ["say_if_unwalked"]

_SAID: set[type] = set()  # types said (or with nothing to look at): not looked at again


def say_if_unwalked(value: Any, dtype: torch.dtype) -> None:
    """Warn, once per type, when ``value`` (an object no cast walks) holds floating tensors
    in another dtype than ``dtype``, the one its region returns."""
    kind = type(value)
    if kind in _SAID or torch.compiler.is_compiling():
        return
    if isinstance(value, (collections.deque, set, frozenset)):
        items = list(value)
    else:
        try:
            items = list(vars(value).values())
        except TypeError:  # no __dict__ (slots, a C type): nothing to look at, ever
            _SAID.add(kind)
            return
    found = {v.dtype for v in items if isinstance(v, torch.Tensor) and v.is_floating_point()}
    if found - {dtype}:
        _SAID.add(kind)
        kept = ", ".join(sorted(map(dtype_name, found)))
        warn_at_caller(
            f"the model returned a {kind.__name__}, which mixprec does not look inside: its "
            f"floating tensors stay {kept} instead of the policy's output dtype "
            f"{dtype_name(dtype)}. Return a tensor, tuple, NamedTuple, list, dict or "
            "dataclass, or cast them yourself"
        )
