"""The cast of a prepared model's floating inputs at its boundary (O2, O3: once, to the
compute dtype, in the model's own forward), what it leaves alone, and what the model's
first forwards say about it.

The cast did three things without a word:
- a float input that is no activation was rounded: Hugging Face regression labels near
  1000 gave an MSE of 0.38 where float32 gave 1.10 (the loss is computed inside the model),
  and diffusion timesteps 997, 998, 999 arrived as 996, 1000, 1000 in bfloat16;
- a finite value past float16's range (an additive mask of -1e9) became -inf, and a fully
  masked row gave NaN;
- a float tensor the model writes into (a preallocated cache) was written in its 16-bit
  copy, and the caller's stayed as it was.

``labels`` (Hugging Face's name for the targets) and the names given as ``keep_inputs``
pass as given. The model's first forwards look for the rest and say so, naming the input
and ``keep_inputs``; later forwards, and compiled ones, do not look.
"""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

import torch

from mixprec._errors import ArgumentError
from mixprec._warn import warn_at_caller
from mixprec.casting import cast_floating

__all__ = [
    "BOUNDARY_LOOK",
    "KEPT_ALWAYS",
    "InputLook",
    "cast_inputs",
    "checked_keep_inputs",
    "positional_names",
]

#: What the first forwards' warnings start with (the doctor, which reports the same in its
#: own words, filters them).
BOUNDARY_LOOK = r"(input '.*' holds|the model wrote into input)"

#: Never cast: Hugging Face models take their targets as ``labels`` and compute the loss.
KEPT_ALWAYS = frozenset({"labels"})


def checked_keep_inputs(forward: Callable[..., Any], keep_inputs: Iterable[str]) -> frozenset[str]:
    """``keep_inputs`` checked against ``forward``'s parameters, with ``KEPT_ALWAYS``."""
    if isinstance(keep_inputs, str) or not isinstance(keep_inputs, Iterable):
        raise ArgumentError(
            f"keep_inputs={keep_inputs!r} is invalid; give the names of forward's arguments "
            "to leave as given, as a tuple or list of strings (keep_inputs=('timestep',))"
        )
    names = list(keep_inputs)
    params = inspect.signature(forward).parameters
    takes_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
    for name in names:
        if not isinstance(name, str):
            raise ArgumentError(f"keep_inputs: {name!r} is not an argument name (a string)")
        if name not in params and not takes_any:
            raise ArgumentError(
                f"keep_inputs: {name!r} is not an argument of the model's forward; its "
                f"arguments are {', '.join(params) or 'none'}"
            )
    return frozenset(names) | KEPT_ALWAYS


def positional_names(forward: Callable[..., Any]) -> list[str]:
    """The names of ``forward``'s positional arguments, in order."""
    positional = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    try:
        params = inspect.signature(forward).parameters.values()
    except (TypeError, ValueError):  # a builtin without one: inputs named by position
        return []
    return [p.name for p in params if p.kind in positional]


def cast_inputs(
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    dtype: torch.dtype,
    names: frozenset[str],
    positional: list[str],
) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """``cast_floating`` of every input but those named (by keyword or position)."""
    kept = len(positional)
    args = tuple(
        a if i < kept and positional[i] in names else cast_floating(a, dtype)
        for i, a in enumerate(args)
    )
    kwargs = {k: v if k in names else cast_floating(v, dtype) for k, v in kwargs.items()}
    return args, kwargs


# Tensor, the copy the cast made of it, and the copy's version then.
Watched = tuple[str, torch.Tensor, int]


