"""Nested state (optimizer, trainer and RNG states) as tensors plus a JSON skeleton, and back.

``_flatten`` moves every tensor out under a path-like name and leaves ``{"__tensor__":
name}`` in its place; tuples, dicts (with keys of any scalar type) and non-finite floats get
tagged nodes, since JSON has none of them. ``_unflatten`` rebuilds the original.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from mixprec._dtypes import dtype_name
from mixprec._errors import ArgumentError, shown
from mixprec.checkpoint._safetensors import SAFETENSORS_DTYPES

#: The dtypes a safetensors file holds.
_STORABLE = frozenset(SAFETENSORS_DTYPES.values())


def _flatten(obj: Any, prefix: str, tensors: dict[str, torch.Tensor]) -> Any:
    """Move every tensor of ``obj`` into ``tensors`` and return a JSON-able skeleton."""
    if isinstance(obj, torch.Tensor):
        if prefix in tensors:  # {"a": {"b": x}, "a/b": y}, or the keys 1 and "1"
            raise ArgumentError(
                f"cannot store two tensors under one name {prefix!r} in a checkpoint: rename "
                "a key (a key holding '/' or an int and a str that print alike)"
            )
        if obj.dtype not in _STORABLE:  # safetensors' writer failed with a bare KeyError
            raise ArgumentError(
                f"cannot store {prefix!r} in a checkpoint: its dtype {dtype_name(obj.dtype)} is "
                f"not one safetensors holds ({', '.join(sorted(map(dtype_name, _STORABLE)))})"
            )
        if obj.layout != torch.strided:  # SGD's momentum over a sparse embedding: no file
            obj = obj.to_dense()  # holds one (torch's own error was raised); same values
        tensors[prefix] = obj.detach().cpu().contiguous()
        return {"__tensor__": prefix}
    if isinstance(obj, dict):
        for k in obj:
            if k is not None and not isinstance(k, (bool, int, float, str)):
                raise ArgumentError(
                    f"cannot store a dict key of type {type(k).__name__} ({shown(k)}) in a "
                    f"checkpoint (at {prefix!r}): keys must be str, int, float, bool or None"
                )
        return {"__dict__": [[k, _flatten(v, f"{prefix}/{k}", tensors)] for k, v in obj.items()]}
    if isinstance(obj, (list, tuple)):
        items = [_flatten(v, f"{prefix}/{i}", tensors) for i, v in enumerate(obj)]
        return items if isinstance(obj, list) else {"__tuple__": items}
    if isinstance(obj, float) and not math.isfinite(obj):
        return {"__float__": repr(obj)}
    if obj is None or isinstance(obj, (bool, int, float, str)):
        return obj
    raise ArgumentError(f"cannot store a {type(obj).__name__} in a checkpoint (at {prefix!r})")


def _unflatten(skeleton: Any, tensors: dict[str, torch.Tensor]) -> Any:
    """The state ``_flatten`` took apart, with its tensors taken from ``tensors``."""
    if isinstance(skeleton, list):
        return [_unflatten(v, tensors) for v in skeleton]
    if isinstance(skeleton, dict):
        if "__tensor__" in skeleton:
            return tensors[skeleton["__tensor__"]]
        if "__tuple__" in skeleton:
            return tuple(_unflatten(v, tensors) for v in skeleton["__tuple__"])
        if "__float__" in skeleton:
            return float(skeleton["__float__"])
        return {k: _unflatten(v, tensors) for k, v in skeleton["__dict__"]}
    return skeleton


def _tensor_names(node: Any) -> list[str]:
    """The tensors a checked skeleton refers to."""
    if isinstance(node, list):
        return [name for item in node for name in _tensor_names(item)]
    if isinstance(node, dict):
        if "__tensor__" in node:
            return [node["__tensor__"]]
        if "__dict__" in node:
            return [name for _, item in node["__dict__"] for name in _tensor_names(item)]
        return _tensor_names(node.get("__tuple__", []))
    return []
