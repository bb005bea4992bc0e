"""A warning when a framework's checkpoint takes a prepared model without its float32 masters.

At O2 the model stores its matrix weights in 16 bits; the values training reached are the
float32 masters, which the ``LossScaleOptimizer`` holds with the loss scale (in Fabric, the
``MixprecFabricPrecision`` plugin holds both). ``fabric.save(path, state)`` saves the
objects in ``state``, and ``accelerator.save_state()`` the prepared models and optimizers and
the objects given to ``register_for_checkpointing``. A save that takes the model but not the
holder loses the masters and the scale without a word, and a resume restarts from the
rounded weights with a fresh scale. Lightning's Trainer builds a weights-only checkpoint
(``save_checkpoint(weights_only=True)``) without asking the precision plugin: it holds the
16-bit weights alone, and is said too (a full one holds the masters). So is Hugging
Face's ``model.save_pretrained()`` without a ``state_dict``, which writes the model's own
16-bit weights (``MixprecTrainer.save_model`` writes the masters; ``quiet_saves`` marks
the saves of 16-bit weights it makes by the user's choice).

How it is seen: a ``state_dict`` pre-hook on the model (``guard_saves``), which runs on every
``model.state_dict()``: a few dictionary lookups and a return unless Fabric or accelerate is
imported and the model has not been warned about. Then it looks up to 16 frames up the call
stack for ``Fabric.save`` or
``Accelerator.save_state`` (compared by module and function name: neither framework is
imported) and reads what that call saves: ``Fabric.save``'s ``state`` argument, the
Accelerator's registered objects and prepared optimizers. None of them holding the model's
masters means they are lost: one warning per model, at the line that called the save.

Why not another hook: Fabric's plugin never sees ``fabric.save`` (the strategy calls
``model.state_dict()`` and the plugin's ``state_dict()`` in the state's order, so neither
call alone can tell whether the other will come), and accelerate has no plugin API; the
model's own ``state_dict`` is the one call both saves make. The hook is a module-level
function and the per-model facts live in a weak dictionary, so the model still pickles and
deep-copies (a copy is not guarded) and nothing keeps the model, the plugin or the optimizer
alive.

Only torch and the standard library are imported here: anything that holds masters is
recognised by its ``master_weights()`` method (``LossScaleOptimizer``), through the
``optimizer``/``_optimizer`` attribute of a framework's wrapper.
"""

from __future__ import annotations

import contextlib
import sys
import warnings
import weakref
from collections.abc import Iterator
from dataclasses import dataclass
from types import FrameType
from typing import Any, Protocol

from torch import nn

__all__ = ["FABRIC_MODULES", "Holder", "guard_saves", "quiet_saves"]

#: How many frames above the hook a save's own frame may be (Fabric: save,
#: save_checkpoint, _convert_stateful_objects_in_state, get_module_state_dict, a wrapper's
#: state_dict, then the model's; accelerate: save_state, get_state_dict, DDP, the model).
_MAX_DEPTH = 16

FABRIC_MODULES = ("lightning.fabric.fabric", "lightning_fabric.fabric")
_ACCELERATE_MODULE = "accelerate.accelerator"
#: Lightning's Trainer: ``dump_checkpoint(weights_only)`` builds every checkpoint it writes.
_LIGHTNING_MODULES = (
    "lightning.pytorch.trainer.connectors.checkpoint_connector",
    "pytorch_lightning.trainer.connectors.checkpoint_connector",
)
#: Hugging Face's ``PreTrainedModel.save_pretrained``, given no ``state_dict``: it writes
#: the model's own, the 16-bit weights (and a config that says so), not the masters.
_TRANSFORMERS_MODULE = "transformers.modeling_utils"
_SAVE_MODULES = (*FABRIC_MODULES, _ACCELERATE_MODULE, *_LIGHTNING_MODULES, _TRANSFORMERS_MODULE)
_MASTERS_AND_SCALE = "the float32 master weights and the loss scale"


