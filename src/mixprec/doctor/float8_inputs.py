"""What ``diagnose_float8`` is given, checked and written back: the batch's tensors, the
loss it must return, a batch the float32 model fails on too, and the keep settings and
level as the advice's call writes them (so that following it trains what was diagnosed)."""

from __future__ import annotations

import copy
from typing import Any

import torch
from torch import nn

from mixprec._calling import call
from mixprec._dtypes import dtype_name
from mixprec._errors import ArgumentError
from mixprec.keep import ROOT_NAME, KeepEntry, kept_modules

__all__ = [
    "batch_tensors",
    "check_float32_runs",
    "keep_names",
    "keep_with",
    "scalar_loss",
    "settings_text",
]


def batch_tensors(value: Any, where: str) -> list[tuple[str, torch.Tensor]]:
    """The tensors in ``value`` (tuples, lists, dict values), each with where it sits."""
    if not isinstance(value, (tuple, list, dict)):
        return [(where, value)] if isinstance(value, torch.Tensor) else []
    items = value.items() if isinstance(value, dict) else enumerate(value)
    return [found for k, v in items for found in batch_tensors(v, f"{where}[{k!r}]")]


def scalar_loss(loss: Any) -> torch.Tensor:
    """``loss`` if it is a floating-point tensor of one value, which backward needs."""
    if isinstance(loss, torch.Tensor) and loss.is_floating_point() and loss.numel() == 1:
        return loss
    got = type(loss).__name__
    if isinstance(loss, torch.Tensor):
        got = f"a tensor of shape {tuple(loss.shape)}, dtype {dtype_name(loss.dtype)}"
    raise ArgumentError(
        f"diagnose_float8: loss_fn returned {got}; it must return a floating-point tensor of "
        "one value (reduce it: reduction='mean', or .mean())"
    )


def check_float32_runs(model: nn.Module, inputs: Any, targets: Any, loss_fn: Any) -> None:
    """Refuse a batch a copy of the float32 ``model`` fails on too (wrong width), naming its
    shapes, the innermost module running then (or ``loss_fn``) and torch's reason. Where the
    copy runs, the failure was float8's: the caller re-raises it."""
    reference, running = copy.deepcopy(model), list[str]()  # the modules entered, not left
    for name, module in reference.named_modules():
        where = f"{name or '(model)'!r} ({type(module).__name__})"
        module.register_forward_pre_hook(lambda m, a, where=where: running.append(where))
        # __delitem__ returns None, so the hook leaves the module's output as it is.
        module.register_forward_hook(lambda m, a, o: running.__delitem__(-1))
    try:
        with torch.no_grad():
            loss_fn(call(reference, inputs), targets)
    except Exception as err:
        batch = batch_tensors(inputs, "inputs") + batch_tensors(targets, "targets")
        shapes = ", ".join(f"{where} {tuple(t.shape)}" for where, t in batch)
        first = (str(err).strip().splitlines() or [type(err).__name__])[0]
        raise ArgumentError(
            f"diagnose_float8: the batch ({shapes}) does not fit the model: the float32 model "
            f"fails on it too, in {running[-1] if running else 'loss_fn'}: {first}"
        ) from err


def keep_names(model: nn.Module, entries: tuple[KeepEntry, ...], argument: str) -> list[str]:
    """Keep entries as the advice writes them: a name pattern as given, a module type or a
    module as the names of the modules it matches."""
    names: list[str] = []
    for entry in entries:
        found = [entry] if isinstance(entry, str) else sorted(
            name or ROOT_NAME for name in kept_modules(model, [entry], argument)
        )  # fmt: skip
        names += [n for n in found if n not in names]
    return names


def keep_with(given: list[str], hurt: list[str]) -> list[str]:
    """The ``keep_bfloat16`` to train with: what the diagnosis ran with (else following the
    advice would put those layers in float8), then the layers float8 hurts."""
    return given + [n for n in hurt if n not in given]


def settings_text(level: str, resolved: str, keep_float32: list[str]) -> str:
    """The diagnosed ``level`` and ``keep_float32`` as arguments of the advice's call: left
    out, following it would train another configuration (O2 for O1, float8 for float32)."""
    text = f", level={resolved!r}" if level != "auto" else ""
    return text + (f", keep_float32={keep_float32!r}" if keep_float32 else "")
