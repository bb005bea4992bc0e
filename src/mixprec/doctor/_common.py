"""What the two doctors (the 16-bit and the float8 one) share: taking the float32 model they
diagnose (a 16-bit model as its float32 upcast copy), recording what its modules see in one
forward and backward, the relative error they compare runs by, and writing reports as
JSON."""

from __future__ import annotations

import copy
import dataclasses
import itertools
import json
import math
from collections.abc import Callable, Mapping
from types import TracebackType
from typing import Any

import torch
from torch import nn

from mixprec._dtypes import HALF_DTYPES, finite_peak
from mixprec._errors import ArgumentError, check_module, shown
from mixprec._warn import warn_at_caller
from mixprec.casting import first_floating, upcast_16bit
from mixprec.levels import applied, upcast_note

__all__ = [
    "Recorder",
    "check_finite_batch",
    "float32_model",
    "float32_upcast",
    "relative_error",
    "to_json",
]


def float32_model(model: Any, who: str) -> nn.Module:
    """The float32 model behind ``model``: the module inside a ``torch.compile`` wrapper
    (the doctors' hooks run eagerly, with a warning); refused if already prepared."""
    check_module(who, model)
    module: nn.Module = model
    original = getattr(module, "_orig_mod", None)  # torch.compile's OptimizedModule
    if isinstance(original, nn.Module):
        warn_at_caller(  # diagnose may hand the model on to diagnose_float8: count frames
            f"{who} runs the model eagerly (its hooks do not compile): it uses the module "
            "inside torch.compile's wrapper; the figures are eager mode's"
        )
        module = original
    if applied(module) is not None:
        raise ArgumentError(f"{who} needs the float32 model, before auto_mixed_precision")
    return module


def float32_upcast(model: nn.Module, who: str) -> nn.Module:
    """``model`` if it holds no 16-bit parameter or buffer; else a copy with them stored in
    float32 (``casting.upcast_16bit``), said once at the user's line. The copy is a float32
    model holding the rounded values: the reference run and every copy the doctor prepares
    start from it, so the report is that float32 model's, and ``model`` is left as it is."""
    tensors = itertools.chain(model.parameters(), model.buffers())
    if not any(t.dtype in HALF_DTYPES for t in tensors):
        return model
    upcast = copy.deepcopy(model)
    what, dtypes, again = upcast_note(upcast_16bit(upcast))
    warn_at_caller(
        f"{who}: {what} of the model were {dtypes}; it diagnoses a float32 upcast copy (the "
        f"model itself is not modified): the precision lost when they were rounded to 16 bits "
        f"is not recovered{again}"
    )
    return upcast


def _floating(value: Any, where: str, every: bool = False) -> list[tuple[str, torch.Tensor]]:
    """The floating-point tensors in ``value`` (tuples, lists, dict values, dataclass fields,
    as the model's input cast walks them), each with where it sits: ``inputs``,
    ``inputs[1]``, ``inputs['mask']``, ``inputs.features``. ``every``: all tensors."""
    if isinstance(value, torch.Tensor):
        return [(where, value)] if every or value.is_floating_point() else []
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        fields = [(f.name, getattr(value, f.name, None)) for f in dataclasses.fields(value)]
        return [found for name, v in fields for found in _floating(v, f"{where}.{name}", every)]
    if isinstance(value, (tuple, list)):
        items: Any = enumerate(value)
    elif isinstance(value, Mapping):
        items = value.items()
    else:
        return []
    return [found for key, v in items for found in _floating(v, f"{where}[{key!r}]", every)]


def check_finite_batch(inputs: Any, targets: Any, who: str) -> None:
    """Refuse a batch whose inputs or floating-point targets hold inf/NaN: the float32
    reference is non-finite too, so every layer would look at risk and no precision plan
    can help."""
    floating = _floating(inputs, "inputs") + _floating(targets, "targets")
    tensors = _floating(inputs, "inputs", every=True) + _floating(targets, "targets", every=True)
    empty = next(((w, t) for w, t in tensors if t.numel() == 0), None)  # token ids too
    if empty is not None:  # its loss is NaN in every run: a report of nothing
        raise ArgumentError(
            f"{who}: the batch is empty: {empty[0]} has shape {tuple(empty[1].shape)}; pass a "
            "batch of at least one sample"
        )
    for where, tensor in floating:
        bad = int((~torch.isfinite(tensor.detach())).sum())
        if bad:
            raise ArgumentError(
                f"{who}: the batch itself is non-finite: {where} holds {bad} inf/NaN "
                f"value{'s' if bad > 1 else ''} (of {tensor.numel()}); the float32 run "
                "would be non-finite too, so no precision fixes it: clean or mask the data"
            )


def check_callable(who: str, name: str, value: Any, wanted: str) -> None:
    """Refuse ``value`` for ``name`` where it is not callable: a loss named by a string
    failed deep in the first pass ("'str' object is not callable"), after the copies."""
    if not callable(value) or isinstance(value, torch.optim.Optimizer):
        plain = value is None or isinstance(value, (str, int, float))
        got = shown(value) if plain else f"<a {type(value).__name__}>"
        raise ArgumentError(f"{who}({name}={got}) is invalid; valid: {wanted}")


def inputs_cast_to_inf(inputs: Any, dtype: torch.dtype) -> list[tuple[str, float]]:
    """The floating-point input tensors that a cast to ``dtype`` makes inf (O2 and O3 cast
    the inputs at the model's boundary, before any layer), each with where it sits and its
    largest |value|."""
    found = []
    for where, tensor in _floating(inputs, "inputs"):
        values = tensor.detach()
        if not bool(torch.isfinite(values.to(dtype)).all()):
            found.append((where, float(values.abs().max())))
    return found


