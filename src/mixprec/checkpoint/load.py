"""``load_checkpoint``: a checkpoint into a model (and optimizer, and RNGs), each tensor cast
to its destination's dtype, all or nothing.

Everything the load will change is checked first (dtypes, non-finite values, ranges, the
optimizer state tried on stand-ins, the loss scaler's on a copy, the RNG states on fresh
generators); only then do the model, the optimizer and the RNGs change.
"""

from __future__ import annotations

import copy
import os
from collections import defaultdict
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from mixprec._errors import ArgumentError, shown
from mixprec._float32_copies import keep_loaded_float32
from mixprec.checkpoint._across_levels import compensations, say_if_trained_otherwise
from mixprec.checkpoint._conversion import (
    _check_on_range,
    _convert,
    _count_non_finite,
    _raise_non_finite,
    saturate,
)
from mixprec.checkpoint._files import as_path
from mixprec.checkpoint._model import (
    _buffer_names,
    _parameter_names,
    _unwrapped,
    check_arguments,
    check_param_names,
    optimizer_classes,
    optimizer_param_names,
)
from mixprec.checkpoint._rng import _check_rng_state, _set_rng_state, _this_ranks
from mixprec.checkpoint._tree import _tensor_names, _unflatten
from mixprec.checkpoint.format import CheckpointError, LoadReport, OnRange, _cut, _is_count
from mixprec.checkpoint.read import read_checkpoint
from mixprec.checkpoint.read import trainer_state as stored_trainer_state
from mixprec.optim import LossScaleOptimizer
from mixprec.optim.compensated import compensated_value
from mixprec.optim.layouts import lay_state_as_params
from mixprec.optim.state_dict import checked_elsewhere


