"""Cast rules: which tensors are cast, and which functions run in float32 inside 16 bits.

Only floating-point tensors are ever cast. Integer, bool and complex tensors (token ids,
masks, indices) and non-tensor arguments pass through untouched. ``store_as`` and
``upcast_16bit`` change how a module's weights are stored. Regions, the modules whose forward
runs under one compute dtype, are in ``region``.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
from collections import UserDict, defaultdict
from collections.abc import Callable, Mapping
from typing import Any, TypeVar

import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode

from mixprec._aliases import Memory, memory_of
from mixprec._dtypes import HALF_DTYPES, parse_dtype
from mixprec._errors import ArgumentError
from mixprec._float32_copies import (
    FP32_COPY_ATTR,
    Float32Copy,
    keep_float32_on_load,
    take_float32_copy,
)
from mixprec._live_masters import float32_start, forget_gone_master, say_masters_gone
from mixprec._output_sources import remember_source
from mixprec._rebuilt import Casts
from mixprec._unwalked_outputs import say_if_unwalked
from mixprec._upcast_saves import keep_16bit_sources

T = TypeVar("T")
M = TypeVar("M", bound=nn.Module)

# Attribute names mixprec sets on parameters and modules.
LEVEL_ATTR = "_mixprec_level"  # level the parameter's model was prepared with
MASTERS_ATTR = "_mixprec_masters"  # O3 parameter that still gets a float32 master (MindSpore)
COMPUTE_ATTR = "_mixprec_compute"  # dtype the parameter's math runs in (to_float)
POLICY_ATTR = "_mixprec_policy"  # policy the parameter's model was prepared with
REGION_ATTR = "_mixprec_region"


def cast_floating(value: T, dtype: torch.dtype | str) -> T:
    """Return ``value`` with every floating tensor inside it cast to ``dtype``.

    Walks tuples (named tuples and ``torch.return_types`` too), lists, dicts and their
    subclasses (``OrderedDict``, Hugging Face ``ModelOutput``) and dataclass instances,
    keeping their types. Anything else is returned as it is. ``dtype``: a floating
    ``torch.dtype`` or its name (``"bfloat16"``, ``"bf16"``), as ``to_float`` takes it."""
    if not isinstance(dtype, torch.dtype):
        dtype = parse_dtype(dtype, argument="dtype")  # "float16" was taken for a device
    elif not dtype.is_floating_point:  # torch.int8 truncated every float
        raise ArgumentError(f"dtype={dtype!r} is invalid; a floating dtype casts floating tensors")
    return cast_linked(value, dtype, link=False)


def cast_linked(
    value: T, dtype: torch.dtype, link: bool, casts: Casts | None = None, outputs: bool = False
) -> T:
    """``cast_floating``; with ``link``, each float32 upcast remembers its 16-bit source;
    with ``casts``, each object the cast makes and each container it rebuilds is noted
    there (a region's inputs: ``_rebuilt.write_back`` after the forward), and a container
    met twice is rebuilt once. ``outputs``: a region's outputs, where what the forward
    made wide on purpose stays so (``_kept_wide``)."""
    if isinstance(value, torch.Tensor):
        if value.is_floating_point() and value.dtype != dtype:
            if outputs and _kept_wide(value, dtype):
                return value
            cast = value.to(dtype)
            if link:
                remember_source(cast, value)
            if casts is not None:
                casts.made.append((cast, value))
            return cast  # type: ignore[return-value]
        return value  # type: ignore[return-value]
    # Leaves first: dynamo (torch 2.11) cannot trace is_dataclass's hasattr on NoneType.
    if value is None or isinstance(value, (int, float, str)):
        return value
    # A mutable container whose members all come back as they were is returned itself: a model
    # that fills a dict or list it is given (a KV cache, auxiliary losses) fills the
    # caller's, as it would without mixprec.
    if isinstance(value, tuple):  # immutable: rebuilt (dynamo cannot trace `is` on tuples)
        items = [cast_linked(v, dtype, link, casts, outputs) for v in value]
        if hasattr(value, "_fields"):  # named tuple
            return type(value)(*items)  # type: ignore[return-value]
        if type(value) is not tuple:  # struct sequences such as torch.return_types.max
            return type(value)(items)  # type: ignore[call-arg]
        return tuple(items)  # type: ignore[return-value]
    seen = casts.copy_of(value) if casts is not None else None
    if seen is not None:
        return seen  # type: ignore[no-any-return]
    if isinstance(value, list):
        items = [cast_linked(v, dtype, link, casts, outputs) for v in value]
        if _unchanged(items, value):
            return value
        listed: Any = type(value)(items)
        if casts is not None:
            casts.note(value, listed, items)
        return listed  # type: ignore[no-any-return]
    # A dataclass before a dict (transformers' ModelOutput is both): rebuilt by its
    # constructor, as dataclasses.replace does and as a model's forward builds it, which
    # dynamo traces; copy.copy it does not (torch 2.11: a graph break).
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        fields = dataclasses.fields(value)
        changes = {
            f.name: cast_linked(getattr(value, f.name), dtype, link, casts, outputs)
            for f in fields
            if f.init
        }
        later = {  # init=False fields (an auxiliary loss set after construction)
            f.name: cast_linked(getattr(value, f.name), dtype, link, casts, outputs)
            for f in fields
            if not f.init and hasattr(value, f.name)
        }
        keys: dict[Any, Any] = {}  # a dict's keys set after construction are not fields
        if isinstance(value, dict):
            keys = {
                k: cast_linked(v, dtype, link, casts, outputs)
                for k, v in value.items()
                if k not in changes
            }
        if (
            _unchanged(changes.values(), [getattr(value, k) for k in changes])
            and _unchanged(later.values(), [getattr(value, k) for k in later])
            and _unchanged(keys.values(), [value[k] for k in keys])  # type: ignore[index]
        ):
            return value
        rebuilt: Any = type(value)(**changes)
        for name, v in later.items():
            object.__setattr__(rebuilt, name, v)
        for k, v in keys.items():
            rebuilt[k] = v
        if casts is not None:
            casts.note(value, rebuilt, {**changes, **later})
        return rebuilt  # type: ignore[no-any-return]
    if isinstance(value, (dict, UserDict)):
        members = {k: cast_linked(v, dtype, link, casts, outputs) for k, v in value.items()}
        if _unchanged(members.values(), value.values()):
            return value
        out: Any = members
        if isinstance(value, defaultdict):  # dynamo cannot copy.copy one (torch 2.13)
            out = type(value)(value.default_factory, members)
        elif type(value) is not dict:
            out = copy.copy(value)  # keeps the subclass and its attributes (a UserDict:
            for k, v in members.items():  # transformers' BatchEncoding)
                out[k] = v
        if casts is not None:  # what was placed, apart from the copy the model may change
            casts.note(value, out, dict(members))
        return out  # type: ignore[no-any-return]
    if link:  # the model's own output (not a region's input): what reaches the loss
        say_if_unwalked(value, dtype)
    return value


def _kept_wide(value: torch.Tensor, dtype: torch.dtype) -> bool:
    """An output a region's cast leaves as the forward made it, as autocast would: float64
    (a likelihood kept wide on purpose became inf in float32), and a float32 scalar where
    outputs leave in 16 bits (a loss computed inside forward, a Hugging Face ``labels=``
    loss, rounded to steps of 0.0078 near 1.0 at O3)."""
    if value.dtype == torch.float64:
        return True
    return value.dim() == 0 and value.dtype == torch.float32 and dtype in HALF_DTYPES


def _unchanged(new: Any, old: Any) -> bool:
    """Whether each of ``new`` is the very object at its place in ``old``."""
    return all(a is b for a, b in zip(new, old, strict=True))


# Functions that run in float32 inside 16-bit regions. CUDA's autocast already runs these in
# float32; CPU autocast runs softmax, layer_norm and friends in the 16-bit dtype, where
# exp/log and mean/variance reductions lose the precision that losses and normalisation need.
# batch_norm/instance_norm are not here: their running statistics are updated in place, and a
# cast would update a copy. Their modules are float32 regions instead (see levels.py).
# Losses return float32; the others return their input's dtype (float16's unbounded results
# and math excepted), so that the next layer (a bfloat16 BatchNorm at O3, say) receives the
# dtype it was built for.
FLOAT32_LOSSES: frozenset[Callable[..., Any]] = frozenset(
    {
        F.cross_entropy, F.nll_loss, F.ctc_loss, F.kl_div, F.binary_cross_entropy,
        F.binary_cross_entropy_with_logits, F.mse_loss, F.l1_loss, F.smooth_l1_loss,
        F.huber_loss, F.poisson_nll_loss, F.gaussian_nll_loss, F.cosine_embedding_loss,
        F.margin_ranking_loss, F.soft_margin_loss, F.multilabel_soft_margin_loss,
        F.multi_margin_loss, F.triplet_margin_loss,
    }
)  # fmt: skip
# Their results grow with the input's length or size: rounded back to float16 they can pass
# 65504 (a running sum over 4096 steps of values near 20 became inf). For float16 inputs
# they stay float32, as CUDA's autocast returns them; bfloat16 has float32's range.
UNBOUNDED_FUNCTIONS: frozenset[Callable[..., Any]] = frozenset(
    {
        torch.logsumexp, torch.Tensor.logsumexp, torch.cumsum, torch.Tensor.cumsum,
        torch.cumprod, torch.Tensor.cumprod,
        torch.norm, torch.Tensor.norm, torch.linalg.vector_norm,
    }
)  # fmt: skip
# The math of CUDA autocast's float32 list that CPU autocast leaves in 16 bits, for what a
# forward writes by hand (an InfoNCE's exp(sim / 0.07), a log-variance's exp, 1 / p, x ** 2,
# .sum()): exp(14.3) is inf in float16, and log's backward (1/p) overflows below p = 1.5e-5.
# Like UNBOUNDED_FUNCTIONS: float32 results for float16 inputs, as CUDA returns them;
# bfloat16 (float32's range) rounded back once, so that what follows keeps its dtype (a
# top-k router's w / w.sum() into a bfloat16 index_add_ failed on float32).
FLOAT32_MATH: frozenset[Callable[..., Any]] = frozenset(
    {
        torch.exp, torch.Tensor.exp, torch.expm1, torch.Tensor.expm1,
        torch.log, torch.Tensor.log, torch.log1p, torch.Tensor.log1p,
        torch.log2, torch.Tensor.log2, torch.log10, torch.Tensor.log10,
        torch.pow, torch.Tensor.pow, torch.reciprocal, torch.Tensor.reciprocal,
        torch.rsqrt, torch.Tensor.rsqrt,
        torch.acos, torch.Tensor.acos, torch.asin, torch.Tensor.asin, torch.cosh,
        torch.Tensor.cosh, torch.sinh, torch.Tensor.sinh, torch.tan, torch.Tensor.tan,
        torch.erfinv, torch.Tensor.erfinv,
        torch.sum, torch.Tensor.sum, torch.prod, torch.Tensor.prod,
        F.softplus, F.cosine_similarity, torch.cosine_similarity, F.normalize,
        F.pdist, torch.pdist, torch.dist, torch.Tensor.dist, torch.renorm, torch.Tensor.renorm,
    }
)  # fmt: skip
# x ** y, y ** x and y / x: FLOAT32_MATH too, compared by identity, as dynamo (torch 2.13)
# evaluates a set's membership of these methods wrongly (a guard failed on the frame that
# made it, and torch.compile of a model using ** raised).
_POW, _RPOW, _RDIV = torch.Tensor.__pow__, torch.Tensor.__rpow__, torch.Tensor.__rtruediv__
_LIKE_INPUT: frozenset[Callable[..., Any]] = frozenset(
    {
        F.softmax, F.log_softmax, F.softmin, torch.softmax, torch.log_softmax,
        torch.Tensor.softmax, torch.Tensor.log_softmax,
        F.layer_norm, F.group_norm, F.rms_norm,
    }
)  # fmt: skip
FLOAT32_FUNCTIONS = _LIKE_INPUT | FLOAT32_LOSSES | UNBOUNDED_FUNCTIONS | FLOAT32_MATH
# Those whose float16 results stay float32 (they grow past 65504, or overflow there).
_WIDE_FOR_FLOAT16 = UNBOUNDED_FUNCTIONS | FLOAT32_MATH


class Float32Functions(TorchFunctionMode):
    """Runs ``FLOAT32_FUNCTIONS`` on float32 inputs; every other call passes straight on."""

    def __torch_function__(
        self,
        func: Callable[..., Any],
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        kwargs = kwargs or {}
        operator = func is _POW or func is _RPOW or func is _RDIV
        if (not operator and func not in FLOAT32_FUNCTIONS) or kwargs.get("out") is not None:
            # out=: the caller's buffer, in the caller's dtype, is what gets written.
            return func(*args, **kwargs)
        first = first_floating(args)
        if first is not None and first.dtype == torch.float64:  # more than float32 already
            return func(*args, **kwargs)
        given = args
        args, kwargs = cast_floating((args, kwargs), torch.float32)
        saves = keep_16bit_sources(given, args)
        with saves if saves is not None else contextlib.nullcontext():
            result = func(*args, **kwargs)
        # A loss, or an output dtype the caller asked for (softmax(x, -1, dtype) or
        # softmax(x, -1, dtype=dtype)), stays.
        asked = kwargs.get("dtype") is not None or any(isinstance(a, torch.dtype) for a in args)
        if first is None or asked or (not operator and func in FLOAT32_LOSSES):
            return result
        if first.dtype == torch.float16 and (operator or func in _WIDE_FOR_FLOAT16):
            return result
        return cast_floating(result, first.dtype)


def first_floating(value: Any) -> torch.Tensor | None:
    """The first floating-point tensor in ``value`` (tuples, lists, dict values), or None."""
    if isinstance(value, torch.Tensor):
        return value if value.is_floating_point() else None
    if isinstance(value, (tuple, list)):
        for v in value:
            found = first_floating(v)
            if found is not None:
                return found
    if isinstance(value, Mapping):
        return first_floating(list(value.values()))
    return None


def store_as(
    module: nn.Module,
    dtype: torch.dtype,
    *,
    recurse: bool = True,
    buffers: bool = False,
    skip: Callable[[nn.Module], bool] = lambda m: False,
    keep_float32_copy: bool = True,
    keep: Callable[[nn.Module], bool] | None = None,
) -> None:
    """Store the floating parameters (and optionally buffers) of ``module`` in ``dtype``.

    ``keep``: the skipped modules whose weights stay as they are under every alias too
    (``skip`` where not given); another skipped module's weight follows its aliases.

    Parameters keep their identity (optimizers holding them stay valid). With
    ``keep_float32_copy``, a float32 parameter going to 16 bits keeps its float32 values so
    that ``LossScaleOptimizer`` starts its master weights from them rather than from the
    rounded 16-bit values, and going back to float32 restores them, as long as the
    parameter was not written to since (``take_float32_copy``).
    """
    copies: list[tuple[nn.Parameter, Float32Copy]] = []
    # A second Parameter over a weight's memory (nn.Parameter(emb.weight)) gets the same
    # converted tensor: cast on its own, it was untied from the weight.
    done: dict[Memory, torch.Tensor] = {}

    def convert(t: torch.Tensor) -> torch.Tensor:
        if not t.is_floating_point() or t.dtype == dtype:
            return t
        memory = memory_of(t)
        out = done.get(memory) if memory is not None else None
        if out is None:
            out = _converted(t)
            if memory is not None:
                done[memory] = out
        # Each Parameter gone 16-bit its own note of its float32 values, for a load under
        # its name (an alias too; one kept float32 under a kept module's weight has none).
        half = out.dtype in HALF_DTYPES and t.dtype == torch.float32
        if keep_float32_copy and half and isinstance(t, nn.Parameter):
            record = Float32Copy(t.detach())
            setattr(t, FP32_COPY_ATTR, record)
            copies.append((t, record))
        return out

    gone: list[bool] = []  # weights whose masters' optimizer is gone: widened from roundings

    def _converted(t: torch.Tensor) -> torch.Tensor:
        if isinstance(t, nn.Parameter) and dtype == torch.float32:
            values, lost = float32_start(t)  # kept values, or a live master's: not the rounding
            if lost and forget_gone_master(t):
                gone.append(True)
            return values
        return t.to(dtype)

    modules = list(module.modules() if recurse else [module])
    for sub in modules:  # a weight a kept module holds stays as it is under its aliases
        if (keep or skip)(sub):
            done.update((m, p) for p in sub.parameters(False) if (m := memory_of(p)) is not None)
    for sub in modules:
        if skip(sub):
            continue
        kept = set() if buffers else {id(b) for b in sub._buffers.values() if b is not None}

        def apply(t: torch.Tensor, kept: set[int] = kept) -> torch.Tensor:
            # Module._apply passes parameters, their gradients and buffers through here.
            return t if id(t) in kept else convert(t)

        # Module._apply keeps Parameter objects (it assigns .data) and lets modules such as
        # RNNs refresh their derived state after the change.
        sub._apply(apply, recurse=False)
    # A float32 checkpoint loaded later keeps its values for the masters: under every name
    # of a weight, so every module holding one (a tied head as well as its embedding).
    noted = {id(p) for p, _ in copies}
    for sub in modules:
        if any(id(p) in noted for p in sub._parameters.values() if p is not None):
            keep_float32_on_load(sub)
    say_masters_gone(len(gone), "storing the model in float32 (mp.to_float) widens")


def upcast_16bit(module: nn.Module) -> list[tuple[str, torch.dtype, bool]]:
    """Store the 16-bit parameters and buffers of ``module`` in float32 (parameters keep
    their identity); a parameter with a current float32 copy (``take_float32_copy``) gets
    those values back. Returns, for each tensor upcast: ``"parameter"`` or ``"buffer"``, its
    16-bit dtype, and whether its float32 values were restored."""
    kinds = {id(t): "buffer" for t in module.buffers() if t.dtype in HALF_DTYPES}
    kinds.update({id(p): "parameter" for p in module.parameters() if p.dtype in HALF_DTYPES})
    done: list[tuple[str, torch.dtype, bool]] = []
    if not kinds:
        return done

    def upcast(t: torch.Tensor) -> torch.Tensor:  # Module._apply passes gradients here too
        if t.dtype not in HALF_DTYPES:
            return t
        kept = take_float32_copy(t) if isinstance(t, nn.Parameter) else None
        if id(t) in kinds:
            done.append((kinds.pop(id(t)), t.dtype, kept is not None))
        return t.float() if kept is None else kept

    module._apply(upcast)
    return done
