"""Optimisation levels O0-O3 (as in NVIDIA Apex and MindSpore): ``auto_mixed_precision``.

=====  ==================================================================================
O0     everything in float32
O1     op-level autocast in the compute dtype; weights stay float32 and are cast on use
       (``torch.autocast`` caches each weight's cast for the whole forward)
O2     weights of compute-heavy modules (linear, conv, embedding, attention, RNN) stored in
       the compute dtype; normalisation, softmax and loss modules and ``keep_float32`` entries
       stay float32; ``LossScaleOptimizer`` keeps float32 master weights
O3     every parameter and floating buffer in the compute dtype, no master weights
=====  ==================================================================================

MindSpore's levels by MindSpore's keyword, ``amp_level=``: O0-O2 as above, and O3 as
MindSpore's (the whole network computes in 16 bits, normalisation included, with float32
parameters): mixprec's O3 storage plus float32 master weights in ``LossScaleOptimizer``.

``level="auto"``: float32 compute -> O0; a pure 16-bit policy (``param_dtype`` equal to the
16-bit ``compute_dtype``) -> O3; a mixed policy -> O2, because storing the compute-heavy
weights in 16 bits casts each weight once per step (in the optimizer's copy-back) instead of
once per forward, and keeps float32 master weights, so it trains like float32.

Float8 policies (``mixed_float8``...) first swap the eligible Linear layers for torchao's
float8 Linear (``mixprec.float8``); those keep float32 weights at O1 and O2, the rest of the
model gets the level as under ``mixed_bfloat16``. O0 converts nothing.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, TypeVar

import torch
from torch import nn

from mixprec._averaged_copies import watch_averaged_copies
from mixprec._dtypes import closest, dtype_name
from mixprec._errors import ArgumentError
from mixprec._float16_range import check_float16_range
from mixprec._float64 import check_float64, lower_float64
from mixprec._input_casts import checked_keep_inputs
from mixprec._module_kinds import FLOAT32_MODULES, MIXED_NORM_MODULES, NORM_MODULES, is_half_storage
from mixprec._module_kinds import HALF_STORAGE_MODULES as HALF_STORAGE_MODULES  # re-exported
from mixprec._param_tags import keep_notes_through_to_empty, refuse_prepared_parts, tag
from mixprec._plain_optimizers import watch_plain_optimizers
from mixprec._plan_apply import PlanLike, plan_arguments
from mixprec._warn import warn_at_caller
from mixprec.casting import LEVEL_ATTR, MASTERS_ATTR, POLICY_ATTR, store_as, upcast_16bit
from mixprec.float8 import (
    Float8Options,
    check_float8,
    convert_to_float8,
    is_float8,
)
from mixprec.keep import KeepEntry as KeepEntry  # re-exported: callers import it from here
from mixprec.keep import declared_float32, inside, kept_modules
from mixprec.keep import keep_list as keep_list  # re-exported too
from mixprec.policy import UNSET, Policy, PolicyLike, get_policy, global_policy
from mixprec.region import Region, get_region, set_region, to_float
from mixprec.trace import remember_model

M = TypeVar("M", bound=nn.Module)

LEVELS: tuple[str, ...] = ("O0", "O1", "O2", "O3")

_APPLIED_ATTR = "_mixprec_applied"

#: The global policy until ``set_global_policy`` (or ``policy_scope``) is first called: then
#: ``policy=None`` means ``"auto"``, the hardware's best.
_UNSET_GLOBAL = UNSET


@functools.lru_cache(maxsize=1)
def _say_auto(name: str, reason: str) -> None:
    """Once per process: what ``policy=None`` resolved to, with no global policy set."""
    warn_at_caller(
        f"no policy given and none set globally: policy='auto' chose {name} ({reason}). Pass "
        "policy= (policy='float32' keeps float32) or call mp.set_global_policy(...) to choose"
    )


def _say_level_unused(level: str, policy: Policy) -> None:
    """A 16-bit level under a float32 policy changes nothing: say so at the user's line.
    Where ``auto`` chose float32 (only ``auto`` sets a reason), that was on purpose: 16-bit
    matmuls are emulated or slow on this machine, so the advice to pass a 16-bit policy
    would slow the model down; the warning says why, and that the level holds elsewhere."""
    if policy.reason is not None:
        warn_at_caller(
            f"level={level} changes nothing here: policy='auto' picks float32 on this machine "
            f"({policy.reason}), so the model stays float32; where auto picks a mixed "
            f"policy, {level} applies"
        )
        return
    warn_at_caller(
        f"level={level} with the float32 policy {policy.name!r} changes nothing: pass "
        "policy='mixed_bfloat16' or 'mixed_float16' (or set_global_policy)"
    )


def _encoder_region(model: nn.Module, compute: torch.dtype, lvl: str, fixed: set[int]) -> None:
    """An encoder-decoder's encoder (Hugging Face's T5, BART, Whisper) a region of its own:
    ``generate`` calls ``model.get_encoder()(...)`` outside the model's forward, where no
    autocast ran: at O2 its 16-bit weights met float32 activations and raised, and at O1 it
    computed in float32, unsaid. Inside the model's own forward it changes nothing."""
    if not getattr(getattr(model, "config", None), "is_encoder_decoder", False):
        return
    get_encoder = getattr(model, "get_encoder", None)
    encoder = get_encoder() if callable(get_encoder) else None
    if not isinstance(encoder, nn.Module) or encoder is model or id(encoder) in fixed:
        return
    if get_region(encoder) is None:  # not one the user set (to_float, keep_float32)
        set_region(encoder, Region(compute, None, cast_inputs=lvl != "O1"))


