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
  copy, and the caller's stayed as it was; so were a dict's or list's entries the model
  set (now written back: ``_rebuilt.write_back``).

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
from mixprec._rebuilt import Casts
from mixprec._upcast_saves import functorch_active
from mixprec._warn import warn_at_caller
from mixprec.casting import cast_linked

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
BOUNDARY_LOOK = r"(input '[^']*' (holds|sits)|the model wrote into input)"

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
    try:
        params = inspect.signature(forward).parameters
    except (TypeError, ValueError):  # a builtin forward: nothing to name by
        if names:
            raise ArgumentError(
                f"keep_inputs={tuple(names)!r}: the model's forward has no signature to find "
                "those names in"
            ) from None
        return KEPT_ALWAYS
    var = {p.name for p in params.values() if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD)}
    takes_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
    for name in names:
        if not isinstance(name, str):
            raise ArgumentError(f"keep_inputs: {name!r} is not an argument name (a string)")
        if name in var:
            raise ArgumentError(
                f"keep_inputs: {name!r} is forward's *{name} or **{name}, not an argument; "
                "pass the input by keyword and name that keyword"
            )
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
) -> tuple[tuple[Any, ...], dict[str, Any], Casts | None]:
    """``cast_floating`` of every input but those named (by keyword or position), and the
    mutable containers rebuilt on the way (``None`` if none), for ``write_back`` after the
    forward."""
    casts = Casts()
    kept = len(positional)
    args = tuple(
        a if i < kept and positional[i] in names else cast_linked(a, dtype, False, casts)
        for i, a in enumerate(args)
    )
    kwargs = {
        k: v if k in names else cast_linked(v, dtype, False, casts) for k, v in kwargs.items()
    }
    return args, kwargs, (casts if casts.copies else None)


# Tensor, the copy the cast made of it, and the copy's version then.
Watched = tuple[str, torch.Tensor, int]


