"""``StateView``: ``LossScaleOptimizer.state``, the inner optimizers' per-parameter state
reached through the model's parameters.

The inner optimizers key their state by what they update: a 16-bit weight's float32
master, not the weight. ``opt.state[weight]`` on the inner ``defaultdict`` would find
nothing and insert an entry under a tensor no group holds, which the next ``state_dict()``
cannot place (a bare ``KeyError``). The view translates a 16-bit weight to its master and
a key to the inner optimizer that holds it; reads and writes land where the step uses them.
"""

from __future__ import annotations

from collections.abc import Iterator, MutableMapping, Sequence
from typing import Any

import torch

from mixprec.optim.masters import MasterWeights

__all__ = ["StateView"]


class StateView(MutableMapping[torch.Tensor, Any]):
    """Per-parameter optimizer state, by model parameter or by master. A parameter the
    optimizer holds but has not stepped gets an empty entry (``defaultdict``'s behaviour,
    under its master); any other tensor is a ``KeyError``."""

    def __init__(self, optimizers: Sequence[torch.optim.Optimizer], weights: MasterWeights):
        self._optimizers = optimizers
        self._weights = weights

    def _locate(self, param: Any) -> tuple[torch.optim.Optimizer, torch.Tensor]:
        slot = self._weights.index.get(id(param))
        key = self._weights.masters[slot[1]] if slot is not None and slot[0] else param
        for inner in self._optimizers:
            for group in inner.param_groups:
                if any(p is key for p in group["params"]):
                    return inner, key
        described = (
            f"tensor of shape {tuple(param.shape)}" if isinstance(param, torch.Tensor) else param
        )
        raise KeyError(f"{described!r} is not a parameter of this LossScaleOptimizer")

    def __getitem__(self, param: Any) -> Any:
        inner, key = self._locate(param)
        return inner.state[key]

    def __setitem__(self, param: Any, value: Any) -> None:
        inner, key = self._locate(param)
        inner.state[key] = value

    def __delitem__(self, param: Any) -> None:
        inner, key = self._locate(param)
        del inner.state[key]

    def __contains__(self, param: object) -> bool:
        try:
            inner, key = self._locate(param)
        except KeyError:
            return False
        return key in inner.state

    def __iter__(self) -> Iterator[torch.Tensor]:
        for inner in self._optimizers:
            yield from inner.state

    def __len__(self) -> int:
        return sum(len(inner.state) for inner in self._optimizers)

    def __repr__(self) -> str:
        return f"StateView({len(self)} parameters with state)"
