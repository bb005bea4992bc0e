"""What mixprec notes on a prepared model's parameters (its policy and level, the dtype a
``to_float`` module computes in, an O3 weight that keeps a master), kept by the module as
well, so that it outlives the parameter objects.

``LossScaleOptimizer`` reads the notes to choose loss scaling and masters. torch makes new
``Parameter`` objects without them in ``copy.deepcopy`` (``Parameter.__deepcopy__`` copies
the data alone) and in ``load_state_dict(..., assign=True)``: a copy of a float16 model
would then train without loss scaling, and an O3 copy with float32 masters, with no word.
The ``TagKeeper`` on the module puts them back in both cases.

``assign=True`` does more than drop the notes: float32 values given that way replace O2's
16-bit weights, and the model then trains as O1 (twice the weight memory), unsaid. The
keeper notes the parameters' dtypes before a load and says when one changed. (An optimizer
built before holds the old parameters: its first step says so, having no gradients.)
"""

from __future__ import annotations

import copy
import functools
import threading
import weakref
from typing import Any

import torch
from torch import nn

from mixprec._warn import warn_at_caller

__all__ = [
    "TAGS_ATTR",
    "TagKeeper",
    "add_load_pre_hook",
    "keep_notes_through_to_empty",
    "refuse_prepared_parts",
    "tag",
    "unpickled_keepers",
]

TAGS_ATTR = "_mixprec_tags"  # the TagKeeper of a module whose parameters were tagged

# A parameter a load replaced: its name, the old dtype and the new one.
Replaced = tuple[str, torch.dtype, torch.dtype]


class TagKeeper:
    """The notes of a module's parameters, by parameter name (relative to the module)."""

    def __init__(self, module: nn.Module) -> None:
        self.module = module
        self.notes: dict[str, dict[str, Any]] = {}
        # During a load: the parameter objects before it, and their dtypes, by name, so a
        # load that replaced them (assign=True) is told apart from one that wrote into them.
        self.held: dict[str, tuple[weakref.ref[nn.Parameter], torch.dtype]] = {}
        self.watch_loads = False  # the whole prepared model's keeper says replacements
        # Run with a copy and its parameters when the module is deep-copied (trace.py).
        self.on_copy: list[Any] = []
        # Run with the module when its parameters are made anew (to_empty): the
        # registries its parameters are known by (trace.py), not what a copy notes.
        self.on_rebuild: list[Any] = []
        self.on_load: list[Any] = []  # run with the module after each load into it

    def apply(self, module: nn.Module) -> None:
        """Put the notes back on ``module``'s parameters (those it still has)."""
        params = dict(module.named_parameters(remove_duplicate=False))
        for name, attrs in self.notes.items():
            if name in params:
                params[name].__dict__.update(attrs)

    def hold(self, module: nn.Module) -> None:
        self.held = {
            name: (weakref.ref(p), p.dtype)
            for name, p in module.named_parameters(remove_duplicate=False)
        }

    def replaced(self, module: nn.Module) -> list[Replaced]:
        """Each parameter that is no longer the object held before the load."""
        out = []
        for name, new in module.named_parameters(remove_duplicate=False):
            ref_dtype = self.held.get(name)
            if ref_dtype is not None and ref_dtype[0]() is not new:
                out.append((name, ref_dtype[1], new.dtype))
        return out

    def __setstate__(self, state: dict[str, Any]) -> None:
        # Unpickled (torch.load of a whole model): its module is not whole yet, so the
        # on_copy calls wait until something asks (``unpickled_keepers``).
        self.__dict__.update(state)
        with _TAKING:
            if len(_UNPICKLED) >= 64:  # models loaded for inference alone are never asked for
                _UNPICKLED[:] = [ref for ref in _UNPICKLED if ref() is not None]
            _UNPICKLED.append(weakref.ref(self))

    def __deepcopy__(self, memo: dict[int, Any]) -> TagKeeper:
        # Called while the module is being copied: its copy (in memo) is still empty, so the
        # notes go onto the copies of the original's parameters, the very objects the copy's
        # own parameters will be (deepcopy's memo makes each once).
        new = TagKeeper(copy.deepcopy(self.module, memo))
        new.notes = {name: dict(attrs) for name, attrs in self.notes.items()}
        new.on_copy = list(self.on_copy)
        new.on_rebuild = list(getattr(self, "on_rebuild", []))
        new.on_load = list(getattr(self, "on_load", []))
        new.watch_loads = self.watch_loads
        originals = dict(self.module.named_parameters(remove_duplicate=False))
        copies = {name: copy.deepcopy(p, memo) for name, p in originals.items()}
        for name, attrs in new.notes.items():
            if name in copies:
                copies[name].__dict__.update(attrs)
        for name, original in originals.items():
            for carry in _CARRIED:
                carry(original, copies[name])
        for call in new.on_copy:
            call(new.module, list(copies.values()))
        return new


# Called with (parameter, its deep copy) for each parameter of a copied module: what is
# known of a parameter outside its notes (the float32 values it stands for: _live_masters).
_CARRIED: list[Any] = []


def carry_on_copy(call: Any) -> None:
    """Run ``call(parameter, copy)`` for each parameter of a prepared module deep-copied."""
    _CARRIED.append(call)


