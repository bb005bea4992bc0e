"""The float32 values a parameter had before ``auto_mixed_precision`` stored it in 16 bits,
kept on the parameter until its optimizer takes them as the master's starting values (or
``to_float``/``upcast_16bit`` takes them back), so that no master starts from rounded values.
A float32 value loaded into a 16-bit parameter (``model.load_state_dict`` of a float32
checkpoint) is kept the same way (``keep_float32_on_load``).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
from torch import nn
from torch.utils.weak import WeakIdKeyDictionary

from mixprec._dist import is_dtensor
from mixprec._dtypes import HALF_DTYPES
from mixprec._errors import check_module
from mixprec._param_tags import add_load_pre_hook
from mixprec._warn import warn_at_caller

__all__ = [
    "FP32_COPY_ATTR",
    "LOADED_AT",
    "current_float32_copy",
    "keep_float32_on_load",
    "keep_loaded_float32",
    "release_float32_copies",
    "remember_float32",
    "say_if_frozen_copies",
    "take_float32_copy",
]

FP32_COPY_ATTR = "_mixprec_fp32"  # Float32Copy of a parameter stored in 16 bits
# A 16-bit weight's version right after the last load into it: a master that died after a
# load (its optimizer in a reference cycle, collected later) left no roundings of its own.
LOADED_AT: WeakIdKeyDictionary = WeakIdKeyDictionary()


@dataclasses.dataclass
class Float32Copy:
    """The float32 values of a parameter before it went to 16 bits. Current while the
    parameter still rounds from them (``current_float32_copy``)."""

    values: torch.Tensor
    carried: bool = False  # by a deep copy of the model (dropped once the copy is stale)


def take_float32_copy(param: torch.Tensor) -> torch.Tensor | None:
    """Remove and return the float32 values kept for ``param`` if they are still current."""
    values = current_float32_copy(param)
    param.__dict__.pop(FP32_COPY_ATTR, None)
    # A copy: the kept values are a detached view of the float32 parameter as it was, which
    # shares the parameter's version counter; a master sharing it would make every write
    # to the master look like an external write to the weight.
    return None if values is None else values.clone()


def current_float32_copy(param: torch.Tensor) -> torch.Tensor | None:
    """The float32 values kept for ``param`` (left in place) if they are still current."""
    kept = param.__dict__.get(FP32_COPY_ATTR)
    if not isinstance(kept, Float32Copy):
        return None
    # Whether the copy still rounds to the weight decides, not the version counter: a write
    # through ``param.data`` (Hugging Face's weight init) leaves the version as it was, and
    # a load of the weight's own 16-bit values (``model.load_state_dict(model.state_dict())``,
    # a resume) changes it and nothing else. Once, not per step.
    values = kept.values.to(param.device)  # the model may have moved since
    return values if torch.equal(values.to(param.dtype), param.detach()) else None


def remember_float32(param: torch.Tensor, values: torch.Tensor, carried: bool = False) -> None:
    """Keep ``values`` (float32) as the current float32 copy of the 16-bit ``param``;
    ``carried``: by a deep copy of the model, from its original."""
    record = Float32Copy(values.detach().float(), carried)
    setattr(param, FP32_COPY_ATTR, record)


def release_float32_copies(model: torch.nn.Module) -> int:
    """Drop the float32 values kept on ``model``'s 16-bit parameters, and return how many
    bytes they held.

    O2 keeps them until a ``LossScaleOptimizer`` starts its masters from them; a model used
    only for inference keeps them for good: 4 bytes a parameter beside the 2 of its 16-bit
    weight, more than the float32 model took. After this, a save with no optimizer writes
    the 16-bit values, and masters built later start from them."""
    check_module("release_float32_copies", model)  # None raised a bare AttributeError
    released = 0
    for param in model.parameters():
        kept = param.__dict__.pop(FP32_COPY_ATTR, None)
        if isinstance(kept, Float32Copy):
            released += kept.values.numel() * kept.values.element_size()
    return released


def say_if_frozen_copies(models: list[nn.Module]) -> None:
    """At the first step: the float32 values still kept on a model's frozen 16-bit weights
    (``requires_grad`` off: a backbone, an adapter's base), which no optimizer takes yet,
    kept so that a save writes them exactly and a weight unfrozen later (gradual
    unfreezing, ``add_param_group``) starts its master from them. A backbone frozen for good
    (8 layers) took 1.5 times its float32 model's weight memory where 0.5 was meant,
    unsaid; releasing them, as advised alone before, made a weight unfrozen later start from
    its 16-bit rounding. Said once a model, at 1 MiB and more."""
    for model in models:
        if model.__dict__.get(_SAID):
            continue
        model.__dict__[_SAID] = True
        # Frozen alone: a weight that trains and has no optimizer yet (Fabric wraps each
        # at its own first step) takes its values when one is built.
        kept = [p.__dict__.get(FP32_COPY_ATTR) for p in model.parameters() if not p.requires_grad]
        copies = [k.values for k in kept if isinstance(k, Float32Copy)]
        held = sum(v.numel() * v.element_size() for v in copies)
        if held >= 2**20:
            warn_at_caller(
                f"{len(copies)} 16-bit weights no LossScaleOptimizer holds (frozen: a "
                "backbone, an adapter's base) keep their float32 values beside them, "
                f"{held / 2**20:.1f} MiB more: a save writes them exactly, and a weight "
                "unfrozen later (add_param_group) starts its master from them. If these "
                "weights stay frozen, they take 1.5 times their float32 memory for good: "
                "mp.release_float32_copies(model) frees them (a save then writes their "
                "16-bit values, and a weight unfrozen later starts its master from its "
                "16-bit rounding)"
            )


_SAID = "_mixprec_said_frozen_copies"
_HOOKED = "_mixprec_keeps_float32_on_load"
_LOADING = "_mixprec_float32_loading"


def keep_float32_on_load(module: nn.Module) -> None:
    """Hook ``module``'s ``load_state_dict`` (once): a float32 value loaded into one of its
    own 16-bit parameters is kept as that parameter's float32 copy, so that its master
    starts from it, or follows the load with it (``follow_external_writes``), rather than
    from the rounded weight. The hooks are module-level functions: the module still
    pickles and deep-copies."""
    if module.__dict__.get(_HOOKED):
        return
    module.__dict__[_HOOKED] = True
    add_load_pre_hook(module, _note_float32_values)
    module.register_load_state_dict_post_hook(_keep_noted_values)


def keep_loaded_float32(param: torch.Tensor, value: Any) -> None:
    """After a load wrote ``param``: keep ``value`` as its float32 copy where ``param`` is
    16-bit and ``value`` a float32 tensor of its shape (a checkpoint's master, pretrained
    float32 weights), where it lies (host memory, mostly: ``current_float32_copy`` moves it
    when a master is made from it, and uses it only where it rounds to the weight)."""
    if _fits(param, value):
        remember_float32(param, value)


def _fits(param: torch.Tensor | None, value: Any) -> bool:
    return (
        param is not None
        and param.dtype in HALF_DTYPES
        and isinstance(value, torch.Tensor)
        and value.dtype == torch.float32
        and value.shape == param.shape
        and not is_dtensor(param)
        and not is_dtensor(value)
    )


def _note_float32_values(
    module: nn.Module, state_dict: dict[str, Any], prefix: str, *_: Any
) -> None:
    """Before the copy: the float32 values the load brings for the module's own 16-bit
    parameters."""
    noted = {
        name: state_dict[prefix + name]
        for name, param in module._parameters.items()
        if _fits(param, state_dict.get(prefix + name))
    }
    if noted:
        module.__dict__[_LOADING] = noted


def _keep_noted_values(module: nn.Module, incompatible_keys: Any) -> None:
    """After the copy into the weights (whose versions it changed): a copy kept now is
    current; each weight's version now is noted (``LOADED_AT``)."""
    for param in module._parameters.values():
        if param is not None:
            LOADED_AT[param] = param._version
    for name, value in module.__dict__.pop(_LOADING, {}).items():
        param = module._parameters.get(name)
        if param is not None:
            keep_loaded_float32(param, value)
