"""The inner optimizers as ``LossScaleOptimizer`` shows them (``InnerViews``: ``optimizer``,
``param_groups``, ``state``, ``defaults``), and its step hooks (``StepHooks``).

``StateView`` is ``LossScaleOptimizer.state``: the inner optimizers' per-parameter state
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
from torch.utils.hooks import RemovableHandle

from mixprec.optim.masters import MasterWeights
from mixprec.scaling import LossScaler

__all__ = ["InnerViews", "StateView", "StepHooks"]


class StateView(MutableMapping[torch.Tensor, Any]):
    """Per-parameter optimizer state, by model parameter or by master. A parameter the
    optimizer holds but has not stepped gets an empty entry (``defaultdict``'s behaviour,
    under its master); any other tensor is a ``KeyError``."""

    def __init__(self, optimizers: Sequence[torch.optim.Optimizer], weights: MasterWeights):
        self._optimizers = optimizers
        self._weights = weights
        self._owners: dict[int, torch.optim.Optimizer] = {}  # id(key) -> its optimizer

    def _locate(self, param: Any) -> tuple[torch.optim.Optimizer, torch.Tensor]:
        slot = self._weights.index.get(id(param))
        key = self._weights.masters[slot[1]] if slot is not None and slot[0] else param
        if id(key) not in self._owners:  # built once (and again if the groups changed)
            self._owners = {
                id(p): inner
                for inner in self._optimizers
                for group in inner.param_groups
                for p in group["params"]
            }
        inner = self._owners.get(id(key))
        if inner is not None:
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


class InnerViews:
    """The inner optimizers, seen through the wrapper."""

    optimizers: list[torch.optim.Optimizer]
    _weights: MasterWeights
    _loss_scaler: LossScaler
    max_grad_norm: float | None
    accumulation_steps: int

    @property
    def optimizer(self) -> torch.optim.Optimizer:
        """The inner optimizer (the first one, when several were given)."""
        return self.optimizers[0]

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        """The inner optimizers' groups (the same dicts: changing ``lr`` here changes it)."""
        if len(self.optimizers) == 1:
            return self.optimizers[0].param_groups
        return [g for inner in self.optimizers for g in inner.param_groups]

    @property
    def state(self) -> StateView:
        """Per-parameter state of the inner optimizers, by model parameter (a 16-bit
        weight finds its master's) or by master."""
        if self._weights.state_view is None:  # one view, so that its index is built once
            self._weights.state_view = StateView(self.optimizers, self._weights)
        return self._weights.state_view  # type: ignore[no-any-return]

    @property
    def defaults(self) -> dict[str, Any]:
        return self.optimizer.defaults

    def __repr__(self) -> str:
        return (
            f"LossScaleOptimizer({'+'.join(type(o).__name__ for o in self.optimizers)}, "
            f"loss_scaler={self._loss_scaler!r}, masters={len(self._weights.masters)}, "
            f"max_grad_norm={self.max_grad_norm}, accumulation_steps={self.accumulation_steps})"
        )


class StepHooks:
    """Step hooks: a pre-hook on the inner optimizer, post-hooks after the copy-back."""

    optimizers: list[torch.optim.Optimizer]
    _book: Any  # loss_scale_optimizer._Bookkeeping: its post_hooks

    def register_step_pre_hook(self, hook: Any) -> Any:
        """Runs before the (first) inner optimizer's step, that is, only on applied steps."""
        return self.optimizers[0].register_step_pre_hook(hook)

    def register_step_post_hook(self, hook: Any) -> RemovableHandle:
        """``hook(opt, args, kwargs)`` runs after each applied step, once the masters are
        copied back: it sees the updated 16-bit weights, and what it writes into them (a
        max-norm constraint) stays. Skipped steps do not run it; a step decided on the
        device is then decided on the host."""
        handle = RemovableHandle(self._book.post_hooks)
        self._book.post_hooks[handle.id] = hook
        return handle

    def _run_post_hooks(self) -> None:
        if not self._book.post_hooks:
            return
        for hook in list(self._book.post_hooks.values()):
            hook(self, (), {})