def load_checkpoint(
    path: str | os.PathLike[str],
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    strict: bool = True,
    on_range: OnRange = "error",
    restore_rng: bool = False,
    check: Callable[[dict[str, Any]], None] | None = None,
) -> LoadReport:
    """Load ``path`` into ``model`` (and ``optimizer``), casting each tensor to the dtype of
    its destination. Returns a ``LoadReport``; with ``strict=True`` missing, unexpected and
    mismatched keys raise one ``CheckpointError`` listing them all.

    All or nothing: everything is checked before the model, the optimizer or the RNGs
    change, and any problem raises ``CheckpointError`` with all three as they were. Refused:
    a tensor whose dtype does not convert meaningfully to its destination's (complex, bool,
    integer or float8 values into a floating-point parameter; float8 values need their
    scales); NaN or inf in a parameter or the optimizer state (buffers are exempt: a mask
    of -inf is normal) (under
    ``on_range="error"`` and ``"clamp"``: no finite value stands in for a NaN; ``"ignore"``
    loads them and lists them in ``LoadReport.non_finite``); a value beyond a narrower
    destination's range (``"error"``; ``"clamp"`` saturates it, ``"ignore"`` casts it to
    inf); an optimizer state saved by another optimizer class (both named); an optimizer,
    loss-scaler or (with ``restore_rng``) RNG state that does not load.
    ``trainer_state`` counters (``global_step``, ``epoch``, ``step_in_epoch``) are ints >= 0.
    ``restore_rng`` under torchrun restores each rank's own state where the checkpoint holds
    one for every rank now running (the Trainer's ``rank_rng``), and else rank 0's.
    ``check``: called with the ``trainer_state`` before anything changes; what it raises
    leaves the model, the optimizer and the RNGs as they were (``fit(resume_from=...)``
    refuses a checkpoint it cannot resume from so).
    """
    check_arguments("load_checkpoint", model, optimizer)
    for name, flag in (("strict", strict), ("restore_rng", restore_rng)):
        if not isinstance(flag, bool):  # strict="false" was true, strict=None false
            raise ArgumentError(
                f"load_checkpoint({name}={shown(flag)}) is invalid; valid: True or False"
            )
    _check_on_range(on_range)
    if check is not None and not callable(check):
        raise ArgumentError(
            f"load_checkpoint(check={shown(check)}) is invalid; valid: a callable taking the "
            "trainer_state, or None"
        )
    tensors, header = read_checkpoint(as_path("load_checkpoint", path))
    described = ("policy", "level", "float8", "mixprec_version", "torch_version", "format_version")
    report = LoadReport(
        path=str(path), metadata={k: v for k, v in header.items() if k in described}
    )
    saved = {k.removeprefix("model/"): v for k, v in tensors.items() if k.startswith("model/")}
    for key, canonical in header.get("aliases", {}).items():
        saved[key] = saved[canonical]
    current = model.state_dict()
    report.missing = [k for k in current if k not in saved]
    report.unexpected = [k for k in saved if k not in current]
    report.mismatched = [
        (k, tuple(saved[k].shape), tuple(current[k].shape))
        for k in current
        if k in saved and saved[k].shape != current[k].shape
    ]
    if strict and (report.missing or report.unexpected or report.mismatched):
        details = "\n".join(report.mismatch_lines())
        raise CheckpointError(
            f"{path}: does not match the model (strict=False loads what matches)\n{details}"
        )

    skip = {k for k, _, _ in report.mismatched}  # not loaded: no value to lose
    report.tied_conflicts = _tied_conflicts(current, saved, skip)
    if strict and report.tied_conflicts:
        raise CheckpointError(
            f"{path}: {', '.join(report.tied_conflicts[0])} are one tensor in this model "
            "(tied) and hold different values in the checkpoint (saved untied): one would "
            "be lost. Tie or untie the model as it was saved, or pass strict=False (the "
            "last key's value wins, said in the LoadReport)"
        )
    # Check and prepare everything; nothing changes before the commit below.
    buffers = _buffer_names(model, current)
    loaded = {
        k: _convert(k, saved[k], current[k].dtype, on_range, report, k not in buffers)
        for k in current
        if k in saved and k not in skip
    }
    optim_state: Any = None
    if optimizer is not None:
        if header.get("optimizer") is None:
            other = header.get("other_entries")  # a torch.save file's, beside its weights
            raise CheckpointError(
                f"{path}: holds no optimizer state"
                + (
                    f" mixprec reads: a torch.save file, whose entries beside the weights "
                    f"({', '.join(other)}) are not read; load an optimizer's state with "
                    "opt.load_state_dict(torch.load(path)[key])"
                    if other
                    else ""
                )
            )
        for name in _tensor_names(header["optimizer"]):
            _count_non_finite(name, tensors[name], report)
    _raise_non_finite(report, on_range)
    # Masters are built from the saved values, clamped as their weights were: else the
    # optimizer's copy-back would put back the values the clamp took out (and masters built
    # later would find kept values their weights do not round from, and start from 16 bits).
    clamped = {n: getattr(torch, d) for n, _, d, how in report.out_of_range if how == "clamp"}
    masters_from = {n: saturate(v, clamped[n]) if n in clamped else v for n, v in saved.items()}
    if optimizer is not None:
        mine = optimizer_param_names(optimizer, model)
        check_param_names(str(path), header.get("optimizer_params"), mine, skip)
        optim_state = _optimizer_state(path, optimizer, model, masters_from, tensors, header)
        _cast_like_torch(optimizer, optim_state, on_range, report)
    trainer_state = stored_trainer_state(header, tensors)
    if check is not None:
        check(trainer_state)
    rng_state = None
    if restore_rng and header.get("rng") is not None:
        rng_state = _this_ranks(path, _unflatten(header["rng"], tensors), trainer_state)
        _check_rng_state(path, rng_state)

    # Commit: every value was checked above to fit its destination.
    model.load_state_dict(loaded, strict=False)
    _keep_float32_values(model, masters_from)
    if optimizer is not None:
        try:
            with checked_elsewhere():  # the masters' finiteness: by on_range, above
                optimizer.load_state_dict(optim_state)
            if not isinstance(optimizer, LossScaleOptimizer):  # which lays its own out
                lay_state_as_params(optimizer)  # written contiguous: as its parameter again
        except (ValueError, TypeError, KeyError, RuntimeError) as err:
            # Only an optimizer with a load_state_dict of its own gets here (torch's is
            # tried on a stand-in first): its checks cannot run before the model loads.
            raise CheckpointError(
                f"{path}: optimizer state does not fit this optimizer: {err}"
            ) from err
    if rng_state is not None:
        _set_rng_state(rng_state)
    report.trainer_state = trainer_state
    if optimizer is not None:  # a resume: training goes on in this model's precision
        say_if_trained_otherwise(str(path), header, model)
    return report


def _tied_conflicts(
    current: dict[str, torch.Tensor], saved: dict[str, torch.Tensor], skipped: set[str]
) -> list[list[str]]:
    """Keys of one tensor of the model (tied weights) whose values in the file differ: a
    checkpoint of an untied model loads both into the one tensor, the last key's value
    winning and the other's lost. Each group in load order (the last one wins)."""
    keys: dict[tuple[Any, ...], list[str]] = defaultdict(list)
    for key, value in current.items():
        if value.numel() and key in saved and key not in skipped:
            value = _unwrapped(value)  # torchao's float8 all-gather weights wrap their tensor
            try:
                storage = value.untyped_storage().data_ptr()
            except RuntimeError:  # a tensor subclass with no storage of its own
                continue
            keys[(storage, value.storage_offset(), value.stride(), tuple(value.shape))].append(key)
    return [
        names
        for names in keys.values()
        if any(not _same_values(saved[n], saved[names[0]]) for n in names[1:])
    ]


