"""What mixprec notes on a prepared model's parameters (its policy and level, the dtype a
``to_float`` module computes in, an O3 weight that keeps a master), kept by the module as
well, so that it outlives the parameter objects.

``LossScaleOptimizer`` reads the notes to choose loss scaling and masters. torch makes new
``Parameter`` objects without them in ``copy.deepcopy`` (``Parameter.__deepcopy__`` copies
the data alone) and in ``load_state_dict(..., assign=True)``: a copy of a float16 model
would then train without loss scaling, and an O3 copy with float32 masters, with no word.
The ``TagKeeper`` on the module puts them back in both cases.
"""

from __future__ import annotations

import copy
from typing import Any

from torch import nn

__all__ = ["TAGS_ATTR", "TagKeeper", "refuse_prepared_parts", "tag"]

TAGS_ATTR = "_mixprec_tags"  # the TagKeeper of a module whose parameters were tagged


class TagKeeper:
    """The notes of a module's parameters, by parameter name (relative to the module)."""

    def __init__(self, module: nn.Module) -> None:
        self.module = module
        self.notes: dict[str, dict[str, Any]] = {}
        # Run with a copy and its parameters when the module is deep-copied (trace.py).
        self.on_copy: list[Any] = []

    def apply(self, module: nn.Module) -> None:
        """Put the notes back on ``module``'s parameters (those it still has)."""
        params = dict(module.named_parameters(remove_duplicate=False))
        for name, attrs in self.notes.items():
            if name in params:
                params[name].__dict__.update(attrs)

    def __deepcopy__(self, memo: dict[int, Any]) -> TagKeeper:
        # Called while the module is being copied: its copy (in memo) is still empty, so the
        # notes go onto the copies of the original's parameters, the very objects the copy's
        # own parameters will be (deepcopy's memo makes each once).
        new = TagKeeper(copy.deepcopy(self.module, memo))
        new.notes = {name: dict(attrs) for name, attrs in self.notes.items()}
        new.on_copy = list(self.on_copy)
        originals = dict(self.module.named_parameters(remove_duplicate=False))
        copies = {name: copy.deepcopy(p, memo) for name, p in originals.items()}
        for name, attrs in new.notes.items():
            if name in copies:
                copies[name].__dict__.update(attrs)
        for call in new.on_copy:
            call(new.module, list(copies.values()))
        return new


def tag(module: nn.Module, attrs: dict[str, Any]) -> None:
    """Set ``attrs`` on each of ``module``'s parameters, and keep them on the module."""
    keeper = keeper_of(module)
    for name, param in module.named_parameters(remove_duplicate=False):
        param.__dict__.update(attrs)
        keeper.notes.setdefault(name, {}).update(attrs)


def keeper_of(module: nn.Module) -> TagKeeper:
    """The module's ``TagKeeper``, made (and hooked to ``load_state_dict``) at first use."""
    keeper = module.__dict__.get(TAGS_ATTR)
    if not isinstance(keeper, TagKeeper):
        keeper = TagKeeper(module)
        object.__setattr__(module, TAGS_ATTR, keeper)
        module.register_load_state_dict_post_hook(_retag)
    return keeper


def _retag(module: nn.Module, incompatible_keys: Any) -> None:
    """After a load (``assign=True`` makes new parameters), the notes again."""
    keeper = module.__dict__.get(TAGS_ATTR)
    if isinstance(keeper, TagKeeper):
        keeper.apply(module)


def refuse_prepared_parts(model: nn.Module, applied_attr: str, policy_attr: str) -> None:
    """Refuse a model one of whose modules was prepared (it has ``applied_attr``), or whose
    parameters carry a prepared model's ``policy_attr`` tag (it is part of one): a second
    preparation mixed two policies' regions in one model, or left O2 weights in float32,
    said by nothing but a generic upcast warning."""
    inner = next(
        (n for n, m in model.named_modules() if m is not model and hasattr(m, applied_attr)),
        None,
    )
    if inner is None and not any(hasattr(p, policy_attr) for p in model.parameters()):
        return
    where = f"its module {inner!r} was" if inner else "its parameters belong to a model"
    raise RuntimeError(
        f"auto_mixed_precision(): {where} prepared already; prepare the whole model once, "
        "from float32 (keep_float32=, keep_bfloat16= or to_float set parts apart)"
    )
