"""``LossScaleOptimizer.state_dict()`` and ``load_state_dict`` (``StateDictMethods``), how
it pickles and copies, and
the checks ``load_state_dict`` makes before it loads any of it. The state holds
``optimizers`` (the inner optimizers' states), ``master_weights`` (the float32 masters, in
order), ``loss_scaler`` and ``micro_steps``. A state that does not fit this optimizer is
refused whole, so that a bad one changes nothing.
"""

from __future__ import annotations

import contextlib
import copy
import sys
import threading
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Any

import torch

from mixprec._errors import ArgumentError
from mixprec._plain_optimizers import watch_wrapped
from mixprec._save_guard import guard_saves
from mixprec._warn import warn_at_caller
from mixprec.optim.checks import refuse_accelerate_wrapper
from mixprec.optim.deferred import COPIED, ON_DEVICE
from mixprec.optim.layouts import lay_state_as_params, misshapen_state
from mixprec.optim.masters import MasterWeights
from mixprec.scaling import LossScaler, all_finite
from mixprec.trace import OverflowTracer, model_of

if TYPE_CHECKING:
    from mixprec.optim.loss_scale_optimizer import _Bookkeeping

__all__ = ["StateDictMethods", "check_state_dict", "checked_elsewhere"]

# Set while load_checkpoint, which checked the masters' finiteness by its own on_range,
# loads the state (on_range="ignore" loads NaN on purpose).
_CHECKED_ELSEWHERE = threading.local()


@contextlib.contextmanager
def checked_elsewhere() -> Iterator[None]:
    """Within it, ``load_state_dict`` leaves the masters' finiteness to the caller."""
    _CHECKED_ELSEWHERE.on = True
    try:
        yield
    finally:
        _CHECKED_ELSEWHERE.on = False


