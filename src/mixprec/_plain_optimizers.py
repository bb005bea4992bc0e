"""Which 16-bit parameters need a float32 master, and the step guard: it warns when a
plain torch optimizer steps such parameters itself, and refuses a step called on the
optimizer a ``LossScaleOptimizer`` wraps. It sits below both ``levels`` (which installs the
guard when it stores weights in 16 bits) and ``optim`` (whose masters follow the same rule),
so neither imports the other for it."""

from __future__ import annotations

import sys
import warnings
import weakref
from collections.abc import Callable
from types import FrameType
from typing import Any

import torch
from torch.optim import optimizer as _torch_optimizer
from torch.optim.optimizer import register_optimizer_step_pre_hook

from mixprec._dtypes import HALF_DTYPES, dtype_name
from mixprec._errors import MisuseError
from mixprec._live_masters import take_masters
from mixprec._param_tags import unpickled_keepers
from mixprec.casting import COMPUTE_ATTR, LEVEL_ATTR, MASTERS_ATTR, POLICY_ATTR


def needs_master(p: torch.Tensor) -> bool:
    """A 16-bit parameter is updated through a float32 master, except at O3, which updates
    its weights in place (unless MindSpore's O3, ``amp_level="O3"``, asked for masters)."""
    return p.dtype in HALF_DTYPES and (
        getattr(p, LEVEL_ATTR, None) != "O3" or bool(getattr(p, MASTERS_ATTR, False))
    )


_HOOK: list[Any] = []  # the handle, once installed
# Wrappers stepping their inner optimizers now: an optimizer that one of those steps in
# turn (Lookahead's base) is the wrapper's, its gradients unscaled.
_STEPPING = [0]
_CHECKED: weakref.WeakSet[torch.optim.Optimizer] = weakref.WeakSet()
# Each wrapped optimizer -> its wrappers' bookkeeping (``stepping_inner`` is True while a
# wrapper steps it), weakly: once they are gone, the optimizer is a plain one again. Every
# wrapper's: with one per optimizer, a second wrapper over it (a cell run again over a
# float32 model) made the first one's steps refused, and once the second was gone, a step
# of the optimizer itself went through while the first still wrapped it.
_WRAPPED: weakref.WeakKeyDictionary[torch.optim.Optimizer, list[weakref.ref[Any]]] = (
    weakref.WeakKeyDictionary()
)


def _live_books(optimizer: Any) -> list[Any]:
    try:
        refs = _WRAPPED.get(optimizer, ())
    except TypeError:  # not weak-referenceable: no optimizer
        return []
    return [book for book in (ref() for ref in refs) if book is not None]


def watch_plain_optimizers() -> None:
    """Install, once per process, the global step pre-hook that warns when an optimizer
    steps a prepared model's 16-bit parameters itself (no float32 master behind them).

    Each optimizer is looked at once, at its first step; after that the hook is one
    membership test. Called at every preparation, which stores weights in 16 bits under
    optimizers that may have been looked at already (float32 warm-up steps): each is
    looked at again at its next step."""
    _install()
    _CHECKED.clear()


def _install() -> None:
    if not _HOOK:
        _HOOK.append(register_optimizer_step_pre_hook(_first_step))


def watch_wrapped(
    optimizer: torch.optim.Optimizer, book: Any, zero_grad: Callable[[bool], None]
) -> None:
    """``optimizer`` is stepped by a ``LossScaleOptimizer`` whose bookkeeping is ``book``
    and whose ``zero_grad`` is given: while that wrapper lives, a step called on the
    optimizer other than through ``step_inner`` raises (it would skip the unscale, the
    inf/NaN check and the float32 masters' copy-back), and its ``zero_grad`` is the
    wrapper's. torch.amp's loop keeps ``optimizer.zero_grad()`` after wrapping; at O2 the
    groups hold the float32 masters, so it cleared theirs alone, and the 16-bit weights'
    gradients added up over every step (0.853 against float32's 0.234 after 20)."""
    _install()
    _WRAPPED[optimizer] = [weakref.ref(b) for b in [*_live_books(optimizer), book]]
    optimizer.zero_grad = _WrapperZeroGrad(optimizer, zero_grad)  # type: ignore[method-assign]


class _WrapperZeroGrad:
    """An optimizer's ``zero_grad`` that is its wrapper's while the wrapper lives (weakly:
    the optimizer keeps no wrapper alive), and torch's own after."""

    def __init__(self, optimizer: torch.optim.Optimizer, wrapper: Callable[[bool], None]) -> None:
        self._optimizer = weakref.ref(optimizer)
        self._wrapper = weakref.WeakMethod(wrapper)  # type: ignore[arg-type]

    def __call__(self, set_to_none: bool = True) -> None:
        wrapper = self._wrapper()
        if wrapper is not None:
            wrapper(set_to_none)
            return
        optimizer = self._optimizer()
        if optimizer is not None:
            type(optimizer).zero_grad(optimizer, set_to_none)


def is_wrapped(optimizer: object) -> bool:
    """Whether a live ``LossScaleOptimizer`` wraps ``optimizer`` (its state alone holds
    neither the loss scale nor which 16-bit weight each float32 master stands for)."""
    return bool(_live_books(optimizer))


def step_inner(optimizer: torch.optim.Optimizer, book: Any) -> None:
    """The wrapper's step of ``optimizer``, which the hook lets through (a flag on the
    wrapper's own bookkeeping, so that another thread's preparation changes nothing)."""
    book.stepping_inner = True
    _STEPPING[0] += 1
    try:
        optimizer.step()
    finally:
        book.stepping_inner = False
        _STEPPING[0] -= 1


