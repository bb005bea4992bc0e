"""What ``autotune`` measures per layer: the float32 reference pass (the doctor's
``Recorder``), each layer alone in each candidate dtype (time and relative error against the
layer alone in float32), and its range against float16's.

Errors are the doctor's ``relative_error`` (``||x - ref|| / ||ref||`` in float64). A layer's
own error is the largest of its output's, its input gradient's and its weight gradient's (all
its parameters' gradients as one vector) when it runs alone on the float32 pass's input with
the float32 pass's output gradient: what the dtype does to that layer, not what other layers
did to its input or gradient. In the whole model the errors compound (a bfloat16 MLP's
first-layer gradients differ from float32's by ~5%, each layer's own by ~0.3%); their effect
on training is what the training check measures (``check``).

As one vector, because a bias whose float32 gradient is ~0 (a convolution before batch norm)
has an unbounded relative error of its own that no update feels.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from mixprec._calling import call
from mixprec.casting import cast_floating, first_floating
from mixprec.doctor import Recorder, relative_error
from mixprec.doctor.passes import max_abs
from mixprec.float8 import Float8Options, convert_to_float8

__all__ = ["LayerData", "isolated_run", "layer_error", "reference_pass"]

#: float16's largest finite value: a layer's ``headroom`` is its peak |value| over this.
FLOAT16_MAX = float(torch.finfo(torch.float16).max)

Loss = Callable[[Any, Any], torch.Tensor]


@dataclass
class LayerData:
    """One layer's float32 reference (the module, its arguments, its output's gradient) and
    what was measured of it per candidate dtype."""

    name: str
    module: nn.Module
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    grad: torch.Tensor | None
    headroom: float
    times: dict[str, float] = field(default_factory=dict)
    errors: dict[str, float] = field(default_factory=dict)

    @property
    def kind(self) -> str:
        return type(self.module).__name__

    @property
    def size(self) -> int:
        return sum(p.numel() for p in self.module.parameters())


def _detached(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.detach()
    if isinstance(value, (tuple, list)):
        return type(value)(_detached(v) for v in value)
    if isinstance(value, dict):
        return {k: _detached(v) for k, v in value.items()}
    return value


def reference_pass(
    model: nn.Module, inputs: Any, targets: Any, loss_fn: Loss, names: list[str]
) -> dict[str, LayerData]:
    """One float32 forward and backward of a copy of ``model``: each named layer's
    arguments (a pre-hook keeps them all, as a re-run needs; the ``Recorder`` keeps its
    first floating one), output gradient and float16 range."""
    ref = copy.deepcopy(model)
    named = dict(ref.named_modules())
    arguments: dict[str, tuple[tuple[Any, ...], dict[str, Any]]] = {}

    def keep(name: str) -> Callable[..., None]:
        def hook(module: nn.Module, args: Any, kwargs: Any) -> None:
            arguments.setdefault(name, (_detached(args), _detached(kwargs)))

        return hook

    handles = [named[n].register_forward_pre_hook(keep(n), with_kwargs=True) for n in names]
    try:
        with Recorder({n: named[n] for n in names}) as recorder:
            loss = loss_fn(call(ref, inputs), targets)
            loss.backward()
    finally:
        for handle in handles:
            handle.remove()
    layers = {}
    for name in names:
        calls = recorder.calls.get(name)
        if calls is None or name not in arguments:
            continue  # the layer did not run on this batch: it keeps the level's dtype
        peak = max(max_abs(calls["input"]), max_abs(calls["output"]), max_abs(calls["grad"]))
        args, kwargs = arguments[name]
        layers[name] = LayerData(name, named[name], args, kwargs, calls["grad"], peak / FLOAT16_MAX)
    return layers


def _prepared(module: nn.Module, dtype: str) -> tuple[nn.Module, torch.dtype]:
    """A copy of ``module`` that computes in ``dtype``, and the dtype its inputs get: 16-bit
    weights as O2 stores them, or torchao's float8 Linear in its bfloat16 region."""
    layer = copy.deepcopy(module)
    if dtype == "float8":
        wrapper = nn.Sequential(layer)
        convert_to_float8(
            wrapper, "tensorwise", policy_name="mixed_float8", float32=set(), bfloat16=set(),
            options=Float8Options(min_features=1, keep_head=False),
        )  # fmt: skip
        return wrapper, torch.float32  # its region casts the input
    target = getattr(torch, dtype)
    return layer.to(target), target


def isolated_run(data: LayerData, dtype: str) -> Callable[[], list[torch.Tensor | None]]:
    """A call that runs the layer alone in ``dtype`` on its reference input, forward and
    backward with the reference output gradient, and returns [output, input gradient,
    weight gradients as one vector] for ``layer_error``."""
    layer, target = _prepared(data.module, dtype)
    params = list(layer.parameters())

    def run() -> list[torch.Tensor | None]:
        for p in params:
            p.grad = None
        given, kwargs = cast_floating((data.args, data.kwargs), target)
        args, first = list(given), None
        for i, a in enumerate(args):  # the gradient of the first floating argument
            if isinstance(a, torch.Tensor) and a.is_floating_point():
                args[i] = first = a.detach().requires_grad_(True)
                break
        out = first_floating(layer(*args, **kwargs))
        if out is not None and out.requires_grad and data.grad is not None:
            out.backward(data.grad.to(out.dtype))
        grad_in = None if first is None else first.grad
        grads = [p.grad.reshape(-1).double() for p in params if p.grad is not None]
        return [out, grad_in, torch.cat(grads) if grads else None]

    return run


def layer_error(result: list[torch.Tensor | None], reference: list[torch.Tensor | None]) -> float:
    """The largest relative error of a layer's output, input gradient and weight gradient
    against its float32 run (tensors one of them lacks are skipped)."""
    errors = [
        relative_error(a, b)
        for a, b in zip(result, reference, strict=True)
        if a is not None and b is not None and a.shape == b.shape
    ]
    return max(errors, default=0.0)