def _same_values(a: torch.Tensor, b: torch.Tensor) -> bool:
    """One value, NaN included (a diverged tied weight loads under ``on_range="ignore"``)."""
    if a is b:
        return True
    a = a.to(b.dtype)
    if not b.is_floating_point():
        return torch.equal(a, b)
    return a.shape == b.shape and torch.allclose(a, b, rtol=0.0, atol=0.0, equal_nan=True)


def _keep_float32_values(model: nn.Module, saved: dict[str, torch.Tensor]) -> None:
    """16-bit parameters remember the float32 values they were loaded from, so a
    ``LossScaleOptimizer`` built afterwards starts its masters from those, not rounded ones."""
    for name, param in model.named_parameters():
        keep_loaded_float32(param, saved.get(name))


def _optimizer_state(
    path: str | os.PathLike[str],
    optimizer: torch.optim.Optimizer,
    model: nn.Module,
    saved: dict[str, torch.Tensor],
    tensors: dict[str, torch.Tensor],
    header: dict[str, Any],
) -> Any:
    """The state to give ``optimizer.load_state_dict``, tried on stand-ins first: whatever
    the optimizer, its inner optimizers or its loss scaler would refuse is refused here."""
    _check_classes(path, optimizer, header)
    state = _unflatten(header["optimizer"], tensors)
    if not isinstance(optimizer, LossScaleOptimizer):
        if header.get("optimizer_kind") == "LossScaleOptimizer":
            raise CheckpointError(
                f"{path}: the optimizer state is a LossScaleOptimizer's (float32 masters, "
                f"loss scaler) and this optimizer is a plain {type(optimizer).__name__}: wrap "
                "it, mp.LossScaleOptimizer(optimizer), or load the model alone (optimizer=None)"
            )
        _try_load(path, optimizer, state)
        return state
    if not isinstance(state, dict) or "optimizers" not in state:
        kind = header.get("optimizer_kind")
        raise CheckpointError(
            f"{path}: the optimizer state of a LossScaleOptimizer has no 'optimizers' "
            "entry (a damaged or hand-edited header)"
            if kind == "LossScaleOptimizer"
            else f"{path}: optimizer state is from a {kind}, not a LossScaleOptimizer"
        )
    inner = state["optimizers"]
    if not isinstance(inner, list) or len(inner) != len(optimizer.optimizers):
        raise CheckpointError(
            f"{path}: optimizer state: 'optimizers' is {shown(inner)}; valid: a list of "
            f"{len(optimizer.optimizers)} optimizer state(s)"
        )
    if not _is_count(state.get("micro_steps", 0)):
        raise CheckpointError(
            f"{path}: optimizer state: 'micro_steps' is {shown(state['micro_steps'])}; "
            "valid: an int >= 0"
        )
    if not isinstance(state.get("loss_scaler"), dict):
        raise CheckpointError(
            f"{path}: optimizer state: 'loss_scaler' is {shown(state.get('loss_scaler'))}; "
            "valid: a loss scaler's state_dict()"
        )
    try:  # the scaler's load checks each value by name; a copy keeps the real one as it is
        copy.deepcopy(optimizer.loss_scaler).load_state_dict(state["loss_scaler"])
    except Exception as err:  # whatever a bad state makes it raise
        said, hint = str(err), ""
        if "cannot load into" in said:  # another kind of scaler
            # float32 and bfloat16 runs scale nothing (NoOpLossScaler); float16 runs do.
            alone = "load the model alone, load_checkpoint(path, model), and start its optimizer"
            if "NoOpLossScaler" in said:
                hint = (
                    " (saved with another policy: float32 and bfloat16 runs scale no loss, "
                    f"float16 runs do; {alone} anew)"
                )
            else:
                hint = (
                    " (saved with another loss scaler: give the optimizer one of its kind, "
                    f"or {alone} anew)"
                )
        raise CheckpointError(f"{path}: loss scaler state does not load: {err}{hint}") from None
    for each, each_state in zip(optimizer.optimizers, inner, strict=True):
        _try_load(path, each, each_state)
    names = _parameter_names(model)
    masters = []
    pairs = optimizer.master_weights()
    lost = compensations(optimizer, inner, {id(m) for _, m in pairs})
    for param, master in pairs:
        found = [n for n in names.get(id(param), []) if n in saved]
        if not found:
            wanted = ", ".join(names.get(id(param), [])) or f"a {tuple(param.shape)} weight"
            raise CheckpointError(f"{path}: no saved weight for the master of {wanted}")
        value = saved[found[0]]
        if value.shape != master.shape:  # possible with strict=False
            raise CheckpointError(
                f"{path}: the saved {found[0]!r} has shape {tuple(value.shape)}, its float32 "
                f"master {tuple(master.shape)}"
            )
        kept = lost.get(id(master))  # an O3 run's Kahan compensation: what rounding lost
        masters.append(compensated_value(value, kept) if kept is not None else value.float())
    state["master_weights"] = masters
    return state