class InputLook:
    """The first ``LOOKS`` forwards of a prepared model: what its boundary cast did to each
    input (one host read per cast input, then none), each kind said once."""

    LOOKS = 2

    def __init__(self) -> None:
        self.looked = 0
        self.said: set[str] = set()

    def before(
        self, given: tuple[Any, dict[str, Any]], cast: tuple[Any, dict[str, Any]],
        positional: list[str], dtype: torch.dtype,
    ) -> list[Watched]:  # fmt: skip
        """Say what the cast lost; return the copies to watch for the model's writes."""
        self.looked += 1
        watched = []
        args, kwargs = given
        for i, (a, b) in enumerate(zip(args, cast[0], strict=True)):
            for path, x, y in _pairs(a, b, positional[i] if i < len(positional) else f"args[{i}]"):
                watched.append(self._look(path, x, y, dtype))
        for k, v in kwargs.items():
            for path, x, y in _pairs(v, cast[1][k], k):
                watched.append(self._look(path, x, y, dtype))
        return watched

    def _look(
        self, path: str, given: torch.Tensor, cast: torch.Tensor, dtype: torch.dtype
    ) -> Watched:
        with torch.no_grad():
            made_inf = bool((torch.isfinite(given) & ~torch.isfinite(cast)).any())
            whole = given.numel() > 0 and bool((given == given.round()).all())
            top = given.abs().max().item() if whole else 0.0
            rounded = whole and top > 2 / torch.finfo(dtype).eps  # past the exact integers
            rounded = rounded and not torch.equal(cast.to(given.dtype), given)
            if rounded:  # not a mask (0 and one large value), whose rounding is harmless
                distinct = torch.unique(given)
                rounded = not (distinct.numel() <= 2 and bool((distinct == 0).any()))
        name = str(dtype).removeprefix("torch.")
        example = "-1e9" if dtype == torch.float16 else "torch.finfo(torch.float32).min"
        if made_inf:
            said = (
                f"input {path!r} holds finite values past {name}'s range that the cast to "
                f"{name} at the model's boundary made inf (an additive mask of {example} "
                "becomes -inf, and a fully masked row then gives NaN)"
            )
            self._say("inf", said, path)
        elif rounded:
            said = (
                f"input {path!r} holds whole numbers up to {top:g}, which the cast to {name} at "
                "the model's boundary rounds (997 becomes 996 in bfloat16): timesteps or "
                "positions lose their value"
            )
            self._say("whole", said, path)
        return path, cast, cast._version

    def after(self, watched: list[Watched]) -> None:
        """Say a write of the model into a cast copy of one of its inputs."""
        for path, cast, version in watched:
            if cast._version != version:
                name = str(cast.dtype).removeprefix("torch.")
                said = (
                    f"the model wrote into input {path!r}, which the cast to {name} at its "
                    "boundary had copied: the write went to the copy, and the tensor passed "
                    "in is unchanged"
                )
                self._say("write", said, path)
                return

    def _say(self, kind: str, what: str, path: str) -> None:
        if kind in self.said:
            return
        self.said.add(kind)
        top = path.split("[")[0].split(".")[0]
        warn_at_caller(
            f"{what}. Leave it as given: auto_mixed_precision(model, ..., "
            f"keep_inputs=({top!r},)), or pass it in an integer dtype or already in 16 bits"
        )


def _pairs(given: Any, cast: Any, path: str) -> Iterator[tuple[str, torch.Tensor, torch.Tensor]]:
    """The floating tensors of ``given`` that the cast replaced, with their copies."""
    if isinstance(given, torch.Tensor):
        if isinstance(cast, torch.Tensor) and cast is not given and given.is_floating_point():
            yield path, given, cast
    elif isinstance(given, (tuple, list)) and isinstance(cast, (tuple, list)):
        for i, (a, b) in enumerate(zip(given, cast, strict=False)):
            yield from _pairs(a, b, f"{path}[{i}]")
    elif isinstance(given, Mapping) and isinstance(cast, Mapping):
        for k in given:
            if k in cast:
                yield from _pairs(given[k], cast[k], f"{path}[{k!r}]")
    elif dataclasses.is_dataclass(given) and not isinstance(given, type):
        for f in dataclasses.fields(given):
            yield from _pairs(
                getattr(given, f.name, None), getattr(cast, f.name, None), f"{path}.{f.name}"
            )
