"""The parameters ``LossScaleOptimizer`` holds, by group (``ParamGroups``): groups added
after the wrap, through ``add_param_group`` or through an inner optimizer kept from before
the wrap (``inner.add_param_group``), adopted before they step; ``master_params()`` and
``master_weights()``."""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import torch

from mixprec._errors import MisuseError
from mixprec._float32_copies import remember_float32
from mixprec._live_masters import drop_note
from mixprec.optim.checks import say_if_grads_unfilled, say_if_masters_lost
from mixprec.optim.fused import _fuse
from mixprec.optim.in_place import say_what_in_place_loses
from mixprec.optim.masters import MasterWeights

if TYPE_CHECKING:
    from mixprec.optim.loss_scale_optimizer import _Bookkeeping
    from mixprec.scaling import LossScaler

__all__ = ["ParamGroups", "adopt_all"]

_BETWEEN = (
    "a param group was added between unscale_() and step(): its gradients were not unscaled "
    "with the others, and would be left out or applied still multiplied by the loss scale. "
    "Add groups between steps (opt.add_param_group, or the inner optimizer's)"
)


def adopt_all(weights: MasterWeights, optimizers: list[torch.optim.Optimizer]) -> None:
    """At the wrap: every group's parameters as masters, all or none. A group refused half
    way (a parameter in two groups) puts back those adopted, so that the torch optimizers
    step the model's weights again and can be wrapped once fixed (they held detached
    masters, and their own step moved nothing). The masters made go back as the
    weights' float32 values, and the state moved to them back to the weights: a wrap
    retried once fixed started its masters from the 16-bit roundings (4.9e-4 off), and
    said that an earlier optimizer was gone."""
    given = [[group["params"] for group in inner.param_groups] for inner in optimizers]
    try:
        for k, inner in enumerate(optimizers):
            which = f"optimizers[{k}]." if len(optimizers) > 1 else ""
            for i, group in enumerate(inner.param_groups):
                where = f"{which}param_groups[{i}]"
                group["params"] = weights.adopt(inner, group["params"], where)
    except BaseException:
        for inner, params in zip(optimizers, given, strict=True):
            for group, own in zip(inner.param_groups, params, strict=True):
                group["params"] = own
            for p, master in zip(weights.half, weights.masters, strict=True):
                state = inner.state.pop(master, None)
                if state:  # the moments in the weight's dtype again, as they were
                    inner.state[p] = {k: _as_before(v, p.dtype) for k, v in state.items()}
        # The masters made so far back onto their weights, as the float32 values they
        # stand for: the next wrap starts from them.
        for p, master in zip(weights.half, weights.masters, strict=True):
            drop_note(p)
            remember_float32(p, master.detach())
        raise


def _as_before(value: Any, dtype: torch.dtype) -> Any:
    tensor = torch.is_tensor(value) and value.is_floating_point() and value.dim()
    return value.to(dtype) if tensor else value


class ParamGroups:
    """Groups added after construction, adopted (masters for their 16-bit parameters, the
    eps check, fused kernels), and the tensors held, on the state ``LossScaleOptimizer``
    sets up."""

    optimizers: list[torch.optim.Optimizer]
    accumulation_steps: int
    _book: _Bookkeeping
    _loss_scaler: LossScaler
    _weights: MasterWeights

    if TYPE_CHECKING:

        @property
        def optimizer(self) -> torch.optim.Optimizer: ...

        def _decide_host_path(self) -> None: ...

        @property
        def param_groups(self) -> list[dict[str, Any]]: ...

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        self._adopt_added_groups()
        if self._book.found_inf is not None:
            raise MisuseError(_BETWEEN)
        # Adopted before it is added: a parameter refused (held already) adds no group.
        group = dict(param_group)
        params = group["params"]
        params = [params] if isinstance(params, torch.Tensor) else list(params)
        group["params"] = self._adopt(self.optimizer, params, "param_group")
        self.optimizer.add_param_group(group)
        self._book.groups[0] += 1  # self.optimizer is the first inner optimizer
        self._adopted(self.optimizer, len(self.optimizer.param_groups) - 1)

    def _adopt(self, inner: torch.optim.Optimizer, params: list[Any], where: str) -> list[Any]:
        """``MasterWeights.adopt``, saying where a weight's earlier master is gone: an
        unfrozen backbone added to a head-only optimizer built after the first one was
        dropped restarted from its roundings, 10 times the first phase's movement off."""
        lost = self._weights.lost
        adopted = self._weights.adopt(inner, params, where)
        say_if_masters_lost(self._weights.lost - lost)
        return adopted

    def _adopted(self, inner: torch.optim.Optimizer, i: int) -> None:
        """What follows the adoption of ``inner``'s group ``i``."""
        _fuse(inner, inner.param_groups[i])  # first: a fused kernel adds eps in float32
        say_what_in_place_loses(
            inner, inner.param_groups[i], f"{type(inner).__name__} param_groups[{i}]"
        )
        self._decide_host_path()

    def _adopt_added_groups(self) -> None:
        """Groups added to an inner optimizer itself (``inner.add_param_group``, with the
        inner optimizer kept from before the wrap), adopted before they step: their 16-bit
        parameters stepped as they were, with no master, their float16 gradients still
        multiplied by the loss scale and unchecked. One length per inner optimizer a step."""
        seen = zip(self.optimizers, self._book.groups, strict=True)
        added = any(len(inner.param_groups) > n for inner, n in seen)
        if added and self._book.found_inf is not None:
            raise MisuseError(_BETWEEN)
        for k, inner in enumerate(self.optimizers):
            for i in range(self._book.groups[k], len(inner.param_groups)):
                group = inner.param_groups[i]
                group["params"] = self._adopt(inner, group["params"], f"param_groups[{i}]")
                self._adopted(inner, i)
            self._book.groups[k] = len(inner.param_groups)

    def master_weights(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """``(16-bit model parameter, its float32 master)`` pairs, as the last step left
        them (``state_dict()`` and the checkpoints first take writes made to the weights
        since)."""
        self._adopt_added_groups()
        return list(zip(self._weights.half, self._weights.masters, strict=True))

    def model_params(self) -> list[torch.Tensor]:
        """The model's parameters it steps: the 16-bit ones behind its masters, then those
        it steps as they are (where the gradients of a backward wait until the unscale)."""
        self._adopt_added_groups()
        return self._weights.model_params()

    def master_params(self) -> Iterator[torch.Tensor]:
        """The tensors the inner optimizer updates (float32 masters and plain parameters),
        their ``.grad`` the unscaled gradients once ``unscale_()`` ran. Before that (after
        the backward, where Apex's masters already hold unscaled gradients) the masters'
        ``.grad`` are ``None`` and plain ones still scaled: a warning says so, once, as
        ``clip_grad_norm_(opt.master_params(), max)`` would clip nothing that counts."""
        self._adopt_added_groups()
        book = self._book
        if book.fresh and book.found_inf is None and book.micro >= self.accumulation_steps:
            say_if_grads_unfilled(self._weights, self._loss_scaler.get_scale(), book)
        return iter(self._held())

    def _held(self) -> list[torch.Tensor]:
        """What the inner optimizers update, as adopted: ``master_params()`` without its
        adoption and its warning, for the optimizer's own use (clipping in the step)."""
        return [p for group in self.param_groups for p in group["params"]]
