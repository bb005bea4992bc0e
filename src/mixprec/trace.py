"""Overflow provenance: which module's output or gradient first became non-finite.

Hooks on every module record, per forward call and per output gradient, a non-finite flag
and the finite range as device tensors, without synchronising. Only when a step is known to
have overflowed does ``first_overflow()`` read them back (one transfer) and name the first
module in execution order: forward first, then backward in the order gradients arrived.

Under ``torch.compile`` the hooks do nothing (and say so once): see ``_warn_off_under_compile``.
"""

from __future__ import annotations

import functools
import warnings
import weakref
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.utils.weak import WeakIdKeyDictionary

from mixprec._dtypes import HALF_DTYPES, dtype_name
from mixprec._param_tags import keeper_of, unpickled_keepers
from mixprec._warn import warn_at_caller
from mixprec.casting import LEVEL_ATTR, POLICY_ATTR, first_floating
from mixprec.keep import ROOT_NAME


@dataclass(frozen=True)
class Overflow:
    """Where a step first produced inf/NaN."""

    module: str
    kind: str  # the module's class name
    # "forward" (its output), "backward" (the gradient of its output) or "weight gradient"
    # (of one of its own parameters: x^T @ grad in 16 bits, from a large input feature).
    phase: str
    dtype: str
    nonfinite: int  # how many values were inf or NaN
    finite_min: float
    finite_max: float

    def __str__(self) -> str:
        finite = (
            f"finite values in [{self.finite_min:.4g}, {self.finite_max:.4g}]"
            if self.finite_min <= self.finite_max
            else "no finite value"
        )
        return (
            f"{self.module} ({self.kind}) {self.phase}: {self.nonfinite} non-finite values in "
            f"{self.dtype}; {finite}"
        )


def _summary(t: torch.Tensor) -> torch.Tensor:
    """[non-finite count, finite min, finite max] as one float32 device tensor."""
    t = t.detach()
    finite = torch.isfinite(t)
    values = t.float()
    big = torch.finfo(torch.float32).max
    low = torch.where(finite, values, big).amin() if t.numel() else values.new_zeros(())
    high = torch.where(finite, values, -big).amax() if t.numel() else values.new_zeros(())
    bad = (~finite).sum().float()
    return torch.stack([bad, low, high])


class OverflowTracer:
    """Installs the hooks on ``model`` (or on each of several: one optimizer may step
    several models); ``first_overflow()`` after a bad step."""

    def __init__(self, model: nn.Module | Sequence[nn.Module]) -> None:
        models = [model] if isinstance(model, nn.Module) else list(model)
        self._records: list[tuple[str, str, str, str, torch.Tensor]] = []
        # The model's forwards since the last gradient arrived: where each began in the
        # records, and its output, weakly. At the next forward, one whose output is gone
        # with no backward (an evaluation pass with gradients on, an abandoned batch) is
        # dropped, so records neither grow without bound nor blame a pass no step came
        # from; one whose output lives (a model called twice before one backward) stays.
        self._pending: list[tuple[int, weakref.ref[torch.Tensor] | None]] = []
        self._backward_seen = False
        # The hooks reach the tracer weakly, and go with it: a tracer whose optimizer was
        # dropped (a cell run again, a second phase) kept recording every step into records
        # no step cleared (+1.1 MB a step on a 12-layer transformer), its hooks on the model.
        me = weakref.ref(self)
        self._models = [weakref.ref(m) for m in models]
        self._handles: list[Any] = []
        for each in models:
            self._handles.append(each.register_forward_pre_hook(_ModelForward(me)))
            for name, module in each.named_modules():
                hook = _ModuleForward(me, name or ROOT_NAME, type(module).__name__, module is each)
                self._handles.append(module.register_forward_hook(hook))
        weakref.finalize(self, _remove_all, self._handles)

    def _on_model_forward(self, module: nn.Module, args: Any) -> None:
        if torch.compiler.is_compiling() or not torch.is_grad_enabled():
            return
        if self._backward_seen:  # the forwards so far led to a backward: all kept
            self._pending.clear()
        elif self._pending:
            ends = [start for start, _ in self._pending[1:]] + [len(self._records)]
            kept: list[tuple[int, weakref.ref[torch.Tensor] | None]] = []
            dead, removed = [], 0
            for (start, ref), end in zip(self._pending, ends, strict=True):
                if ref is not None and ref() is not None:
                    kept.append((start - removed, ref))
                else:
                    dead.append((start, end))
                    removed += end - start
            for start, end in reversed(dead):  # in place: no copy of the records kept
                del self._records[start:end]
            self._pending = kept
        self._backward_seen = False
        self._pending.append((len(self._records), None))

    def clear(self) -> None:
        self._records.clear()
        self._pending.clear()
        self._backward_seen = False

    def first_overflow(self) -> Overflow | None:
        """The first record with a non-finite value (one host transfer), or ``None``."""
        if not self._records:
            return None
        table = torch.stack([r[4].to(self._records[0][4].device) for r in self._records]).tolist()
        for (name, kind, phase, dtype, _), (bad, low, high) in zip(
            self._records, table, strict=True
        ):
            if bad > 0:
                return Overflow(name, kind, phase, dtype, int(bad), low, high)
        return self._weight_gradient_overflow()

    def _weight_gradient_overflow(self) -> Overflow | None:
        """Every output and output gradient was finite, yet the step overflowed: a weight's
        own gradient did (``x^T @ grad`` in 16 bits, from one input feature of 6e4). The
        module that holds it, the first in backward order (the last to run forward); read
        only on such a step, one parameter at a time."""
        for ref in self._models:
            found = _weight_gradient_overflow_in(ref())
            if found is not None:
                return found
        return None

    def remove(self) -> None:
        _remove_all(self._handles)