class Holder(Protocol):
    """An object that carries a model's masters and scale in a Fabric state (the plugin)."""

    def _unsaved_state(self) -> str:
        """What a save without this object loses ("the float32 master weights and the loss
        scale"), or "" for nothing (no masters yet, no dynamic scale)."""
        ...


@dataclass
class _Guard:
    """What ``guard_saves`` knows of one model."""

    holder: weakref.ref[Holder] | None  # weak: the guard keeps nothing alive
    warned: bool = False


_GUARDS: weakref.WeakKeyDictionary[nn.Module, _Guard] = weakref.WeakKeyDictionary()
_QUIET = [0]  # saves inside quiet_saves(): chosen, not lost


@contextlib.contextmanager
def quiet_saves() -> Iterator[None]:
    """Saves that write the 16-bit weights by the user's choice (``MixprecTrainer(
    save_masters=False)``), or with the masters beside them: nothing to say."""
    _QUIET[0] += 1
    try:
        yield
    finally:
        _QUIET[0] -= 1


def guard_saves(model: nn.Module, holder: Holder | None = None) -> None:
    """Warn, once, when ``fabric.save`` or ``accelerator.save_state`` saves ``model``
    without its float32 masters and loss scale (see the module's docstring).

    ``holder``: an object that carries them in a Fabric state besides a
    ``LossScaleOptimizer`` (the Fabric plugin), and says what a save without it loses.
    Without one, what is lost is the masters and the scale whenever no
    ``LossScaleOptimizer`` over the model is saved. ``LossScaleOptimizer`` calls it for
    the model behind its masters. Calling it again for the same model replaces the holder
    (a call without one keeps it); the hook is registered once."""
    guard = _GUARDS.get(model)
    if guard is None:
        model.register_state_dict_pre_hook(_on_state_dict)
    elif holder is None:
        return
    ref = weakref.ref(holder) if holder is not None else None
    _GUARDS[model] = _Guard(ref, guard.warned if guard is not None else False)


def _on_state_dict(module: nn.Module, prefix: str, keep_vars: bool) -> None:
    guard = _GUARDS.get(module)
    if guard is None or guard.warned or _QUIET[0]:
        return
    if not any(m in sys.modules for m in _SAVE_MODULES):
        return  # a save by no such framework: no frame walk on every state_dict() call
    found = _enclosing_save(sys._getframe(1))
    if found is None:
        return
    kind, frame, depth = found
    holder = guard.holder() if guard.holder is not None else None
    if guard.holder is not None and holder is None:
        return  # the plugin is gone, and the masters with it
    saved = _saved_objects(kind, frame)
    if saved is None or any(_carries(obj, holder, module) for obj in saved):
        return
    lost = holder._unsaved_state() if holder is not None else _MASTERS_AND_SCALE
    if not lost:
        return
    guard.warned = True
    warnings.warn(_message(kind, lost, holder), UserWarning, stacklevel=depth + 2)


def _enclosing_save(frame: FrameType | None) -> tuple[str, FrameType, int] | None:
    """``("fabric" | "accelerate" | "lightning", the save's frame, its depth above the
    hook)``, or None when this ``state_dict()`` call is not made by one of those saves."""
    depth = 1  # ``frame`` is the hook's caller: Module.state_dict
    while frame is not None and depth <= _MAX_DEPTH:
        name, module = frame.f_code.co_name, frame.f_globals.get("__name__")
        if name == "save" and module in FABRIC_MODULES:
            return "fabric", frame, depth
        if name == "save_state" and module == _ACCELERATE_MODULE:
            return "accelerate", frame, depth
        if name == "dump_checkpoint" and module in _LIGHTNING_MODULES:
            return "lightning", frame, depth
        if name == "save_pretrained" and module == _TRANSFORMERS_MODULE:
            return "transformers", frame, depth
        frame, depth = frame.f_back, depth + 1
    return None


