"""Activation checkpointing of a block inside a prepared model.

At O1 and O2, softmax, normalisation and the other ``FLOAT32_FUNCTIONS`` run in float32
under the ``Float32Functions`` mode that a region's forward enters (on devices other than
CUDA, whose autocast does it). ``torch.utils.checkpoint`` recomputes a block in the backward
pass under the autocast state of its forward, but not under the torch function modes that
were on: the recompute ran those functions in 16 bits. With ``use_reentrant=False``
(torch's default) that fails in the backward, the recomputed tensors' dtypes differing from
the saved ones; with ``use_reentrant=True`` the gradients came from the 16-bit functions.
``checkpoint_context`` is the ``context_fn`` that puts the mode back for the recompute;
``activation_checkpoint`` passes it where it can.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable
from typing import Any

import torch
import torch.utils.checkpoint
from torch import nn
from torch.overrides import _get_current_function_mode_stack

from mixprec._warn import warn_at_caller
from mixprec.casting import Float32Functions

__all__ = [
    "activation_checkpoint",
    "checkpoint_context",
    "checkpoint_like_the_forward",
    "with_pointer",
]


def _mode_on() -> bool:
    return any(isinstance(m, Float32Functions) for m in _get_current_function_mode_stack())


def checkpoint_context() -> tuple[
    contextlib.AbstractContextManager[Any], contextlib.AbstractContextManager[Any]
]:
    """``torch.utils.checkpoint.checkpoint(..., use_reentrant=False, context_fn=
    mp.checkpoint_context)``: the forward as it is, and the recompute under the float32
    functions mode where the forward ran under it (inside a prepared model at O1 or O2).
    Eager only: under ``torch.compile`` torch takes a ``context_fn`` for selective
    checkpointing; ``activation_checkpoint`` leaves it out there."""
    recompute: contextlib.AbstractContextManager[Any] = (
        Float32Functions() if _mode_on() else contextlib.nullcontext()
    )
    return contextlib.nullcontext(), recompute


_SAID_REENTRANT: list[bool] = []


def activation_checkpoint(
    function: Callable[..., Any], *args: Any, use_reentrant: bool = False, **kwargs: Any
) -> Any:
    """``torch.utils.checkpoint.checkpoint(function, *args, **kwargs)`` for a block inside
    a prepared model: its recompute computes as its forward did (``checkpoint_context``).
    Compiled, the traced graph holds the float32 casts and torch's checkpoint is used as
    it is. ``use_reentrant=True`` takes no ``context_fn``: where the float32 functions
    mode is on, its recompute runs them in 16 bits, said once."""
    if torch.compiler.is_compiling() or "context_fn" in kwargs:
        return torch.utils.checkpoint.checkpoint(
            function, *args, use_reentrant=use_reentrant, **kwargs
        )
    if use_reentrant:
        if _mode_on() and not _SAID_REENTRANT:
            _SAID_REENTRANT.append(True)
            warn_at_caller(
                "activation checkpointing with use_reentrant=True inside a prepared model: "
                "its recompute runs softmax and normalisation in 16 bits (the variant takes "
                "no context_fn), so the gradients differ from those without checkpointing; "
                "use_reentrant=False computes them as the forward did"
            )
        return torch.utils.checkpoint.checkpoint(function, *args, use_reentrant=True, **kwargs)
    return torch.utils.checkpoint.checkpoint(
        function, *args, use_reentrant=False, context_fn=checkpoint_context, **kwargs
    )


def checkpoint_like_the_forward(model: nn.Module) -> int:
    """Where a library set torch's checkpoint as a layer's checkpointing function (Hugging
    Face's ``_gradient_checkpointing_func``, a ``functools.partial`` of it with its
    arguments), put ``activation_checkpoint`` with the same arguments in its place.
    Returns how many layers were changed."""
    changed = 0
    for module in model.modules():
        func = module.__dict__.get("_gradient_checkpointing_func")
        if isinstance(func, functools.partial) and func.func is torch.utils.checkpoint.checkpoint:
            module._gradient_checkpointing_func = functools.partial(  # type: ignore[assignment]
                activation_checkpoint, *func.args, **func.keywords
            )
            changed += 1
    return changed


def with_pointer(err: BaseException) -> BaseException | None:
    """torch's ``CheckpointError`` for a recompute whose dtypes differ from the forward's
    (``torch.utils.checkpoint.checkpoint`` of a block inside a prepared model), said again
    with what to use instead; ``None`` for any other error. torch's own message names
    only tensor positions and dtypes, nothing of why they differ."""
    if not isinstance(err, torch.utils.checkpoint.CheckpointError):
        return None
    text = str(err)
    sixteen = "torch.bfloat16" in text or "torch.float16" in text
    if "different metadata" not in text or "torch.float32" not in text or not sixteen:
        return None  # a float32 and a 16-bit dtype: the float32 functions mode's doing
    return torch.utils.checkpoint.CheckpointError(
        f"{text}\n\nmixprec: a block inside a prepared model was checkpointed with "
        "torch.utils.checkpoint.checkpoint, whose recompute runs softmax and normalisation "
        "in 16 bits where the forward ran them in float32. Checkpoint it with "
        "mp.activation_checkpoint(block, *args), or pass context_fn=mp.checkpoint_context "
        "to torch's checkpoint (docs/policies-and-levels.md)"
    )