def _weight_gradient_overflow_in(model: nn.Module | None) -> Overflow | None:
    """``model``'s module whose weight gradient is non-finite, the first in backward
    order; see ``OverflowTracer._weight_gradient_overflow``."""
    for name, module in reversed(list(model.named_modules()) if model is not None else []):
        for p in module.parameters(recurse=False):
            if p.grad is not None and not bool(torch.isfinite(p.grad).all()):
                bad, low, high = _summary(p.grad).tolist()
                kind, dtype = type(module).__name__, dtype_name(p.grad.dtype)
                return Overflow(name or ROOT_NAME, kind, "weight gradient", dtype, int(bad),
                                low, high)  # fmt: skip
    return None


def _remove_all(handles: list[Any]) -> None:
    for handle in handles:
        handle.remove()
    handles.clear()


class _Hook:
    """A tracer's hook on a module, reaching the tracer weakly. A copy of the module
    (``copy.deepcopy``, ``torch.save(model)``, a spawned DataLoader worker) gets one that
    does nothing: the copy is not what the tracer traces (its forwards were blamed on the
    original's layers), and closures made every traced model unpicklable."""

    def __init__(self, me: weakref.ref[OverflowTracer]) -> None:
        self.me = me

    def __reduce__(self) -> tuple[Any, tuple[()]]:
        return _inert, ()


def _inert() -> Any:
    return _does_nothing


def _does_nothing(*args: Any) -> None:
    return None


class _ModelForward(_Hook):
    """The traced model's forward pre-hook: where a forward's records begin."""

    def __call__(self, module: nn.Module, args: Any) -> None:
        tracer = self.me()
        if tracer is not None:
            tracer._on_model_forward(module, args)


class _ModuleForward(_Hook):
    """A module's forward hook: its output's summary, and its gradient's in the backward."""

    def __init__(self, me: weakref.ref[OverflowTracer], name: str, kind: str, root: bool) -> None:
        super().__init__(me)
        self.name, self.kind, self.root = name, kind, root

    def __call__(self, module: nn.Module, args: Any, output: Any) -> None:
        if torch.compiler.is_compiling():
            _off_under_compile()
            return
        me, name, kind = self.me, self.name, self.kind
        tracer = me()
        out = first_floating(output)
        if tracer is None or out is None or not torch.is_grad_enabled():  # evaluation
            return
        tracer._records.append((name, kind, "forward", dtype_name(out.dtype), _summary(out)))
        if self.root and out.requires_grad and tracer._pending:  # a backward may follow it
            tracer._pending[-1] = (tracer._pending[-1][0], weakref.ref(out))
        if out.requires_grad:

            def on_grad(grad: torch.Tensor) -> None:
                live = me()
                if live is not None:
                    live._backward_seen = True
                    live._records.append(
                        (name, kind, "backward", dtype_name(grad.dtype), _summary(grad))
                    )

            out.register_hook(on_grad)


def _off_under_compile() -> bool:
    # Called while dynamo traces, not from the graph: the notice costs the steps nothing.
    _warn_off_under_compile()
    return True


# All that torch.compiler.assume_constant_result does (torch 2.4 to 2.13), set by hand: that
# function imports dynamo, ~2 s of every `import mixprec`. test_compile's fullgraph test of
# the notice fails if dynamo stops reading it.
_off_under_compile._dynamo_marked_constant = True  # type: ignore[attr-defined]