def _lower_float64(model: nn.Module, level: str) -> None:
    """Store a float64 model's float64 tensors in float32 and say so at the user's line."""
    params, buffers = lower_float64(model)
    if params or buffers:
        warn_at_caller(
            f"auto_mixed_precision: {_counted(params, buffers)} of the model were float64; "
            "stored in float32, the "
            f"widest dtype {level} keeps (digits past float32's 24 bits are rounded off). "
            "Call model.float() first to make this explicit"
        )


def _upcast_16bit(model: nn.Module, level: str, masters: bool) -> None:
    """Store a 16-bit model's 16-bit tensors in float32 (exact) for a level with float32
    weights or masters, which then proceeds as from a float32 model holding the rounded
    values; say so once, at the user's line (the first caller outside mixprec)."""
    done = upcast_16bit(model) if level != "O3" or masters else []
    if not done:
        return
    what, dtypes, restored = upcast_note(done)
    why = {"O2": "master weights and norms", "O3": "master weights"}.get(level, "weights")
    warn_at_caller(
        f"auto_mixed_precision: {what} of the model were {dtypes}; upcast to float32 so that "
        f"{level} has float32 {why}; the precision lost when they were rounded to 16 bits is "
        f"not recovered{restored}"
    )


def upcast_note(done: list[tuple[str, torch.dtype, bool]]) -> tuple[str, str, str]:
    """What ``casting.upcast_16bit`` returned, in words: ("10 parameters and 2 buffers",
    "bfloat16", " (N restored from the float32 values they were loaded from)" or "")."""
    n, restored = sum(k == "parameter" for k, _, _ in done), sum(kept for *_, kept in done)
    dtypes = " and ".join(sorted({dtype_name(dtype) for _, dtype, _ in done}))
    again = f" ({restored} restored from the float32 values they were loaded from)" * bool(restored)
    return _counted(n, len(done) - n), dtypes, again


def _counted(params: int, buffers: int) -> str:
    """ "10 parameters and 2 buffers", "1 parameter", "2 buffers"."""
    counts = ((params, "parameter"), (buffers, "buffer"))
    return " and ".join(f"{k} {noun}{'s' * (k != 1)}" for k, noun in counts if k)


@dataclass(frozen=True)
class Applied:
    """What ``auto_mixed_precision`` did to a model."""

    policy: Policy
    level: str
    keep_float32: tuple[str, ...]
    #: O3 with float32 masters (MindSpore's O3, ``amp_level="O3"``).
    o3_masters: bool = False
    #: Float8 policies: names of the Linear layers converted to float8.
    float8: tuple[str, ...] = ()
    #: ``plan=``: the plan applied (``mixprec.Plan``).
    plan: PlanLike | None = None