class StateDictMethods:
    """``state_dict`` and ``load_state_dict``, on the state ``LossScaleOptimizer`` sets up;
    and its pickling, which keeps what is known by the objects' identity."""

    optimizers: list[torch.optim.Optimizer]
    _book: _Bookkeeping
    # Set by an integration that has accelerate wrap this optimizer on purpose (and takes
    # the StepResult and clipping out of the wrapper's hands): MixprecTrainer.
    _managed_by: str | None = None
    _loss_scaler: LossScaler
    _weights: MasterWeights
    accumulation_steps: int
    _tracer: OverflowTracer | None

    if TYPE_CHECKING:

        def _adopt_added_groups(self) -> None: ...

        def zero_grad(self, set_to_none: bool = True) -> None: ...

    def __getstate__(self) -> dict[str, Any]:
        # Every attribute: torch's Optimizer.__getstate__ keeps its defaults, state and
        # param_groups alone, and the wrapper's masters and scaler would be lost.
        return self.__dict__.copy()

    def __setstate__(self, state: dict[str, Any]) -> None:
        # Unpickled or deep-copied: the guards known by the objects' identity, again (the
        # inner optimizer's own step refused, its zero_grad this one's, framework saves).
        self.__dict__.update(state)
        # torch drops .grad in a copy and in a pickle: no backward is pending in the copy
        # (it counted the original's, and blamed the next backward on a model.zero_grad()).
        book = self._book
        book.micro, book.backwards, book.fresh, book.found_inf = 0, 0, False, None
        book.look.versions = None
        for inner in self.optimizers:
            watch_wrapped(inner, self._book, self.zero_grad)
        model = model_of(self._weights.model_params()) if self._weights.half else None
        if model is not None:
            guard_saves(model)

    @property
    def pending_micro_steps(self) -> int:
        """Backward passes accumulated toward the next update: 0 between steps (what a
        state or a checkpoint taken now cannot hold)."""
        return self._book.micro if self._book.micro < self.accumulation_steps else 0

    def drop_gradients(self) -> None:
        """Drop the gradients held and the accumulation group they belong to (a backward
        that raised half way through, or a group a stopped ``fit`` left unfinished)."""
        self._drop_unscaled()
        self._book.fresh, self._book.backwards = False, 0
        self._weights.zero_grad(set_to_none=True)
        if self._tracer is not None:  # the records of a backward that went with them
            self._tracer.clear()

    @property
    def applied_before_raising(self) -> bool:
        """Whether the last ``step()`` raised after its update went in (a step post-hook,
        Ctrl-C in the copy-back to the 16-bit weights). Such a step is finished as applied
        (the 16-bit weights from the masters, the scale updated): its batch is done, and
        is not to be run again. False once a backward follows."""
        return self._book.raised == "applied"

    def _after_raise(self) -> None:
        """A step that raised: before its update went in, its unscaled gradients dropped
        (a retry runs the batch again); after, finished as applied, or the batch would be
        applied twice and the stale 16-bit weights taken for writes at the next save."""
        book = self._book
        stepped, book.stepped = book.stepped, 0
        if stepped == ON_DEVICE:  # the fused kernel decided; its flag counts when read
            self._weights.copy_back()
            skipped = book.device_found is not None and bool(book.device_found)
            book.device_found = None
            book.raised = "dropped" if skipped else "applied"
            return
        if not stepped:
            self._drop_unscaled()
            book.raised = "dropped"
            if self._tracer is not None:
                self._tracer.clear()
            return
        if stepped != COPIED and self._weights.half:  # the copy-back did not finish
            self._weights.copy_back()
        if 0 < stepped < len(self.optimizers):  # a later inner optimizer raised first
            warn_at_caller(
                f"step() raised in optimizers[{stepped}] before its update, after "
                f"optimizers[0:{stepped}] had applied theirs: the step is finished as "
                f"applied, and the parameters of optimizers[{stepped}:] did not move for "
                "this batch"
            )
        if self._weights.checked:
            book.weights_finite = all_finite(self._weights.checked)
        self._loss_scaler.update(False)
        book.micro, book.found_inf, book.raised = 0, None, "applied"

    def _drop_unscaled(self) -> None:
        """After a step that raised (a float16 weight past 65504, the scaler's
        max_consecutive_skips, Ctrl-C): no unscaled gradients left to the next step, which
        would apply them instead of its own (or refuse its backward)."""
        self._book.micro = 0
        self._book.found_inf = None

    def state_dict(self) -> dict[str, Any]:
        """Inner optimizer state, float32 master weights and the loss scaler's state.

        Take it between steps: gradients accumulated mid-way are not part of it."""
        if self._managed_by is None:
            refuse_accelerate_wrapper(sys._getframe(1))
        self._adopt_added_groups()  # groups added to an inner optimizer hold masters too
        self._book.deferred.fold()  # steps decided on the device, counted first
        # A weight written since the last step (a pretrained load) is saved, not the master
        # it is about to replace.
        self._weights.follow_external_writes()
        self._weights.follow_data_writes()  # and through .data: the masters are saved
        if self.pending_micro_steps:
            warn_at_caller(
                f"state_dict() taken {self._book.micro} of {self.accumulation_steps} "
                "micro-batches into an accumulation group: the gradients accumulated so far "
                "are not part of it, and a resume from it would apply a partial group. Take "
                "it after the step() that applies the group."
            )
        return {
            "optimizers": [inner.state_dict() for inner in self.optimizers],
            "master_weights": [m.detach() for m in self._weights.masters],
            "loss_scaler": self._loss_scaler.state_dict(),
            # A whole group whose step() never came (it raised) is not resumed into: its
            # gradients are not saved, so the resumed run starts a group of its own.
            "micro_steps": self.pending_micro_steps,
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._adopt_added_groups()
        check_state_dict(state_dict, self._weights.masters, self.optimizers)
        self._book.deferred.fold()  # unread steps count now, not into the load
        # The scaler's state is checked on a copy first, so that a bad one changes nothing.
        copy.deepcopy(self._loss_scaler).load_state_dict(state_dict["loss_scaler"])
        for inner, inner_state in zip(self.optimizers, state_dict["optimizers"], strict=True):
            inner.load_state_dict(inner_state)
            lay_state_as_params(inner)  # laid out as saved: as its parameter, for fused steps
        self._loss_scaler.load_state_dict(state_dict["loss_scaler"])
        self._weights.load(state_dict["master_weights"])
        self._book.micro = int(state_dict.get("micro_steps", 0))
        self._book.fresh = False
        self._book.found_inf = None


def check_state_dict(
    state_dict: dict[str, Any],
    masters: Sequence[torch.Tensor],
    optimizers: Sequence[torch.optim.Optimizer],
) -> None:
    """Refuse a state that is not this optimizer's, before anything is loaded."""
    if not isinstance(state_dict, dict):
        raise ArgumentError(
            "load_state_dict: a LossScaleOptimizer state is a dict (from state_dict()), "
            f"got {type(state_dict).__name__}"
        )
    missing = [k for k in ("optimizers", "master_weights", "loss_scaler") if k not in state_dict]
    if missing:
        raise ArgumentError(
            f"load_state_dict: not a LossScaleOptimizer state; missing {', '.join(missing)} (a "
            "plain optimizer's state, saved without mixprec? load the weights alone)"
        )
    saved = state_dict["master_weights"]
    inner_states = state_dict["optimizers"]
    for key, value, kind in (
        ("master_weights", saved, torch.Tensor),
        ("optimizers", inner_states, dict),
    ):
        if not isinstance(value, (list, tuple)) or not all(isinstance(v, kind) for v in value):
            raise ArgumentError(
                f"load_state_dict: '{key}' must be a list of {kind.__name__}, got "
                f"{type(value).__name__}"
                + (
                    f" of {sorted({type(v).__name__ for v in value})}"
                    if isinstance(value, (list, tuple))
                    else ""
                )
            )
    _same_count("master weights", saved, masters)
    _same_count("inner optimizers", inner_states, optimizers)
    # What torch's own load_state_dict refuses, checked for every inner optimizer before
    # any is loaded: a later one's refusal would leave the earlier ones loaded.
    for k, (inner, state) in enumerate(zip(optimizers, inner_states, strict=True)):
        groups = state.get("param_groups")
        ours = [len(g["params"]) for g in inner.param_groups]
        theirs = [len(g.get("params", ())) for g in groups] if isinstance(groups, list) else None
        if theirs != ours:
            raise ArgumentError(
                f"load_state_dict: inner optimizer {k} ({type(inner).__name__}) has param "
                f"groups of sizes {ours}; the state's are {theirs}"
            )
        per_param = state.get("state")
        if not isinstance(per_param, dict):
            raise ArgumentError(
                f"load_state_dict: inner optimizer {k}'s 'state' must be a dict of each "
                f"parameter's state (from state_dict()), got {type(per_param).__name__}"
            )
        assert isinstance(groups, list)  # theirs == ours: a list of groups
        ids = [i for group in groups for i in group["params"]]
        params = [p for group in inner.param_groups for p in group["params"]]
        wrong = misshapen_state(inner, params, [per_param.get(i) for i in ids])
        if wrong is not None:
            raise ArgumentError(f"load_state_dict: inner optimizer {k}: {wrong}")
    micro = state_dict.get("micro_steps", 0)
    if isinstance(micro, bool) or not isinstance(micro, int) or micro < 0:
        raise ArgumentError(
            f"load_state_dict: 'micro_steps'={micro!r} is invalid; it must be an int >= 0 "
            "(the backward passes accumulated toward the next update)"
        )
    for i, (one, master) in enumerate(zip(saved, masters, strict=True)):
        if one.shape != master.shape:
            raise ArgumentError(
                f"load_state_dict: master weight {i} has shape {tuple(one.shape)}, "
                f"expected {tuple(master.shape)}"
            )
        # As load_checkpoint refuses: a non-finite master would make its weight NaN at once.
        # (load_checkpoint decides by its on_range, before anything loads: checked_elsewhere.)
        if (
            not getattr(_CHECKED_ELSEWHERE, "on", False)
            and one.is_floating_point()
            and not bool(torch.isfinite(one).all())
        ):
            raise ArgumentError(
                f"load_state_dict: master weight {i} holds inf/NaN values: a state saved "
                "after training diverged; load one from before"
            )


def _same_count(what: str, saved: Sequence[Any], ours: Sequence[Any]) -> None:
    if len(saved) != len(ours):
        raise ArgumentError(
            f"load_state_dict: state has {len(saved)} {what}, this LossScaleOptimizer {len(ours)}"
        )