def no_other_global_hooks() -> bool:
    """No global optimizer step hook is installed but this guard (which lets a wrapper's
    own steps through, and does nothing after a plain optimizer's first step):
    ``optim.direct``, which a wrapper's step calls, may then skip ``Optimizer.step``'s hook
    calls."""
    pre = _torch_optimizer._global_optimizer_pre_hooks
    return not _torch_optimizer._global_optimizer_post_hooks and all(
        h is _first_step for h in pre.values()
    )


def _first_step(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    if torch.compiler.is_compiling():
        return
    wrapped = False
    for ref in _WRAPPED.get(optimizer, ()):  # one weakref per wrapper (most often one)
        book = ref()
        if book is not None:
            if book.stepping_inner:
                return
            wrapped = True
    if wrapped:
        kind = type(optimizer)
        raise MisuseError(
            f"{kind.__name__}.step() was called on the optimizer a LossScaleOptimizer wraps: "
            "that step skips the loss scale's unscale, the inf/NaN check and the float32 "
            "master weights (at O2 the model's 16-bit weights would never move). Step the "
            "wrapper instead: opt = mp.LossScaleOptimizer(inner); opt.backward(loss); opt.step()"
        )
    if optimizer in _CHECKED or _STEPPING[0]:
        return
    _CHECKED.add(optimizer)
    unpickled_keepers()  # a model from another process: its parameters' notes first
    # A model widened since its masters were made (model.float() for a float32 phase):
    # this first step starts from the masters, not their roundings, as the wrapper's would.
    take_masters(p for group in optimizer.param_groups for p in group["params"])
    _say_if_unscaled(optimizer)
    bare = [
        p
        for group in optimizer.param_groups
        for p in group["params"]
        if isinstance(p, torch.Tensor)
        and p.dtype in HALF_DTYPES
        and getattr(p, LEVEL_ATTR, None) is not None
        and needs_master(p)
    ]
    if not bare:
        return
    kind = type(optimizer)
    name = f"torch.optim.{kind.__name__}" if kind.__module__.startswith("torch.") else kind.__name__
    dtypes = ", ".join(sorted({dtype_name(p.dtype) for p in bare}))
    levels = ", ".join(sorted({str(getattr(p, LEVEL_ATTR)) for p in bare}))
    warnings.warn(
        f"{name} steps {len(bare)} {dtypes} parameters of a model prepared by "
        f"auto_mixed_precision (level {levels}) directly: they have no float32 master "
        "weights, so small updates round away and the optimizer state is 16-bit. Wrap "
        "the optimizer, built after "
        f"auto_mixed_precision: opt = mp.LossScaleOptimizer({name}(model.parameters(), ...))",
        UserWarning,
        stacklevel=3,  # _first_step <- torch's step wrapper <- the caller's opt.step()
    )


def _say_if_unscaled(optimizer: torch.optim.Optimizer) -> None:
    """A plain optimizer over parameters of a model prepared for float16 math with dynamic
    loss scaling (``mixed_float16``, any level but O0), stepped by neither a
    ``LossScaleOptimizer`` nor a GradScaler: nothing unscales or checks its gradients. With
    a second optimizer beside a wrapped one, ``opt.backward(loss)`` gave it gradients
    65536x too large (a loss of 1110 where float32 reached 1.48), unsaid."""
    scaled = [
        p
        for group in optimizer.param_groups
        for p in group["params"]
        if isinstance(p, torch.Tensor)
        and getattr(getattr(p, POLICY_ATTR, None), "loss_scaling", None) == "dynamic"
        and getattr(p, LEVEL_ATTR, "O0") != "O0"
        and getattr(p, COMPUTE_ATTR, None) != torch.float32  # to_float(..., "float32")
    ]
    if not scaled or _called_by_a_grad_scaler():
        return
    from mixprec.scaling.by_hand import unscaled_by_hand  # below: scaling imports casting

    if unscaled_by_hand([p.grad for p in scaled if p.grad is not None]):
        return  # a MindSpore-style loop: loss_scaler.unscale_(grads), then step
    kind = type(optimizer)
    name = f"torch.optim.{kind.__name__}" if kind.__module__.startswith("torch.") else kind.__name__
    warnings.warn(
        f"{name} steps {len(scaled)} parameters of a model prepared for float16 math "
        f"(level {getattr(scaled[0], LEVEL_ATTR)}) by itself: nothing unscales or checks "
        "their gradients. After a LossScaleOptimizer's backward(loss) they are the scaled "
        "loss's (the loss scale times too large: 65536 at the start); after "
        "loss.backward(), small ones may have underflowed to zero. "
        "Wrap it too: one LossScaleOptimizer over both, "
        f"mp.LossScaleOptimizer([opt_a, {name}(...)]), or mp.GradScaler's scaler.step(opt)",
        UserWarning,
        stacklevel=4,  # here <- _first_step <- torch's step wrapper <- the caller's step()
    )


def _called_by_a_grad_scaler() -> bool:
    """Whether a GradScaler's ``step`` (torch's or mixprec's, which unscales first) is
    stepping the optimizer: a look up the stack, once per optimizer."""
    frame: FrameType | None = sys._getframe(2)
    for _ in range(12):
        if frame is None:
            return False
        if frame.f_code.co_name in ("_maybe_opt_step", "step") and "grad_scaler" in (
            frame.f_code.co_filename
        ):
            return True
        frame = frame.f_back
    return False
