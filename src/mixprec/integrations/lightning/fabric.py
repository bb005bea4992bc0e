"""``MixprecFabricPrecision``: mixprec's mixed precision as a ``lightning.fabric.Fabric``
plugin."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from mixprec._errors import ArgumentError
from mixprec.integrations.lightning._lightning import FabricPrecision
from mixprec.integrations.lightning.precision import _MixprecPlugin
from mixprec.optim import LossScaleOptimizer, StepResult


class MixprecFabricPrecision(_MixprecPlugin, FabricPrecision):  # type: ignore[misc]
    """mixprec's mixed precision in ``lightning.fabric.Fabric``: the same options as
    ``MixprecPrecision``.

    Fabric shows a plugin the optimizer only when it steps, unscales or clips, so each
    optimizer is wrapped in a ``LossScaleOptimizer`` then (masters from the float32 values
    kept when the model was prepared), and ``fabric.backward`` scales the loss by the shared
    scaler. ``optimizer.step()`` returns the ``StepResult``: step a scheduler only when
    ``not result.skipped``. The 16-bit gradients are released after each step, since the
    optimizer's own ``zero_grad`` only reaches the float32 masters.

    Checkpoints: put the plugin in the state, ``fabric.save(path, {"model": model,
    "optimizer": optimizer, "mixprec": plugin})``; its state holds the scaler and every
    wrapped optimizer's masters, which the optimizer's own state does not.
    """

    def _reset_run(self) -> None:
        super()._reset_run()
        self._last_loss: torch.Tensor | None = None  # see _fabric_lso
        self._pending: list[dict[str, Any]] = []  # loaded before their optimizer was seen

    def __getstate__(self) -> dict[str, Any]:
        state = super().__getstate__()
        state.pop("_last_loss", None)
        state.pop("_pending", None)
        return state

    def _fabric_lso(self, optimizer: Any) -> LossScaleOptimizer:
        lso = self._owner_of(optimizer)
        if lso is not None:
            return lso
        lso = self._wrap(getattr(optimizer, "_optimizer", optimizer))
        if self._pending:
            lso.load_state_dict(self._pending.pop(0))
        # Backward passes made before Fabric showed us this optimizer (the first step) left
        # gradients scaled by the shared scale: count them as the step's micro-batch.
        waiting = any(p.grad is not None for p in lso.master_params()) or any(
            half.grad is not None for half, _ in lso.master_weights()
        )
        if waiting and self._last_loss is not None:
            lso.get_scaled_loss(self._last_loss)
        return lso

    def backward(
        self, tensor: torch.Tensor, model: nn.Module | None, *args: Any, **kwargs: Any
    ) -> None:
        self._last_loss = tensor.detach()
        self._scaled_loss(tensor, list(self._lsos)).backward(*args, **kwargs)

    def unscale_gradients(self, optimizer: torch.optim.Optimizer) -> None:
        """Unscale into the float32 masters (``fabric.clip_gradients`` calls this)."""
        self._unscale(self._fabric_lso(optimizer))

    def main_params(self, optimizer: torch.optim.Optimizer) -> Iterator[torch.Tensor]:  # type: ignore[override]
        return self._fabric_lso(optimizer).master_params()

    def optimizer_step(self, optimizer: Any, **kwargs: Any) -> StepResult:
        if kwargs:
            raise ArgumentError(
                f"{type(self).__name__}: optimizer.step() got {sorted(kwargs)}; a "
                "LossScaleOptimizer step takes no closure or other arguments"
            )
        lso = self._fabric_lso(optimizer)
        self._unscale(lso)
        result = self._apply(lso)
        for half, _ in lso.master_weights():
            half.grad = None
        return result

    def state_dict(self) -> dict[str, Any]:
        if self._scaler is None:
            return {}
        return {
            **self._scaler_state(),
            "optimizers": [lso.state_dict() for lso in self._lsos] + list(self._pending),
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._load_scaler_state(state_dict)
        states = list(state_dict.get("optimizers", []))
        for lso, state in zip(self._lsos, states, strict=False):
            lso.load_state_dict(state)
        # Fabric has not shown us these optimizers yet: they load when it does.
        self._pending = states[len(self._lsos) :]
