"""The random number generators' states in a checkpoint: captured at save, tried on fresh
generators before a load changes anything, and set once the load commits. Under torchrun
each rank takes its own where the Trainer saved every rank's (``rank_rng``)."""

from __future__ import annotations

import os
import random
from typing import Any

import numpy
import torch

from mixprec import distributed
from mixprec.checkpoint.format import CheckpointError


def rng_state() -> dict[str, Any]:
    """This process's torch, Python, NumPy (its global generator, which data augmentation
    often draws from) and (where CUDA is available) CUDA generators' states, as a checkpoint
    holds them."""
    kind, keys, pos, has_gauss, cached = numpy.random.get_state(legacy=True)  # type: ignore[misc]
    state: dict[str, Any] = {
        "torch": torch.get_rng_state(),
        "python": random.getstate(),
        "numpy": (str(kind), [int(k) for k in keys], int(pos), int(has_gauss), float(cached)),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def _this_ranks(
    path: str | os.PathLike[str], saved: dict[str, Any], trainer_state: dict[str, Any]
) -> dict[str, Any]:
    """The state this process restores: under torchrun, on a rank other than 0, its own,
    where the checkpoint holds one per rank now running (``trainer_state["rank_rng"]``,
    which the Trainer writes where the ranks' states differ); otherwise ``saved``, the
    state of the process that wrote the file (rank 0's), taken as it wrote."""
    ranks = trainer_state.get("rank_rng")
    size, rank = distributed.world_size(), distributed.rank()
    if not (isinstance(ranks, list) and size > 1 and len(ranks) == size) or rank == 0:
        return saved
    own = ranks[rank]
    if not isinstance(own, dict):
        raise CheckpointError(
            f"{path}: trainer_state/rank_rng/{rank} is a {type(own).__name__}, not a "
            "generator-state dict; restore_rng=False loads the rest"
        )
    return own


def _cuda_states(state: dict[str, Any]) -> list[torch.Tensor]:
    """The saved CUDA generator states for the devices present: a run resumed on fewer
    GPUs restores the first ones; devices beyond those saved keep their state."""
    if "cuda" not in state or not torch.cuda.is_available():
        return []
    return list(state["cuda"])[: torch.cuda.device_count()]


def _check_rng_state(path: str | os.PathLike[str], state: dict[str, Any]) -> None:
    """Set ``state`` on fresh generators: what ``_set_rng_state`` would refuse is refused
    here, before the model changes, and no generator of the process is touched."""
    try:
        torch.Generator().set_state(state["torch"])
        version, internal, gauss = state["python"]
        random.Random().setstate((version, tuple(internal), gauss))
        if "numpy" in state:
            numpy.random.RandomState().set_state(_numpy_state(state["numpy"]))
        for i, saved in enumerate(_cuda_states(state)):
            if saved.numel() != torch.cuda.get_rng_state(i).numel():
                raise ValueError(f"CUDA state {i} has {saved.numel()} bytes")
    except (RuntimeError, ValueError, TypeError, OverflowError, KeyError) as err:
        raise CheckpointError(
            f"{path}: its RNG state cannot be restored ({err}); restore_rng=False loads the rest"
        ) from None


def _set_rng_state(state: dict[str, Any]) -> None:
    """Set the process's generators to ``state`` (checked by ``_check_rng_state``)."""
    torch.set_rng_state(state["torch"])
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    if "numpy" in state:  # absent from checkpoints of earlier versions: left as it is
        numpy.random.set_state(_numpy_state(state["numpy"]))
    for i, saved in enumerate(_cuda_states(state)):
        torch.cuda.set_rng_state(saved, i)


def _numpy_state(saved: Any) -> tuple[Any, ...]:
    kind, keys, pos, has_gauss, cached = saved
    return (kind, numpy.asarray(keys, dtype=numpy.uint32), pos, has_gauss, cached)
