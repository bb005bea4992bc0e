"""What ``LossScaleOptimizer.state_dict()`` holds, and the checks ``load_state_dict`` makes
before it loads any of it: ``optimizers`` (the inner optimizers' states), ``master_weights``
(the float32 masters, in order), ``loss_scaler`` and ``micro_steps``. A state that does not
fit this optimizer is refused whole, so that a bad one changes nothing.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from mixprec._errors import ArgumentError

__all__ = ["check_state_dict"]


def check_state_dict(
    state_dict: dict[str, Any],
    masters: Sequence[torch.Tensor],
    optimizers: Sequence[torch.optim.Optimizer],
) -> None:
    """Refuse a state that is not this optimizer's, before anything is loaded."""
    if not isinstance(state_dict, dict):
        raise ArgumentError(
            "load_state_dict: a LossScaleOptimizer state is a dict (from state_dict()), "
            f"got {type(state_dict).__name__}"
        )
    missing = [k for k in ("optimizers", "master_weights", "loss_scaler") if k not in state_dict]
    if missing:
        raise ArgumentError(
            f"load_state_dict: not a LossScaleOptimizer state; missing {', '.join(missing)}"
        )
    saved = state_dict["master_weights"]
    inner_states = state_dict["optimizers"]
    for key, value, kind in (
        ("master_weights", saved, torch.Tensor),
        ("optimizers", inner_states, dict),
    ):
        if not isinstance(value, (list, tuple)) or not all(isinstance(v, kind) for v in value):
            raise ArgumentError(
                f"load_state_dict: '{key}' must be a list of {kind.__name__}, got "
                f"{type(value).__name__}"
                + (
                    f" of {sorted({type(v).__name__ for v in value})}"
                    if isinstance(value, (list, tuple))
                    else ""
                )
            )
    _same_count("master weights", saved, masters)
    _same_count("inner optimizers", inner_states, optimizers)
    for i, (one, master) in enumerate(zip(saved, masters, strict=True)):
        if one.shape != master.shape:
            raise ArgumentError(
                f"load_state_dict: master weight {i} has shape {tuple(one.shape)}, "
                f"expected {tuple(master.shape)}"
            )


def _same_count(what: str, saved: Sequence[Any], ours: Sequence[Any]) -> None:
    if len(saved) != len(ours):
        raise ArgumentError(
            f"load_state_dict: state has {len(saved)} {what}, this LossScaleOptimizer {len(ours)}"
        )
