"""``save_checkpoint``: model, optimizer, trainer and RNG states in one file, written
atomically, refusing up front what ``load_checkpoint`` would refuse."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch
from torch import nn

from mixprec._errors import ArgumentError, shown
from mixprec._version import __version__
from mixprec._warn import warn_at_caller
from mixprec.checkpoint._files import _atomic_write, writable_path
from mixprec.checkpoint._model import (
    _buffer_names,
    _model_tensors,
    check_arguments,
    check_masters_held,
    optimizer_classes,
    optimizer_param_names,
)
from mixprec.checkpoint._rng import rng_state
from mixprec.checkpoint._schema import _check_trainer_state
from mixprec.checkpoint._tree import _flatten
from mixprec.checkpoint.format import FORMAT, FORMAT_VERSION, _BadValueError, _checksum
from mixprec.float8 import summary as float8_summary
from mixprec.levels import applied
from mixprec.optim import LossScaleOptimizer


def save_checkpoint(
    path: str | os.PathLike[str],
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    trainer_state: dict[str, Any] | None = None,
) -> Path:
    """Write model, optimizer (inner state, masters, loss scaler), ``trainer_state`` (step,
    epoch, data order...) and RNG states to ``path`` atomically. Returns the path.

    ``trainer_state``'s ``global_step``, ``epoch`` and ``step_in_epoch``, where present, must
    be ints >= 0 and ``epoch_rng`` a uint8 tensor (the Trainer's resume state): an
    ``ArgumentError`` (a ``ValueError``) here, rather than a checkpoint that
    ``load_checkpoint`` refuses."""
    check_arguments("save_checkpoint", model, optimizer)
    if trainer_state is not None and not isinstance(trainer_state, dict):
        raise ArgumentError(
            f"save_checkpoint(trainer_state={shown(trainer_state)}) is invalid; valid: a dict "
            "(trainer.resume_state(), or your own: {'global_step': step, ...}) or None"
        )
    target = writable_path("save_checkpoint", path)
    pending = optimizer.pending_micro_steps if isinstance(optimizer, LossScaleOptimizer) else 0
    if pending:
        raise ArgumentError(
            f"save_checkpoint: the optimizer is {pending} of {optimizer.accumulation_steps} "  # type: ignore[union-attr]
            "micro-batches into an accumulation group, whose gradients a checkpoint does not "
            "hold: a resume would apply a partial group. Save after the step() that applies it"
        )
    check_masters_held(model, optimizer)
    tensors, aliases, master_names = _model_tensors(model, optimizer)
    optim_state: Any = None
    held = optimizer_param_names(optimizer, model) if optimizer is not None else []
    _say_if_non_finite(model)
    if optimizer is not None:
        state = optimizer.state_dict()
        if isinstance(optimizer, LossScaleOptimizer):
            state = {k: v for k, v in state.items() if k != "master_weights"}
        optim_state = _flatten(state, "optim", tensors)
    done = applied(model)
    header = {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "mixprec_version": __version__,
        "torch_version": torch.__version__,
        "policy": str(done.policy) if done else None,
        "level": done.level if done else None,
        # Float8 policies: the torchao recipe and the converted layers. Their weights are the
        # float32 (or master) values, as for any layer: float8 copies exist only in a forward.
        "float8": float8_summary(model),
        "aliases": aliases,
        "masters": master_names,
        # Buffers, whose values are not weights (a mask of -inf): convert_checkpoint keeps them.
        "buffers": sorted(_buffer_names(model, model.state_dict())),
        "optimizer": optim_state,
        "optimizer_kind": type(optimizer).__name__ if optimizer is not None else None,
        # The class of each optimizer whose state this is, checked when it loads. Left out
        # with no optimizer, so that a weights-only checkpoint has the keys it always had.
        **({"optimizer_classes": optimizer_classes(optimizer)} if optimizer is not None else {}),
        **({"optimizer_params": held} if optimizer is not None else {}),
        "trainer_state": _flatten(trainer_state or {}, "trainer", tensors),
        "rng": _flatten(rng_state(), "rng", tensors),
    }
    # The header as a reader parses it back: what load_checkpoint checks and the checksum
    # covers.
    parsed = json.loads(json.dumps(header))
    # What load_checkpoint will refuse is refused here, before anything is written.
    entries = {n: (t.dtype, tuple(t.shape), 0, 0) for n, t in tensors.items()}
    try:
        _check_trainer_state(parsed["trainer_state"], "trainer_state", entries)
    except _BadValueError as err:
        raise ArgumentError(f"save_checkpoint: {err}") from None
    parsed["checksum"] = _checksum(tensors, parsed)
    _atomic_write(tensors, {"mixprec": json.dumps(parsed)}, target)
    return target


def _say_if_non_finite(model: nn.Module) -> None:
    """A model with inf/NaN weights is saved (to look into a run that diverged), and said:
    ``load_checkpoint`` refuses such weights unless ``on_range="ignore"``."""
    bad = [n for n, p in model.named_parameters() if not bool(torch.isfinite(p).all())]
    if bad:
        warn_at_caller(
            f"save_checkpoint: {len(bad)} parameter(s) hold inf/NaN ({', '.join(bad[:3])}"
            f"{', ...' if len(bad) > 3 else ''}): saved as they are, but load_checkpoint "
            "refuses them unless on_range='ignore'; save from before training diverged"
        )