@functools.cache
def _warn_off_under_compile() -> None:
    # Per-tensor gradient hooks that append to a Python list cannot be part of a compiled
    # graph (dynamo refuses the side effect, or breaks the graph at every module).
    warnings.warn(
        "trace_overflow: the model runs under torch.compile, where the tracer's hooks are off; "
        "non-finite steps are still skipped, but StepResult.overflow stays None. To find the "
        "layer, run the failing batch through the uncompiled model (compiled._orig_mod) or "
        "mixprec.diagnose, which always runs eagerly.",
        UserWarning,
        stacklevel=2,
    )


# Parameter -> its prepared model, both weakly: a weak reference in the parameter's own
# __dict__ made every prepared model unpicklable (torch.save(model)).
_MODELS: WeakIdKeyDictionary = WeakIdKeyDictionary()


def remember_model(model: nn.Module) -> None:
    """Let each parameter find its prepared model (for ``trace_overflow=True``); a
    ``copy.deepcopy`` of the model finds its copy."""
    _remember(model, list(model.parameters()))
    keeper = keeper_of(model)
    if _remember not in keeper.on_copy:
        keeper.on_copy.append(_remember)
    if _remember not in keeper.on_rebuild:  # to_empty() of a model prepared on meta
        keeper.on_rebuild.append(_remember)


def _remember(model: nn.Module, params: list[torch.Tensor]) -> None:
    ref = weakref.ref(model)
    for param in params:
        _MODELS[param] = ref


def join_prepared_model(params: list[torch.Tensor]) -> None:
    """Give parameters added to a prepared model after its preparation (LoRA adapters, a
    new head) the model's policy and level, as its own carry: they compute in its region.
    Untagged, an optimizer over them alone took them for a float32 model's, and under
    ``mixed_float16`` did no loss scaling (98.8% of an adapter's gradients were 0). Only
    where some parameter is untagged: a look over the prepared models' parameters."""
    untagged = {id(p) for p in params if not hasattr(p, POLICY_ATTR)}
    if not untagged:
        return
    unpickled_keepers()  # a model from torch.load(path) is known too
    seen: set[int] = set()
    for ref in list(_MODELS.values()):
        model = ref()
        if model is None or id(model) in seen:
            continue
        seen.add(id(model))
        named = dict(model.named_parameters(remove_duplicate=False))
        joined = {name: p for name, p in named.items() if id(p) in untagged}
        source = next((p for p in named.values() if hasattr(p, POLICY_ATTR)), None)
        if not joined or source is None:
            continue
        attrs = {POLICY_ATTR: getattr(source, POLICY_ATTR), LEVEL_ATTR: getattr(source, LEVEL_ATTR)}
        keeper = keeper_of(model)  # and for the model's copies and loads
        for name, p in joined.items():
            p.__dict__.update(attrs)
            keeper.notes.setdefault(name, {}).update(attrs)
        _remember(model, list(joined.values()))
        _say_if_parametrized_late([n for n, p in joined.items() if _late_original(n, p)])


def _late_original(name: str, p: torch.Tensor) -> bool:
    """A 16-bit original of a parametrization (``weight_norm``'s ``original0``) that is
    new since preparation: registered on a prepared 16-bit weight, it was computed from
    that weight's rounding. Registered before, originals stay float32."""
    return ".parametrizations." in f".{name}" and ".original" in name and p.dtype in HALF_DTYPES


def _say_if_parametrized_late(names: list[str]) -> None:
    if names:
        warn_at_caller(
            f"{', '.join(names[:3])}{' ...' if len(names) > 3 else ''}: a parametrization "
            "registered after auto_mixed_precision (torch's weight_norm...) "
            "computed its originals from the 16-bit weight, so they lost its float32 values "
            "(weight_norm's g 2e-3 off in bfloat16) and train in 16 bits from those "
            "roundings. Register parametrizations before preparing the model: their "
            "originals then stay float32"
        )


def model_of(params: list[torch.Tensor]) -> nn.Module | None:
    found = models_of(params, first=True)
    return found[0] if found else None


def models_of(params: list[torch.Tensor], first: bool = False) -> list[nn.Module]:
    """The prepared models behind ``params``, each once, in the order of their first
    parameter (one optimizer may step several models); only the first with ``first``."""
    unpickled_keepers()
    models: dict[int, nn.Module] = {}
    for p in params:
        ref = _MODELS.get(p)
        model = ref() if ref is not None else None
        if model is not None and id(model) not in models:
            models[id(model)] = model
            if first:
                break
    return list(models.values())
