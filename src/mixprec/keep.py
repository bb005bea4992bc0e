"""``keep_float32``-style arguments: module types, name patterns or modules, resolved to the
named modules of a model they stand for (``auto_mixed_precision``'s ``keep_float32`` and
``keep_bfloat16``, the doctors' keep lists)."""

from __future__ import annotations

import fnmatch
import re
from collections.abc import Iterable

import torch
from torch import nn

from mixprec._dtypes import closest
from mixprec._errors import ArgumentError

__all__ = [
    "KeepEntry",
    "declared_float32",
    "inside",
    "keep_list",
    "kept_modules",
    "named_modules",
]

KeepEntry = type[nn.Module] | str | nn.Module


#: The model itself in a keep list, as the doctor names it (``named_modules`` calls it "").
ROOT_NAME = "(model)"


def named_modules(model: nn.Module) -> dict[str, nn.Module]:
    """``model``'s modules by the names a keep list and the doctor use (the model itself
    as ``ROOT_NAME``)."""
    return {name or ROOT_NAME: m for name, m in model.named_modules()}


def keep_list(
    entries: KeepEntry | Iterable[KeepEntry], argument: str = "keep_float32"
) -> tuple[KeepEntry, ...]:
    """``keep_float32``-style arguments as a tuple: one entry may be given alone."""
    if isinstance(entries, (str, nn.Module, type)):
        return (entries,)
    if not isinstance(entries, Iterable):
        raise ArgumentError(
            f"{argument}={entries!r} is invalid; valid: a module type, a name pattern, a "
            "module of the model, or a list of them (() for none)"
        )
    return tuple(entries)


def kept_modules(
    model: nn.Module, keep_float32: Iterable[KeepEntry], argument: str = "keep_float32"
) -> dict[str, nn.Module]:
    """Resolve ``keep_float32`` entries (types, name patterns, modules) to named modules."""
    keep_float32 = keep_list(keep_float32, argument)
    # Every name of a module used twice (model.enc = blocks[0]), as describe lists them.
    named = dict(model.named_modules(remove_duplicate=False))
    kept: dict[str, nn.Module] = {}
    for entry in keep_float32:
        if isinstance(entry, type) and issubclass(entry, nn.Module):
            kept.update((n, m) for n, m in named.items() if isinstance(m, entry))
        elif entry == ROOT_NAME:  # the doctor's name for the model itself
            kept[""] = model
        elif isinstance(entry, str):
            # The model itself is "" in named_modules: only ROOT_NAME names it, so that an
            # empty entry (an unset setting) cannot keep the whole model in float32.
            hits = {
                n: m
                for n, m in named.items()
                if n and (n == entry or fnmatch.fnmatchcase(n, entry))
            }
            if not hits:
                hint = closest(entry, [n for n in named if n])
                raise ArgumentError(
                    f"{argument} entry {entry!r} matches no module name of the model"
                    + (f"; closest: {hint!r}" if hint else "")
                )
            kept.update(hits)
        elif isinstance(entry, nn.Module):
            name = next((n for n, m in named.items() if m is entry), None)
            if name is None:
                raise ArgumentError(
                    f"{argument} entry {type(entry).__name__} module is not part of the model"
                )
            kept[name] = entry
        else:
            raise ArgumentError(
                f"{argument} entries must be nn.Module subclasses, name patterns (str) or "
                f"modules; got {type(entry).__name__}: {entry!r}"
            )
    return kept


def inside(modules: Iterable[nn.Module]) -> set[int]:
    """Ids of the given modules and all their descendants."""
    return {id(sub) for m in modules for sub in m.modules()}


def declared_float32(model: nn.Module, compute: torch.dtype) -> list[nn.Module]:
    """The modules a Hugging Face model declares float32 for this compute dtype, as its own
    loading keeps them: ``_keep_in_fp32_modules`` under float16 (T5's ``wo``, whose float16
    output overflows), ``_keep_in_fp32_modules_strict`` under either 16-bit dtype. Named
    by components of a module's name, or of a parameter's or buffer's (its module kept).
    Before, they computed in 16 bits, unsaid."""
    names: set[str] = set()
    if compute == torch.float16:
        names.update(getattr(model, "_keep_in_fp32_modules", None) or ())
    if compute in (torch.float16, torch.bfloat16):
        names.update(getattr(model, "_keep_in_fp32_modules_strict", None) or ())
    if not names:
        return []
    pattern = re.compile(r"(^|\.)(" + "|".join(map(re.escape, sorted(names))) + r")($|\.)")
    modules = dict(model.named_modules())
    found = {n for n in modules if n and pattern.search(n)}
    # Entries naming a parameter or buffer ("gate.weight", "e_score_correction_bias"):
    # its module is kept, as keep_float32 keeps modules.
    tensors = [*model.named_parameters(), *model.named_buffers()]
    found.update(n.rpartition(".")[0] for n, _ in tensors if pattern.search(n))
    return [modules[n] for n in sorted(found) if n]