def resolve_level(level: str, policy: Policy) -> str:
    """Normalise ``level`` (``"o2"`` -> ``"O2"``) and resolve ``"auto"`` for ``policy``."""
    if not isinstance(level, str):
        raise ArgumentError(f"level={level!r} is invalid; valid: {', '.join(LEVELS)}, auto")
    key = level.strip().upper()
    if key == "AUTO":
        if not policy.is_mixed:
            return "O0"
        return "O3" if policy.param_dtype == policy.compute_dtype else "O2"
    if key in LEVELS:
        return key
    hint = closest(key, [*LEVELS, "AUTO"])
    raise ArgumentError(
        f"level={level!r} is not a known level; valid: {', '.join(LEVELS)}, auto"
        + (f" (closest: {hint!r})" if hint else "")
    )


def auto_mixed_precision(
    model: M,
    policy: PolicyLike = None,
    level: str = "auto",
    keep_float32: Iterable[KeepEntry] = (),
    *,
    amp_level: str | None = None,
    keep_bfloat16: Iterable[KeepEntry] = (),
    float8: Float8Options | None = None,
    plan: PlanLike | None = None,
    keep_inputs: Iterable[str] = (),
) -> M:
    """Prepare ``model`` for mixed precision in place and return it.

    ``policy``: a ``Policy`` or name (``None``: the global policy, or ``"auto"`` while none
    was set, which says once what it chose). ``level``: ``"O0"`` to
    ``"O3"`` or ``"auto"`` (see the module docstring). ``keep_float32``: module types, name
    patterns (``"head"``, ``"blocks.*.norm"``) or modules to keep in float32. Modules already
    given a dtype with ``to_float`` keep it. The model's outputs come back in the policy's
    ``output_dtype``; integer and bool inputs are never cast.

    ``keep_inputs``: names of the forward's arguments that O2 and O3 leave as given where
    they cast the model's floating inputs to the compute dtype (regression targets,
    diffusion timesteps, a float mask); ``labels`` always is.

    ``amp_level``: MindSpore's keyword, in place of ``level``, with MindSpore's meanings: its
    O3 keeps float32 master weights (see the module docstring), and ``policy=None`` means
    ``"mixed_float16"``, MindSpore's default ``dtype``.

    Float8 policies only: ``keep_bfloat16`` (types, name patterns, modules, as
    ``keep_float32``) names Linear layers that keep bfloat16 matmuls, and ``float8``
    (``Float8Options``) sets the size rule and the output head's treatment.

    A model already in 16 bits is stored in float32 first, with a warning, at the levels
    with float32 weights or masters (O0-O2, ``amp_level="O3"``); O3 takes it as it is.

    ``plan``: a ``Plan`` (``mp.autotune``), alone: it sets policy, level and the dtype of each
    module it names (``mixprec._plan_apply``).
    """
    if not isinstance(model, nn.Module):
        raise ArgumentError(
            f"auto_mixed_precision(model=...) needs a torch.nn.Module, got {type(model).__name__}"
        )
    planned = None
    if plan is not None:
        planned = plan_arguments(
            model, plan, policy=policy, level=level, keep_float32=keep_float32,
            amp_level=amp_level, keep_bfloat16=keep_bfloat16, float8=float8,
        )  # fmt: skip
        policy, level, float8 = planned.policy, planned.level, planned.float8
        keep_float32 = planned.keep_float32
    o3_masters = False
    if amp_level is not None:
        if level != "auto":
            raise ArgumentError(
                f"auto_mixed_precision takes level= (mixprec's) or amp_level= (MindSpore's), "
                f"not both; got level={level!r}, amp_level={amp_level!r}"
            )
        key = amp_level.strip().upper() if isinstance(amp_level, str) else None
        if key not in LEVELS:
            raise ArgumentError(
                f"amp_level={amp_level!r} is invalid; valid: {', '.join(LEVELS)} "
                "(MindSpore's levels)"
            )
        level, o3_masters = key, key == "O3"
        if policy is None:  # MindSpore's default dtype, unless a mixed global policy is set
            policy = global_policy() if global_policy().is_mixed else "mixed_float16"
    if isinstance(policy, str) and policy.strip().upper() in LEVELS:
        raise ArgumentError(
            f"policy={policy!r} looks like a level: auto_mixed_precision(model, policy, level); "
            f"write auto_mixed_precision(model, 'mixed_float16', level={policy!r})"
        )
    defaulted = policy is None and global_policy() is _UNSET_GLOBAL
    resolved = get_policy("auto" if defaulted else policy)
    lvl = resolve_level(level, resolved)
    if lvl in ("O1", "O2", "O3") and not resolved.is_mixed:
        _say_level_unused(lvl, resolved)
    if hasattr(model, _APPLIED_ATTR):
        done: Applied = getattr(model, _APPLIED_ATTR)
        raise RuntimeError(
            "auto_mixed_precision() was already applied to this model "
            f"(level {done.level}, policy {done.policy.name}); apply it once, to a float32 model"
        )
    refuse_prepared_parts(model, _APPLIED_ATTR, POLICY_ATTR)
    kept_inputs = checked_keep_inputs(model.forward, keep_inputs)
    check_float64(model)  # before anything changes
    if planned is not None:
        planned.preset()  # the plan's regions in its other 16-bit dtype, which the level keeps
    # A Hugging Face model's own float32 modules join keep_float32, as HF's loading keeps them.
    declared = declared_float32(model, resolved.compute_dtype) if lvl != "O0" else []
    kept = kept_modules(model, [*keep_list(keep_float32), *declared])
    bf16_kept = kept_modules(model, keep_bfloat16, "keep_bfloat16")
    if (resolved.float8_recipe is None or lvl == "O0") and (bf16_kept or float8 is not None):
        why = "O0 computes in float32: use O1-O3" if resolved.float8_recipe else "use mixed_float8"
        raise ArgumentError(
            f"keep_bfloat16= and float8= apply to float8 policies only, at O1-O3; policy "
            f"{resolved.name!r} at {lvl} converts no layer ({why})"
        )
    if float8 is not None and not isinstance(float8, Float8Options):
        raise ArgumentError(f"float8 must be a Float8Options or None, got {type(float8).__name__}")
    # Modules the user already set with to_float keep their dtype, like keep_float32 entries.
    preset = [m for m in model.modules() if m is not model and get_region(m) is not None]
    fixed = inside([*kept.values(), *preset])
    converted: tuple[str, ...] = ()
    options, recipe = float8 or Float8Options(), resolved.float8_recipe if lvl != "O0" else None
    if recipe is not None:  # refuse what the conversion would refuse before changing anything
        check_float8(model, recipe, policy_name=resolved.name, options=options)
    check_float16_range(model, lvl, resolved.compute_dtype, fixed)  # what store_as will cast
    _lower_float64(model, lvl)
    _upcast_16bit(model, lvl, o3_masters)  # O0-O2 and MindSpore's O3 keep float32 weights
    if recipe is not None:
        choices = convert_to_float8(
            model,
            recipe,
            policy_name=resolved.name,
            float32=fixed,
            bfloat16=inside(bf16_kept.values()),
            options=options,
        )
        converted = tuple(n for n, c in choices.items() if c.converted)
        if float8 is not None and not converted:  # options given for nothing: say why
            first = next(iter(choices.items()), ("", None))
            why = f"; {first[0]!r}: {first[1].reason}" if first[1] is not None else ""
            warn_at_caller(f"auto_mixed_precision: float8= converted no Linear layer{why}")

    compute = resolved.compute_dtype if lvl != "O0" else torch.float32
    output = resolved.output_dtype if lvl != "O0" else torch.float32
    if lvl in ("O0", "O1"):
        store_as(model, torch.float32, buffers=True, skip=lambda m: id(m) in fixed)
    elif lvl == "O2":
        store_as(
            model,
            compute,
            # float8 layers keep float32 weights: torchao casts them to float8 each forward.
            skip=lambda m: id(m) in fixed or not is_half_storage(m, compute) or is_float8(m),
            keep=lambda m: id(m) in fixed or is_float8(m),  # a norm's tied weight may go
        )
    else:  # O3: no float32 copies either, unless there will be master weights
        store_as(
            model,
            compute,
            buffers=True,
            skip=lambda m: id(m) in fixed,
            keep_float32_copy=o3_masters,
        )
    if lvl == "O2" and compute == torch.float16:
        # float16's range ends at 65504. Embedding outputs start the residual stream, and
        # libraries build attention masks in its dtype from finfo(dtype).min: in float16,
        # scores + mask overflow to -inf and fully masked rows give NaN (seen with Hugging
        # Face eager attention). The tables stay float16; their outputs go on in float32,
        # as at O1.
        for sub in model.modules():
            if isinstance(sub, (nn.Embedding, nn.EmbeddingBag)) and id(sub) not in fixed:
                bag = isinstance(sub, nn.EmbeddingBag)  # per_sample_weights: the table's dtype
                set_region(sub, Region(torch.float16, torch.float32, cast_inputs=bag))
    elif lvl in ("O1", "O2"):
        # CPU autocast does not cover embedding_bag: per_sample_weights computed in the
        # compute dtype met the table's dtype in a raw "same type" error. Cast to the table's.
        for sub in model.modules():
            if isinstance(sub, nn.EmbeddingBag) and id(sub) not in fixed:
                set_region(sub, Region(sub.weight.dtype, None, cast_inputs=True))
    if lvl == "O3":
        # A module kept in float32 (keep_float32, to_float before or after this call) hands
        # float32 to the next layer. Batch norm is the one 16-bit layer that refuses it: CPU
        # autocast does not cover batch_norm, whose 16-bit weights then meet a float32 input.
        for sub in model.modules():
            if id(sub) not in fixed and isinstance(sub, nn.modules.batchnorm._NormBase):
                set_region(sub, Region(compute, None, cast_inputs=True))
    if lvl in ("O1", "O2"):
        for sub in model.modules():
            if id(sub) in fixed or sub is model or isinstance(sub, MIXED_NORM_MODULES):
                continue
            if isinstance(sub, NORM_MODULES):
                # Statistics in float32; the output goes on in the dtype it came in.
                set_region(sub, Region(torch.float32, None, output_like_input=True))
            elif isinstance(sub, FLOAT32_MODULES):
                set_region(sub, Region(torch.float32, torch.float32))
            elif lvl == "O1" and isinstance(sub, nn.Bilinear):
                # Autocast casts no bilinear: 16-bit inputs met its float32 weights in "All
                # tensors must have the same dtype". It computes in float32, as it did.
                set_region(sub, Region(torch.float32, None, output_like_input=True))

    # At O1 the first ops decide their own dtype under autocast; at O2/O3 the weights are
    # 16-bit, so inputs are cast once at the model's boundary. A float32 policy (``auto`` on a
    # CPU without fast 16-bit math) gets no region: plain PyTorch, nothing added per step. O0
    # under a mixed policy keeps its float32 region, which holds even inside a user's autocast.
    if resolved.is_mixed:
        boundary = Region(compute, output, lvl != "O1", link_sources=True, keep_inputs=kept_inputs)
        set_region(model, boundary)
        if lvl != "O0":
            _encoder_region(model, compute, lvl, fixed)
    for module in kept.values():
        to_float(module, torch.float32)

    notes: dict[str, Any] = {POLICY_ATTR: resolved, LEVEL_ATTR: lvl}
    if o3_masters:
        notes[MASTERS_ATTR] = True
    tag(model, notes, watch_loads=True)  # on the parameters, and kept for copies and loads
    keep_notes_through_to_empty(model)  # a model prepared on the meta device
    remember_model(model)
    watch_averaged_copies(model)  # a 16-bit AveragedModel stops moving: said at a step
    setattr(
        model,
        _APPLIED_ATTR,
        Applied(resolved, lvl, tuple(sorted(kept)), o3_masters, converted, plan),
    )
    if lvl == "O2" or o3_masters or (lvl != "O0" and resolved.loss_scaling == "dynamic"):
        # A plain torch optimizer stepping the 16-bit weights, or any weight of a model
        # whose float16 math needs loss scaling, warns.
        watch_plain_optimizers()
    if defaulted:
        _say_auto(resolved.name, resolved.reason or "")
    return model


def applied(model: nn.Module) -> Applied | None:
    """What ``auto_mixed_precision`` did to ``model``, or ``None``."""
    found = getattr(model, _APPLIED_ATTR, None)
    return found if isinstance(found, Applied) else None