def _bad(t: torch.Tensor) -> int:
    """The inf/NaN count of ``t`` (float8 read in float32: it has no ``isfinite``)."""
    values = t.detach()
    return int((~torch.isfinite(values.float() if values.element_size() == 1 else values)).sum())


def _count_call(entry: dict[str, Any], inp: torch.Tensor | None, out: torch.Tensor) -> None:
    """Add one call of a recorded module to what its entry says it reached."""
    out_bad = _bad(out)
    entry["peak_input"] = max(entry["peak_input"], 0.0 if inp is None else finite_peak(inp))
    entry["peak_output"] = max(entry["peak_output"], finite_peak(out))
    entry["nonfinite_out"] += out_bad
    if out_bad and not entry["origin"]:  # the input is read only then
        entry["origin"] = inp is None or _bad(inp) == 0

    def grad_hook(g: torch.Tensor) -> None:
        entry["peak_grad"] = max(entry["peak_grad"], finite_peak(g))
        entry["nonfinite_grad_all"] += _bad(g)

    if out.requires_grad:
        out.register_hook(grad_hook)


class Recorder:
    """Forward hooks on ``modules`` (name -> module): what each module's first call with a
    floating-point output sees, as a dict in ``calls`` (first-call order) with

    ``kind`` (the module's class name), ``order`` (its place in forward execution order),
    ``module``, ``input`` (its first floating-point argument, detached, or ``None``),
    ``input_needs_grad``, ``output`` (detached), and once the backward has run ``grad`` (the
    gradient of its output) and ``input_grad`` (of its input): ``None`` until then, and for
    tensors no gradient reaches.

    The tensors are the first call's: a module called twice (a shared block, a loop) is
    compared call for call between runs that way. Every call counts in what reaches a
    limit, so that an overflow in a later call is seen at its module:
    ``peak_input``/``peak_output``/``peak_grad`` (max finite |value| over the calls),
    ``nonfinite_out``/``nonfinite_grad_all`` (inf/NaN counts over the calls) and ``origin``
    (some call made a non-finite output from a finite input). Use as a context manager; the
    hooks are removed on exit, and the tensor hooks already registered fire in the
    backward after it.
    """

    def __init__(self, modules: Mapping[str, nn.Module]) -> None:
        self.calls: dict[str, dict[str, Any]] = {}
        self._handles = [m.register_forward_hook(self._hook(n)) for n, m in modules.items()]

    def _hook(self, name: str) -> Callable[..., None]:
        def hook(module: nn.Module, args: Any, output: Any) -> None:
            out = first_floating(output)
            if out is None:
                return
            inp = first_floating(args)
            if name in self.calls:  # a later call: what it reaches, not its tensors
                _count_call(self.calls[name], inp, out)
                return
            entry: dict[str, Any] = {
                "kind": type(module).__name__,
                "order": len(self.calls),
                "module": module,
                "input": None if inp is None else inp.detach(),
                "input_needs_grad": inp is not None and inp.requires_grad,
                "output": out.detach(),
                "grad": None,
                "input_grad": None,
                "peak_input": 0.0,
                "peak_output": 0.0,
                "peak_grad": 0.0,
                "nonfinite_out": 0,
                "nonfinite_grad_all": 0,
                "origin": False,
            }
            self.calls[name] = entry
            _count_call(entry, inp, out)
            if out.requires_grad:
                out.register_hook(lambda g: entry.__setitem__("grad", g.detach()))
            if inp is not None and inp.requires_grad:
                inp.register_hook(lambda g: entry.__setitem__("input_grad", g.detach()))

        return hook

    def remove(self) -> None:
        """Remove the forward hooks (what was recorded stays in ``calls``)."""
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def __enter__(self) -> Recorder:
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.remove()


def relative_error(value: torch.Tensor, reference: torch.Tensor) -> float:
    """``||value - reference|| / ||reference||``: how far ``value`` (a 16-bit or float8 run's
    tensor) is from ``reference`` (the float32 or bfloat16 run's), relative to the reference.

    Computed in float64: the difference of two float32, 16-bit or float8 values is exact
    there, and the sums of squares neither underflow (``1e-30`` squared is 0 in float32, which
    would make a tiny tensor's norm 0) nor overflow (values near float32's max).

    ``inf`` when the difference has an inf or NaN: a run that overflowed is not close to the
    other by any measure. When the reference is exactly zero the ratio has no finite value:
    a value that is zero too gives 0 (the runs agree exactly); a non-zero value gives
    ``inf``, the limit of the ratio as the reference shrinks. A layer whose output or
    gradient is all zero in the reference run and not in the compared one did not reproduce
    it at all; 0 would hide that, and a finite stand-in (1, say) would rank it below layers
    whose reference is merely small and whose error is larger."""
    diff = value.detach().double() - reference.detach().double()
    if not torch.isfinite(diff).all():
        return math.inf
    norm, off = float(reference.detach().double().norm()), float(diff.norm())
    if norm > 0:
        return off / norm
    return 0.0 if off == 0 else math.inf


def _json_safe(value: Any) -> Any:
    """JSON has no inf/NaN: they become strings ("inf", "nan")."""
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, dict):
        return {k: _json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_json_safe(v) for v in value]
    return value


def to_json(data: dict[str, Any], **kwargs: Any) -> str:
    """``data`` as JSON, with inf and NaN written as the strings ``"inf"`` and ``"nan"``."""
    return json.dumps(_json_safe(data), **kwargs)
