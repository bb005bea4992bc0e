"""Activation checkpointing of a block inside a prepared model.

At O1 and O2, softmax, normalisation and the other ``FLOAT32_FUNCTIONS`` run in float32
under the ``Float32Functions`` mode that a region's forward enters. ``torch.utils.checkpoint``
recomputes a block in the backward pass under the autocast state of its forward, but not
under the torch function modes that were on: the recompute ran those functions in 16 bits.
With ``use_reentrant=False`` (torch's default) that fails in the backward, the recomputed
tensors' dtypes differing from the saved ones; with ``use_reentrant=True`` the gradients
came from the 16-bit functions. ``checkpoint_context`` is the ``context_fn`` that puts the
mode back for the recompute; ``activation_checkpoint`` passes it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import torch
import torch.utils.checkpoint
from torch.overrides import _get_current_function_mode_stack

from mixprec._errors import ArgumentError
from mixprec.casting import Float32Functions

__all__ = ["activation_checkpoint", "checkpoint_context", "checkpoint_kwargs"]


def checkpoint_context() -> tuple[
    contextlib.AbstractContextManager[Any], contextlib.AbstractContextManager[Any]
]:
    """``torch.utils.checkpoint.checkpoint(..., use_reentrant=False, context_fn=
    mp.checkpoint_context)``: the forward as it is, and the recompute under the float32
    functions mode where the forward ran under it (inside a prepared model at O1 or O2)."""
    on = any(isinstance(m, Float32Functions) for m in _get_current_function_mode_stack())
    recompute: contextlib.AbstractContextManager[Any] = (
        Float32Functions() if on else contextlib.nullcontext()
    )
    return contextlib.nullcontext(), recompute


def activation_checkpoint(
    function: Callable[..., Any], *args: Any, use_reentrant: bool = False, **kwargs: Any
) -> Any:
    """``torch.utils.checkpoint.checkpoint(function, *args, **kwargs)`` for a block inside
    a prepared model: its recompute computes as its forward did (``checkpoint_context``).
    Compiled, the traced graph holds the float32 casts and torch's checkpoint is used as
    it is. ``use_reentrant=True`` is refused: that variant takes no ``context_fn``."""
    if use_reentrant is not False:
        raise ArgumentError(
            f"activation_checkpoint(use_reentrant={use_reentrant!r}) is invalid; valid: False "
            "(the reentrant variant takes no context_fn, so its recompute would run softmax "
            "and normalisation in 16 bits)"
        )
    if torch.compiler.is_compiling():
        return torch.utils.checkpoint.checkpoint(function, *args, use_reentrant=False, **kwargs)
    return torch.utils.checkpoint.checkpoint(
        function, *args, use_reentrant=False, context_fn=checkpoint_context, **kwargs
    )


def checkpoint_kwargs(given: dict[str, Any] | None, who: str) -> dict[str, Any]:
    """The keyword arguments a library's checkpointing (Hugging Face's
    ``gradient_checkpointing_kwargs``) passes to ``torch.utils.checkpoint``, with
    ``checkpoint_context`` as their ``context_fn`` where none was given. ``use_reentrant=True``
    is refused: that variant takes no ``context_fn``."""
    kwargs = dict(given or {"use_reentrant": False})
    if kwargs.get("use_reentrant") is not False:
        raise ArgumentError(
            f"{who}: use_reentrant={kwargs.get('use_reentrant')!r} in the checkpointing "
            "arguments; valid: False (the reentrant variant takes no context_fn, so its "
            "recompute would run normalisation and softmax in 16 bits)"
        )
    kwargs.setdefault("context_fn", checkpoint_context)
    return kwargs