class InputLook:
    """The first ``LOOKS`` forwards of a prepared model: what its boundary cast did to each
    input (one host read per cast input, a second where whole numbers were rounded; none
    after), each kind said once. A look that cannot be made (inference mode, a functorch
    transform, tracing, meta or fake tensors) is not made; one that fails stops looking."""

    LOOKS = 2

    def __init__(self) -> None:
        self.looked = 0  # forwards that cast some input, looked at
        self.idle = 0  # forwards with nothing cast (Fabric cast them before the model)
        self.said: set[str] = set()

    def due(self) -> bool:
        """Whether this forward is one to look at (eager, autograd as usual)."""
        return (
            self.looked < self.LOOKS
            and self.idle < 4 * self.LOOKS
            and not torch.is_inference_mode_enabled()  # no version counters to watch
            and not torch._C._get_tracing_state()  # torch.jit.trace
            and not functorch_active()  # .item() of a batched tensor raises
        )

    def before(
        self, given: tuple[Any, dict[str, Any]], cast: tuple[Any, dict[str, Any]],
        positional: list[str], dtype: torch.dtype,
    ) -> list[Watched]:  # fmt: skip
        """Say what the cast lost; return the copies to watch for the model's writes."""
        watched = []
        args, kwargs = given
        try:
            for i, (a, b) in enumerate(zip(args, cast[0], strict=True)):
                name = positional[i] if i < len(positional) else f"args[{i}]"
                watched += [self._look(path, x, y, dtype) for path, x, y in _pairs(a, b, name)]
            for k, v in kwargs.items():
                watched += [
                    self._look(path, x, y, dtype) for path, x, y in _pairs(v, cast[1][k], k)
                ]
        except Exception:  # a tensor this look cannot read: it stops, the forward goes on
            self.looked = self.LOOKS
            return []
        if watched:
            self.looked += 1
        else:
            self.idle += 1
        return watched

    def _look(
        self, path: str, given: torch.Tensor, cast: torch.Tensor, dtype: torch.dtype
    ) -> Watched:
        with torch.no_grad():
            moved = (cast.to(given.dtype) - given).abs()
            flags = [
                (torch.isfinite(given) & ~torch.isfinite(cast)).any(),  # made inf
                (given == given.round()).all(),  # whole numbers
                given.abs().amax(),
                given.amin(),
                (moved > 0).any(),  # changed
                moved.mean(),
                given.mean(),
                given.std() if given.numel() > 1 else torch.zeros(()),
                _row_sums(given),
            ]
            stats = torch.stack([f.float() for f in flags]).tolist()
            made_inf, whole, top, low, changed, error, mean, spread, row = stats
            exact = 2 / torch.finfo(dtype).eps  # the dtype's last exact integer: 256, 2048
            # A mask of 0s and 1s casts exactly, but counts taken over it inside the model do
            # not: mask.sum() past 65504 is inf in float16 (a masked mean's loss 0, every
            # gradient 0, the step applied), mask.cumsum() positions past 256 round in
            # bfloat16. Said where all its ones, or those of one row (along its last long
            # dimension, where cumsum counts positions), pass that far; not for one-hot
            # features, whose rows hold a single one. Only an input named as a mask: 0/1
            # features (binarised pixels, multi-hot words, one-hot DNA) go into matmuls,
            # exactly, and a bool or integer tensor there fails on dtypes.
            mask = whole and low >= 0 and top == 1 and "mask" in path.lower()
            ones = round(mean * given.numel()) if mask else 0
            counted = mask and (ones > torch.finfo(dtype).max or row > exact)
            # A timestep or a position (one number a sample, a 1-D ramp, or a batch of
            # them, (batch, time)) past the exact integers; not an image, rounded as any
            # other activation.
            rounded = whole and changed and given.dim() <= 2 and top > exact
            if rounded:  # nor a mask (0 and one large value), whose rounding is harmless
                distinct = torch.unique(given)
                rounded = not (distinct.numel() <= 2 and bool((distinct == 0).any()))
        name = str(dtype).removeprefix("torch.")
        if made_inf:
            example = "-1e9" if dtype == torch.float16 else "torch.finfo(torch.float32).min"
            said = (
                f"input {path!r} holds finite values past {name}'s range that the cast to "
                f"{name} at the model's boundary made inf (an additive mask of {example} "
                "becomes -inf, and a fully masked row then gives NaN)"
            )
            self._say("inf", said, path)
        elif counted:
            if ones > torch.finfo(dtype).max:
                past = f"its {ones} ones sum to inf in {name}"
            else:
                past = f"a row's {row:g} ones pass {name}'s exact integers ({exact:g})"
            said = (
                f"input {path!r} holds 0s and 1s (a mask), which the cast to {name} at the "
                f"model's boundary keeps exact; counts taken over it inside the model are "
                f"not: {past}, so mask.sum() and positions from mask.cumsum() go wrong"
            )
            self._say("mask", said, path, "or pass it as a bool or integer tensor")
        elif rounded:
            example = "997 becomes 996" if dtype == torch.bfloat16 else "4097 becomes 4096"
            said = (
                f"input {path!r} holds whole numbers up to {top:g}, which the cast to {name} at "
                f"the model's boundary rounds ({example}): timesteps, positions or integer "
                "features lose their exact value"
            )
            self._say("whole", said, path)
        elif spread > 0 and error > 0.01 * spread:  # far from zero against its spread
            said = (
                f"input {path!r} sits far from zero against its spread (mean {mean:.4g}, std "
                f"{spread:.3g}): the cast to {name} at the model's boundary moves its values "
                f"by {error:.3g} on average, {100 * error / spread:.0f}% of their spread "
                "(unnormalised series or targets lose their detail)"
            )
            self._say("offset", said, path)
        return path, cast, cast._version

    def after(self, watched: list[Watched]) -> None:
        """Say a write of the model into a cast copy of one of its inputs."""
        for path, cast, version in watched:
            if cast._version != version:
                name = str(cast.dtype).removeprefix("torch.")
                said = (
                    f"the model wrote into input {path!r}, which the cast to {name} at its "
                    "boundary had copied: the write went to the copy, and the tensor passed "
                    "in is unchanged (what matters if the caller reads it after the call: a "
                    "cache, a preallocated buffer)"
                )
                self._say("write", said, path)
                return

    def _say(
        self, kind: str, what: str, path: str,
        other: str = "or pass it in an integer dtype or already in 16 bits",
    ) -> None:  # fmt: skip
        if kind in self.said:
            return
        self.said.add(kind)
        top = path.split("[")[0].split(".")[0]
        if kind == "offset":
            # Kept as given, it was rounded the same in the first 16-bit layer (and the
            # offset rides on in the activations): the error stayed 100% of the spread.
            warn_at_caller(
                f"{what}. Normalise it before the model (subtract its mean, divide by its "
                "std): keep_inputs leaves it as given only until the first 16-bit layer, "
                "which rounds it the same way"
            )
            return
        if top == "args":  # forward(*args): no name to keep it by
            fix = "keep it, pass it by keyword and name it in keep_inputs="
        else:
            fix = f"leave it as given: auto_mixed_precision(model, ..., keep_inputs=({top!r},))"
        warn_at_caller(f"{what}. To {fix}, {other}")


def _pairs(given: Any, cast: Any, path: str) -> Iterator[tuple[str, torch.Tensor, torch.Tensor]]:
    """The floating tensors of ``given`` that the cast replaced, with their copies."""
    if isinstance(given, torch.Tensor):
        plain = type(given) in (torch.Tensor, torch.nn.Parameter)  # no fake or sharded one
        plain = plain and given.layout == torch.strided and not given.is_meta
        plain = plain and not given.is_nested and given.numel() > 0
        if (
            plain
            and isinstance(cast, torch.Tensor)
            and cast is not given
            and given.is_floating_point()
        ):
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


def _row_sums(given: torch.Tensor) -> torch.Tensor:
    """The largest sum along ``given``'s last dimension longer than 1 (a mask's ones in a
    row; 0 for a scalar)."""
    long = [d for d in range(given.dim()) if given.shape[d] > 1]
    return given.sum(dim=long[-1]).amax() if long else given.sum()