def _saved_objects(kind: str, frame: FrameType) -> list[Any] | None:
    """What the save takes besides the models: ``Fabric.save``'s ``state`` values, the
    Accelerator's registered objects and prepared optimizers, nothing for a weights-only
    Lightning checkpoint; None where it cannot be read (another version of the framework:
    stay silent rather than guess) or holds them (a full Lightning checkpoint)."""
    local = frame.f_locals
    if kind == "transformers":  # the model's own weights, nothing else
        return []
    if kind == "lightning":  # a full checkpoint holds the optimizers (the masters) and the
        return [] if local.get("weights_only") is True else None  # plugin's scale
    if kind == "fabric":
        state = local.get("state")
        return list(state.values()) if isinstance(state, dict) else None
    accelerator = local.get("self")
    custom = getattr(accelerator, "_custom_objects", None)
    optimizers = getattr(accelerator, "_optimizers", None)
    if not isinstance(custom, list) or not isinstance(optimizers, list):
        return None
    return [*custom, *optimizers]


def _carries(obj: Any, holder: object | None, model: nn.Module) -> bool:
    """Whether saving ``obj`` saves ``model``'s masters: the holder itself, or an optimizer
    (or a wrapper of one) with float32 masters for one of ``model``'s weights."""
    if holder is not None and obj is holder:
        return True
    for _ in range(4):  # Fabric's and accelerate's wrappers, one inside the other at most
        fields = getattr(obj, "__dict__", {})
        if "_optimizer" in fields:  # Fabric's _FabricOptimizer
            obj = fields["_optimizer"]
        elif callable(getattr(type(obj), "master_weights", None)):
            return _covers(obj, model)
        elif "optimizer" in fields:  # accelerate's AcceleratedOptimizer
            obj = fields["optimizer"]
        else:
            return False
    return False


def _covers(optimizer: Any, model: nn.Module) -> bool:
    """Whether a ``LossScaleOptimizer`` updates one of ``model``'s parameters: a 16-bit one
    through its master, or a float32 one as it is."""
    ours = {id(p) for p in model.parameters()}
    held = [half for half, _ in optimizer.master_weights()]
    params = getattr(optimizer, "master_params", None)
    held.extend(params() if callable(params) else ())
    return any(id(p) in ours for p in held)


def _message(kind: str, lost: str, holder: object | None) -> str:
    if kind == "transformers":
        return (
            "model.save_pretrained() writes this mixprec model's 16-bit weights (its config "
            "then says so), not the float32 master weights its LossScaleOptimizer trained: "
            "the files hold the trained values rounded to 16 bits. MixprecTrainer's "
            "trainer.save_model() writes a folder from_pretrained loads the masters from; "
            "outside it, mp.save_checkpoint(path, model, opt) keeps them (load_checkpoint "
            "restores them), and mp.export_weights(model, 'weights.safetensors', "
            "optimizer=opt) writes them as one plain safetensors file (a file, not a "
            "from_pretrained folder)"
        )
    if kind == "lightning":
        return (
            f"a weights-only Lightning checkpoint (trainer.save_checkpoint(weights_only=True), "
            f"ModelCheckpoint(save_weights_only=True)) saves this mixprec model's 16-bit "
            f"weights without {lost}: a full checkpoint holds them, its state_dict in float32"
        )
    if kind == "accelerate":
        return (
            f"accelerator.save_state() saves this mixprec model without {lost}, which its "
            "LossScaleOptimizer holds: call accelerator.register_for_checkpointing(optimizer) "
            "with it before saving (load_state then restores them)"
        )
    if holder is not None:
        return (
            f"fabric.save() saves this mixprec model without {lost}, which "
            f"{type(holder).__name__} holds: add the plugin to the state, "
            'state["mixprec"] = plugin, and fabric.load the same state'
        )
    return (
        f"fabric.save() saves this mixprec model without {lost}, which its LossScaleOptimizer "
        'holds: add the optimizer to the state, state["optimizer"] = optimizer'
    )