# TagKeepers unpickled since the last ``unpickled_keepers()``, weakly; taken under a lock
# (reentrant: an on_copy call may ask again), as another thread may be unpickling.
_UNPICKLED: list[weakref.ref[TagKeeper]] = []
_TAKING = threading.RLock()


def unpickled_keepers() -> None:
    """Run the ``on_copy`` calls of the keepers unpickled since the last call, with their
    now whole modules: the registries a prepared model's parameters are known by (its
    model, for adapters added later; trace.py) are filled again, as for a deep copy. The
    notes go back on the parameters first: torch.multiprocessing rebuilds a parameter
    without its ``__dict__`` (a model given to ``spawn``, a ``Pool``, a ``Queue``), and a
    float16 O1 child took itself for float32 and did no loss scaling, unsaid.

    A keeper whose module is not whole yet (a ``torch.load`` in another thread, half way)
    waits for the next call: taken, it raised AttributeError '_parameters' in an unrelated
    optimizer's step, and its registration was lost."""
    if not _UNPICKLED:
        return
    with _TAKING:
        waiting = []
        while _UNPICKLED:
            keeper = _UNPICKLED.pop()()
            if keeper is None:
                continue
            if "_parameters" not in keeper.module.__dict__:  # its __setstate__ not run yet
                waiting.append(weakref.ref(keeper))
                continue
            keeper.apply(keeper.module)
            params = list(keeper.module.parameters())
            for call in keeper.on_copy:
                call(keeper.module, params)
        _UNPICKLED.extend(waiting)


def tag(module: nn.Module, attrs: dict[str, Any], watch_loads: bool = False) -> None:
    """Set ``attrs`` on each of ``module``'s parameters, and keep them on the module;
    ``watch_loads``: say when a load replaces them (the prepared model's own keeper)."""
    keeper = keeper_of(module)
    keeper.watch_loads |= watch_loads
    params = dict(module.named_parameters(remove_duplicate=False))
    for name, param in params.items():
        param.__dict__.update(attrs)
        keeper.notes.setdefault(name, {}).update(attrs)


def keeper_of(module: nn.Module) -> TagKeeper:
    """The module's ``TagKeeper``, made (and hooked to ``load_state_dict``) at first use."""
    keeper = module.__dict__.get(TAGS_ATTR)
    if not isinstance(keeper, TagKeeper):
        keeper = TagKeeper(module)
        object.__setattr__(module, TAGS_ATTR, keeper)
        add_load_pre_hook(module, _hold)
        module.register_load_state_dict_post_hook(_retag)
    return keeper


def add_load_pre_hook(module: nn.Module, hook: Any) -> None:
    """``hook(module, state_dict, prefix, ...)`` before ``module`` loads a state dict."""
    public = getattr(module, "register_load_state_dict_pre_hook", None)
    if public is not None:
        public(hook)
    else:  # torch 2.4: the private form, with the module passed first as well
        module._register_load_state_dict_pre_hook(hook, with_module=True)


def _hold(module: nn.Module, *_: Any) -> None:
    keeper = module.__dict__.get(TAGS_ATTR)
    if isinstance(keeper, TagKeeper) and keeper.watch_loads:
        keeper.hold(module)


def _retag(module: nn.Module, incompatible_keys: Any) -> None:
    """After a load (``assign=True`` makes new parameters), the notes again."""
    keeper = module.__dict__.get(TAGS_ATTR)
    if isinstance(keeper, TagKeeper):
        replaced = keeper.replaced(module)
        keeper.held = {}
        if replaced:
            _say_replaced(replaced)
        keeper.apply(module)
        for call in getattr(keeper, "on_load", []):
            call(module)


def _say_replaced(replaced: list[Replaced]) -> None:
    """A load that made new parameters (``assign=True``) on a prepared model, of another
    dtype (float32 values in place of O2's 16-bit weights: O1's memory, unsaid). Whether
    an old parameter is still alive says nothing: a forward's graph holds it too."""
    changed = [(name, was, now) for name, was, now in replaced if was != now]
    if not changed:
        return
    name, was, now = changed[0]
    warn_at_caller(
        f"load_state_dict(assign=True) replaced {len(replaced)} parameters of a model "
        f"prepared by mixprec, and {len(changed)} changed dtype ({name!r}: {_short(was)} "
        f"-> {_short(now)}): the model no longer stores its weights as it was prepared to. "
        "Load without assign=True (the values are copied into the prepared weights, and "
        "their float32 masters follow), or load first, then prepare the model and build its "
        "optimizer"
    )


def _short(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


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


def keep_notes_through_to_empty(model: nn.Module) -> None:
    """A model prepared on the meta device: its ``to_empty()`` makes new parameters, which
    lost what preparation noted on them, and an optimizer built after it chose no loss
    scaling for a float16 model (its first layer's gradients all 0), unsaid. Its own
    ``to_empty`` (an attribute of this model alone) puts the notes back after torch's."""
    if any(p.is_meta for p in model.parameters()):
        model.__dict__["to_empty"] = functools.partial(_to_empty, model)


def _to_empty(model: nn.Module, *args: Any, **kwargs: Any) -> nn.Module:
    nn.Module.to_empty(model, *args, **kwargs)
    for module in model.modules():
        keeper = module.__dict__.get(TAGS_ATTR)
        if isinstance(keeper, TagKeeper):
            keeper.apply(module)
            params = list(module.parameters())
            for call in getattr(keeper, "on_rebuild", []):  # the registries it is known by
                call(module, params)
    return model
