"""What a prepared model computes in and stores, module by module: ``describe(model)``.

``module_dtypes`` gives the rows as values (the doctor and the tests read them); ``describe``
prints them as a table headed by the policy and level ``auto_mixed_precision`` applied.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from torch.nn.utils import parametrize

from mixprec._dtypes import dtype_name
from mixprec._errors import check_module
from mixprec._module_kinds import MIXED_NORM_MODULES
from mixprec.float8 import float8_choice, layer_counts
from mixprec.keep import ROOT_NAME
from mixprec.levels import applied
from mixprec.region import get_region

__all__ = ["ModuleDtypes", "describe", "module_dtypes"]


@dataclass(frozen=True)
class ModuleDtypes:
    """One row of ``describe``: a module's compute dtype and how its own weights are stored."""

    name: str
    kind: str
    compute: str
    storage: str
    region: bool
    #: What the dtypes alone do not say (batch/layer norm in 16-bit compute), or "".
    note: str = ""


# Not "16-bit in and out": a norm first in an O1 model, or after a softmax, gets float32 in
# and gives float32 out; the note holds whatever the input.
_NORM_NOTE = (
    "output in its input's dtype (16-bit after a 16-bit layer); float32 weights and statistics"
)


def module_dtypes(model: nn.Module) -> list[ModuleDtypes]:
    """Every module of ``model`` with the dtype it computes in and its parameters' dtypes."""
    check_module("module_dtypes", model)
    rows: list[ModuleDtypes] = []

    def walk(module: nn.Module, name: str, compute: torch.dtype) -> None:
        region = get_region(module)
        if region is not None:
            compute = region.compute_dtype
        params = list(module.parameters(recurse=False))
        if parametrize.is_parametrized(module):  # weight_norm & co: its weight is a child's
            params += module.parametrizations.parameters()  # type: ignore[union-attr,operator]
        dtypes = sorted({dtype_name(p.dtype) for p in params})
        # Batch and layer norm kernels take 16-bit input with float32 weights and keep their
        # arithmetic and running statistics in float32: "float16" alone would mislead.
        mixed_norm = (
            isinstance(module, MIXED_NORM_MODULES)
            and compute != torch.float32
            and dtypes == ["float32"]
        )
        # Float8 policies: a converted Linear's matmuls run in float8 (its region is bfloat16,
        # the dtype around them); every Linear considered says why it was or was not converted.
        choice = float8_choice(module)
        rows.append(
            ModuleDtypes(
                name=name or ROOT_NAME,
                kind=type(module).__name__,
                compute=choice.compute if choice and choice.converted else dtype_name(compute),
                storage=",".join(dtypes) if dtypes else "-",
                region=region is not None,
                note=choice.reason if choice else _NORM_NOTE if mixed_norm else "",
            )
        )
        for child_name, child in module.named_children():
            walk(child, f"{name}.{child_name}" if name else child_name, compute)

    walk(model, "", torch.float32)
    return rows


def describe(model: nn.Module) -> str:
    """A table of every module's compute dtype and storage dtype.

    ``*`` marks the modules where the compute dtype is set (casts happen at their boundary).
    A ``note`` column appears when a row needs one (batch and layer norm under 16-bit
    compute keep float32 weights and statistics).
    """
    check_module("describe", model)
    rows = module_dtypes(model)
    notes = any(r.note for r in rows)
    header: tuple[str, ...] = ("module", "type", "compute", "storage") + (
        ("note",) if notes else ()
    )
    table = [header] + [
        (r.name + (" *" if r.region else ""), r.kind, r.compute, r.storage)
        + ((r.note,) if notes else ())
        for r in rows
    ]
    widths = [max(len(row[i]) for row in table) for i in range(len(header))]
    lines = [
        "  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip()
        for row in table
    ]
    lines.insert(1, "  ".join("-" * w for w in widths))
    state = applied(model)
    if state is not None:
        masters = " (MindSpore's: float32 master weights)" if state.o3_masters else ""
        converted, considered = layer_counts(model)
        float8 = (
            f"; float8 ({state.policy.float8_recipe}) in {converted} of {considered} Linear layers"
            if state.policy.float8_recipe is not None
            else ""
        )
        lines.insert(0, f"policy {state.policy.name}, level {state.level}{masters}{float8}")
    return "\n".join(lines)