def _cast_like_torch(
    optimizer: torch.optim.Optimizer, state: Any, on_range: OnRange, report: LoadReport
) -> None:
    """torch's ``load_state_dict`` casts each floating state entry (Adam's moments) to its
    parameter's dtype, a 16-bit one where no master stands between (O3, a plain optimizer
    over a 16-bit model): a second moment past 65504 became inf in float16 and froze its
    weight. Cast here instead, through ``on_range``, each cast in the report (not for an
    optimizer with a ``load_state_dict`` of its own, which keeps what it keeps)."""
    pairs = (
        [(f"optim/optimizers/{i}", o, s) for i, (o, s) in
         enumerate(zip(optimizer.optimizers, state["optimizers"], strict=True))]
        if isinstance(optimizer, LossScaleOptimizer)
        else [("optim", optimizer, state)]
    )  # fmt: skip
    for prefix, inner, saved in pairs:
        if type(inner).load_state_dict is not torch.optim.Optimizer.load_state_dict:
            continue  # a load of its own decides its state's dtypes (CompensatedAdamW's)
        if not isinstance(saved, dict) or not isinstance(saved.get("param_groups"), list):
            continue  # a state of its own shape: its optimizer's load decides
        params = [p for g in inner.param_groups for p in g["params"]]
        indices = [i for g in saved["param_groups"] for i in g.get("params", [])]
        by_index = {str(i): p for i, p in zip(indices, params, strict=False)}
        for index, entry in (saved.get("state") or {}).items():
            param = by_index.get(str(index))
            if param is None or not param.is_floating_point() or not isinstance(entry, dict):
                continue
            for key, value in entry.items():
                if (
                    key != "step"
                    and isinstance(value, torch.Tensor)
                    and value.is_floating_point()
                    and value.dtype != param.dtype
                ):
                    name = f"{prefix}/state/{index}/{key}"
                    entry[key] = _convert(name, value, param.dtype, on_range, report, False)


def _check_classes(
    path: str | os.PathLike[str], optimizer: torch.optim.Optimizer, header: dict[str, Any]
) -> None:
    """Refuse an optimizer state saved by another optimizer class: torch's
    ``load_state_dict`` takes it, and then the optimizer acts as the other (AdamW's state
    makes an Adam decouple its weight decay) or fails at its first step (SGD's momentum)."""
    saved = header.get("optimizer_classes")
    kind = header.get("optimizer_kind")
    if saved is None and kind is not None and kind != "LossScaleOptimizer":
        saved = [kind]  # a checkpoint without the classes: a plain optimizer's kind is its class
    mine = optimizer_classes(optimizer)
    if saved is None or len(saved) != len(mine):
        return  # nothing recorded, or a different structure: the state's own checks tell
    for i, (theirs, ours) in enumerate(zip(saved, mine, strict=True)):
        if theirs != ours:
            where = f" (inner optimizer {i + 1} of {len(mine)})" if len(mine) > 1 else ""
            raise CheckpointError(
                f"{path}: optimizer state is from {theirs}, this optimizer is {ours}{where}; "
                "refused: loaded into another class, a state changes what the optimizer does "
                f"or fails at its first step. Resume with {theirs}, or load the model alone "
                "(optimizer=None)"
            )


def _try_load(path: str | os.PathLike[str], optimizer: torch.optim.Optimizer, state: Any) -> None:
    """Load ``state`` into a stand-in for a torch optimizer: same class, groups and
    defaults, meta tensors for parameters (no memory), no state and no hooks. What torch's
    ``load_state_dict`` and the class's ``__setstate__`` (Adam's, say, reading ``step``)
    refuse is refused here, and ``optimizer`` is not touched."""
    if type(optimizer).load_state_dict is not torch.optim.Optimizer.load_state_dict:
        return  # a load_state_dict of its own: only the real load can tell
    stand_in = type(optimizer).__new__(type(optimizer))
    groups = [
        {**g, "params": [torch.empty_like(p, device="meta") for p in g["params"]]}
        for g in optimizer.param_groups
    ]
    try:
        stand_in.__setstate__(
            {
                "defaults": dict(optimizer.defaults),
                "state": defaultdict(dict),
                "param_groups": groups,
            }
        )
        stand_in.load_state_dict(state)
    except NotImplementedError:
        return  # an operation with no meta kernel: the real load decides
    except Exception as err:  # a hostile state can make torch raise anything
        raise CheckpointError(
            f"{path}: optimizer state does not fit this optimizer: {type(err).__name__}: "
            f"{_cut(str(err), 200)}"
        ) from None
