"""Parameter groups added after the wrap (``GroupAdoption``): through
``LossScaleOptimizer.add_param_group``, or through an inner optimizer kept from before the
wrap (``inner.add_param_group``), whose groups are adopted before they step."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from mixprec._errors import MisuseError
from mixprec.optim.fused import _fuse
from mixprec.optim.masters import MasterWeights, warn_if_eps_vanishes

if TYPE_CHECKING:
    from mixprec.optim.loss_scale_optimizer import _Bookkeeping

__all__ = ["GroupAdoption"]


class GroupAdoption:
    """Adopting groups added after construction (masters for their 16-bit parameters,
    the eps check, fused kernels), on the state ``LossScaleOptimizer`` sets up."""

    optimizers: list[torch.optim.Optimizer]
    _book: _Bookkeeping
    _weights: MasterWeights

    if TYPE_CHECKING:

        @property
        def optimizer(self) -> torch.optim.Optimizer: ...

        def _decide_host_path(self) -> None: ...

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        self._adopt_added_groups()
        group = dict(param_group)
        params = group["params"]
        params = [params] if isinstance(params, torch.Tensor) else list(params)
        group["params"] = self._weights.adopt(self.optimizer, params, "param_group")
        self.optimizer.add_param_group(group)
        self._book.groups[0] += 1  # self.optimizer is the first inner optimizer
        self._adopted(self.optimizer, len(self.optimizer.param_groups) - 1)

    def _adopted(self, inner: torch.optim.Optimizer, i: int) -> None:
        """What follows the adoption of ``inner``'s group ``i``."""
        warn_if_eps_vanishes(inner.param_groups[i], f"{type(inner).__name__} param_groups[{i}]")
        _fuse(inner, inner.param_groups[i])
        self._decide_host_path()

    def _adopt_added_groups(self) -> None:
        """Groups added to an inner optimizer itself (``inner.add_param_group``, with the
        inner optimizer kept from before the wrap), adopted before they step: their 16-bit
        parameters stepped as they were, with no master, their float16 gradients still
        multiplied by the loss scale and unchecked. One length per inner optimizer a step."""
        seen = zip(self.optimizers, self._book.groups, strict=True)
        added = any(len(inner.param_groups) > n for inner, n in seen)
        if added and self._book.found_inf is not None:
            raise MisuseError(
                "a param group was added to the inner optimizer between unscale_() and "
                "step(): its gradients were not unscaled with the others and would be left "
                "out. Add groups between steps (opt.add_param_group, or the inner optimizer's)"
            )
        for k, inner in enumerate(self.optimizers):
            for i in range(self._book.groups[k], len(inner.param_groups)):
                group = inner.param_groups[i]
                group["params"] = self._weights.adopt(inner, group["params"], f"param_groups[{i}]")
                self._adopted(inner, i)
            self._book.groups[k] = len(inner.param_groups)
