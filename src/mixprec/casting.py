"""Cast rules: which tensors are cast, where, and which work stays in float32.

Only floating-point tensors are ever cast. Integer, bool and complex tensors (token ids,
masks, indices) and non-tensor arguments pass through untouched.

A *region* is a module whose forward runs under one compute dtype: its floating inputs are
cast on entry, ``torch.autocast`` runs its ops in that dtype (or is switched off for
float32), and its floating outputs are cast on exit. ``auto_mixed_precision`` makes the model
a region and adds float32 regions inside it; ``to_float`` makes any module one.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import inspect
from collections import UserDict
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, TypeVar

import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode

from mixprec._device import autocast_available
from mixprec._dtypes import HALF_DTYPES, parse_dtype
from mixprec._errors import ArgumentError
from mixprec._float32_copies import (
    FP32_COPY_ATTR,
    Float32Copy,
    keep_float32_on_load,
    take_float32_copy,
)
from mixprec._output_sources import remember_source
from mixprec._param_tags import tag
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


def cast_floating(value: T, dtype: torch.dtype) -> T:
    """Return ``value`` with every floating tensor inside it cast to ``dtype``.

    Walks tuples (named tuples and ``torch.return_types`` too), lists, dicts and their
    subclasses (``OrderedDict``, Hugging Face ``ModelOutput``) and dataclass instances,
    keeping their types. Anything else is returned as it is."""
    return _cast(value, dtype, link=False)


def _cast(value: T, dtype: torch.dtype, link: bool) -> T:
    """``cast_floating``; with ``link``, each float32 upcast remembers its 16-bit source."""
    if isinstance(value, torch.Tensor):
        if value.is_floating_point() and value.dtype != dtype:
            cast = value.to(dtype)
            if link:
                remember_source(cast, value)
            return cast  # type: ignore[return-value]
        return value  # type: ignore[return-value]
    # Leaves first: dynamo (torch 2.11) cannot trace is_dataclass's hasattr on NoneType.
    if value is None or isinstance(value, (int, float, str)):
        return value
    if isinstance(value, tuple):
        items = [_cast(v, dtype, link) for v in value]
        if hasattr(value, "_fields"):  # named tuple
            return type(value)(*items)  # type: ignore[return-value]
        if type(value) is not tuple:  # struct sequences such as torch.return_types.max
            return type(value)(items)  # type: ignore[call-arg]
        return tuple(items)  # type: ignore[return-value]
    if isinstance(value, list):
        return type(value)(_cast(v, dtype, link) for v in value)  # type: ignore[return-value]
    # A dataclass before a dict (transformers' ModelOutput is both): rebuilt by its
    # constructor, as dataclasses.replace does and as a model's forward builds it, which
    # dynamo traces; copy.copy it does not (torch 2.11: a graph break).
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        fields = dataclasses.fields(value)
        changes = {f.name: _cast(getattr(value, f.name), dtype, link) for f in fields if f.init}
        rebuilt: Any = type(value)(**changes)
        for f in fields:  # init=False fields (an auxiliary loss set after construction)
            if not f.init and hasattr(value, f.name):
                object.__setattr__(rebuilt, f.name, _cast(getattr(value, f.name), dtype, link))
        if isinstance(value, dict):  # keys set after construction are not fields
            for k, v in value.items():
                if k not in changes:
                    rebuilt[k] = _cast(v, dtype, link)
        return rebuilt  # type: ignore[no-any-return]
    if type(value) is dict:
        return {k: _cast(v, dtype, link) for k, v in value.items()}  # type: ignore[attr-defined, return-value]
    if isinstance(value, (dict, UserDict)):  # a UserDict: transformers' BatchEncoding
        out = copy.copy(value)  # keeps the subclass and its attributes
        for k, v in value.items():
            out[k] = _cast(v, dtype, link)
        return out
    if link:  # the model's own output (not a region's input): what reaches the loss
        say_if_unwalked(value, dtype)
    return value


# Functions that run in float32 inside 16-bit regions. CUDA's autocast already runs these in
# float32; CPU autocast runs softmax, layer_norm and friends in the 16-bit dtype, where
# exp/log and mean/variance reductions lose the precision that losses and normalisation need.
# batch_norm/instance_norm are not here: their running statistics are updated in place, and a
# cast would update a copy. Their modules are float32 regions instead (see levels.py).
# Losses return float32; the others return their input's dtype, so that the next layer (a
# bfloat16 BatchNorm at O3, say) receives the dtype it was built for.
FLOAT32_LOSSES: frozenset[Callable[..., Any]] = frozenset(
    {
        F.cross_entropy, F.nll_loss, F.ctc_loss, F.kl_div, F.binary_cross_entropy,
        F.binary_cross_entropy_with_logits, F.mse_loss, F.l1_loss, F.smooth_l1_loss,
        F.huber_loss, F.poisson_nll_loss, F.gaussian_nll_loss, F.cosine_embedding_loss,
        F.margin_ranking_loss, F.soft_margin_loss, F.multilabel_soft_margin_loss,
        F.multi_margin_loss, F.triplet_margin_loss,
    }
)  # fmt: skip
FLOAT32_FUNCTIONS: frozenset[Callable[..., Any]] = FLOAT32_LOSSES | frozenset(
    {
        F.softmax, F.log_softmax, F.softmin, torch.softmax, torch.log_softmax,
        torch.Tensor.softmax, torch.Tensor.log_softmax,
        F.layer_norm, F.group_norm, F.rms_norm,
        torch.logsumexp, torch.Tensor.logsumexp, torch.cumsum, torch.Tensor.cumsum,
        torch.cumprod, torch.Tensor.cumprod,
        torch.norm, torch.Tensor.norm, torch.linalg.vector_norm,
    }
)  # fmt: skip


#: torch.nn modules whose own ``forward`` calls none of ``FLOAT32_FUNCTIONS`` (exact types:
#: a subclass may override ``forward``). A region made only of these needs no
#: ``Float32Functions`` mode, whose Python handler would otherwise run on every op: about
#: 10% of a small MLP's step (mlp-b64: 0.78 ms against autocast's 0.71 ms).
PLAIN_MODULES: frozenset[type[nn.Module]] = frozenset(
    {
        nn.Sequential, nn.ModuleList, nn.ModuleDict, nn.Identity, nn.Flatten, nn.Unflatten,
        nn.Linear, nn.Bilinear, nn.Embedding, nn.EmbeddingBag,
        nn.Conv1d, nn.Conv2d, nn.Conv3d,
        nn.ConvTranspose1d, nn.ConvTranspose2d, nn.ConvTranspose3d,
        nn.ReLU, nn.ReLU6, nn.LeakyReLU, nn.PReLU, nn.ELU, nn.SELU, nn.CELU, nn.GELU, nn.SiLU,
        nn.Mish, nn.Tanh, nn.Sigmoid, nn.Hardtanh, nn.Hardswish, nn.Hardsigmoid,
        nn.Dropout, nn.Dropout1d, nn.Dropout2d, nn.Dropout3d, nn.AlphaDropout,
        nn.MaxPool1d, nn.MaxPool2d, nn.MaxPool3d, nn.AvgPool1d, nn.AvgPool2d, nn.AvgPool3d,
        nn.AdaptiveAvgPool1d, nn.AdaptiveAvgPool2d, nn.AdaptiveAvgPool3d,
        nn.AdaptiveMaxPool1d, nn.AdaptiveMaxPool2d, nn.AdaptiveMaxPool3d,
        nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d,
    }
)  # fmt: skip


def needs_float32_functions(module: nn.Module) -> bool:
    """Whether ``module``'s forward may call a ``FLOAT32_FUNCTIONS`` member in 16 bits: true
    unless every module inside is a ``PLAIN_MODULES`` type or a float32 region (which runs
    its functions in float32 anyway). Forward hooks are not inspected."""
    for child in module.children():
        region = get_region(child)
        if region is not None and (region.compute_dtype == torch.float32 or region.plain):
            continue
        if needs_float32_functions(child):
            return True
    return type(module) not in PLAIN_MODULES


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
        if func not in FLOAT32_FUNCTIONS or kwargs.get("out") is not None:
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
        if func in FLOAT32_LOSSES or first is None or asked:
            return result
        return cast_floating(result, first.dtype)


@dataclass(frozen=True)
class Region:
    """How a module's forward runs: compute dtype, output dtype, and input casting.

    ``output_like_input``: return floating outputs in the dtype the first floating input
    arrived in (a normalisation island computes in float32 but hands the next layer what it
    would have had, so no extra cast happens downstream).

    ``link_sources``: a float32 output upcast from 16 bits keeps its source, for a loss that
    can use it (``mixprec.cross_entropy``; see ``_output_sources``). Set on the model's own
    region only, where the loss reads the outputs.

    ``plain``: the module and everything inside it call none of ``FLOAT32_FUNCTIONS`` (a
    torchao float8 Linear), so no ``Float32Functions`` mode runs for it: its Python handler
    would see every cast and amax of torchao's float8 scaling, for nothing."""

    compute_dtype: torch.dtype
    output_dtype: torch.dtype | None
    cast_inputs: bool = True
    output_like_input: bool = False
    link_sources: bool = False
    plain: bool = False


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


def _device_type(module: nn.Module, args: Any) -> str:
    tensor = first_floating(args)
    if tensor is None:
        tensor = next(module.parameters(), None)
    return tensor.device.type if tensor is not None else "cpu"


# Bumped by every set_region/clear_region: a region's cached "needs the Float32Functions mode"
# depends on the regions below it, which may change after it was made (to_float on a child).
_generation = 0


class _RegionForward:
    """A region's forward: the module's own forward inside ``with`` blocks.

    Installed as the module's ``forward`` attribute, so that ``torch.compile`` traces the
    autocast and ``Float32Functions`` contexts as the ``with`` blocks they are (a context
    entered in a pre-hook and left in a post-hook cannot be traced). The casts of inputs and
    outputs happen here too, not in hooks: torch.compile runs a compiled model's own hooks
    outside its graph, where a cast would be a second graph. Forward hooks therefore see a
    region's output before its output cast, in the dtype it was computed in.
    """

    def __init__(self, module: nn.Module, region: Region) -> None:
        self.module = module
        self.region = region
        # An instance-level forward the module already had (a library's wrapper): run it.
        self.inner: Callable[..., Any] | None = module.__dict__.get("forward")
        self._needs_mode = False
        self._generation = -1  # of the cached _needs_mode

    def _run_forward(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        if self.inner is not None:
            return self.inner(*args, **kwargs)
        # Called through the class, not a bound method made with __get__: after a graph break
        # in the model, dynamo resumes this frame only in this form (the other re-entered it
        # with every break, up to its recompile limit, and fell back to eager).
        return type(self.module).forward(self.module, *args, **kwargs)

    @property
    def __signature__(self) -> inspect.Signature:
        # Hugging Face's Trainer reads forward's signature to choose the dataset columns.
        return inspect.signature(self.inner or type(self.module).forward.__get__(self.module))

    def _float32_functions(self) -> bool:
        if self._generation != _generation:
            needs = needs_float32_functions(self.module)
            if torch.compiler.is_compiling():
                return needs  # no cache write while tracing: it would be a guard to fail
            self._needs_mode, self._generation = needs, _generation
        return self._needs_mode

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        region = self.region
        compute = region.compute_dtype
        device_type = _device_type(self.module, args)
        arriving = first_floating(args) if region.output_like_input else None
        saves = None
        if region.cast_inputs:
            given = args
            args, kwargs = cast_floating((args, kwargs), compute)
            if compute == torch.float32:
                saves = keep_16bit_sources(given, args)
        autocast: contextlib.AbstractContextManager[Any] = contextlib.nullcontext()
        mode: contextlib.AbstractContextManager[Any] = contextlib.nullcontext()
        if autocast_available(device_type):
            if compute == torch.float32:
                autocast = torch.autocast(device_type, enabled=False)
            else:
                autocast = torch.autocast(device_type, dtype=compute)
                # CUDA's autocast already runs these functions in float32.
                if device_type != "cuda" and not region.plain and self._float32_functions():
                    mode = Float32Functions()
        with autocast, mode, saves if saves is not None else contextlib.nullcontext():
            output = self._run_forward(args, kwargs)
        dtype = arriving.dtype if arriving is not None else region.output_dtype
        if dtype is None or output is None:
            return output
        # The link is a Python attribute on a tensor: a compiled graph's outputs cannot carry
        # one (losses.cross_entropy says so once when it meets such an output).
        link = region.link_sources and not torch.compiler.is_compiling()
        return _cast(output, dtype, link=link)


def set_region(module: nn.Module, region: Region) -> None:
    """Make ``module`` a region, replacing any region it had."""
    global _generation
    clear_region(module)
    module.forward = _RegionForward(module, region)  # type: ignore[method-assign]
    setattr(module, REGION_ATTR, region)
    _generation += 1


def clear_region(module: nn.Module) -> None:
    """Undo ``set_region``: the module's forward is its own again."""
    global _generation
    forward = module.__dict__.get("forward")
    if isinstance(forward, _RegionForward):
        if forward.inner is None:
            del module.forward
        else:
            module.forward = forward.inner  # type: ignore[method-assign]
    if REGION_ATTR in module.__dict__:
        delattr(module, REGION_ATTR)
    _generation += 1


def get_region(module: nn.Module) -> Region | None:
    region = getattr(module, REGION_ATTR, None)
    return region if isinstance(region, Region) else None


def store_as(
    module: nn.Module,
    dtype: torch.dtype,
    *,
    recurse: bool = True,
    buffers: bool = False,
    skip: Callable[[nn.Module], bool] = lambda m: False,
    keep_float32_copy: bool = True,
) -> None:
    """Store the floating parameters (and optionally buffers) of ``module`` in ``dtype``.

    Parameters keep their identity (optimizers holding them stay valid). With
    ``keep_float32_copy``, a float32 parameter going to 16 bits keeps its float32 values so
    that ``LossScaleOptimizer`` starts its master weights from them rather than from the
    rounded 16-bit values, and going back to float32 restores them, as long as the
    parameter was not written to since (``take_float32_copy``).
    """
    copies: list[tuple[nn.Parameter, Float32Copy]] = []

    def convert(t: torch.Tensor) -> torch.Tensor:
        if not t.is_floating_point() or t.dtype == dtype:
            return t
        if isinstance(t, nn.Parameter):
            if dtype == torch.float32:
                original = take_float32_copy(t)
                if original is not None:
                    return original
            elif keep_float32_copy and dtype in HALF_DTYPES and t.dtype == torch.float32:
                record = Float32Copy(t.detach())
                setattr(t, FP32_COPY_ATTR, record)
                copies.append((t, record))
        return t.to(dtype)

    hooked: list[nn.Module] = []

    modules = module.modules() if recurse else iter([module])
    for sub in modules:
        if skip(sub):
            continue
        kept = set() if buffers else {id(b) for b in sub._buffers.values() if b is not None}

        def apply(t: torch.Tensor, kept: set[int] = kept) -> torch.Tensor:
            # Module._apply passes parameters, their gradients and buffers through here.
            return t if id(t) in kept else convert(t)

        # Module._apply keeps Parameter objects (it assigns .data) and lets modules such as
        # RNNs refresh their derived state after the change.
        before = len(copies)
        sub._apply(apply, recurse=False)
        if len(copies) > before:
            hooked.append(sub)
    for param, record in copies:
        record.version = param._version
    for sub in hooked:  # a float32 checkpoint loaded later keeps its values for the masters
        keep_float32_on_load(sub)


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


def to_float(module: M, dtype: str | torch.dtype) -> M:
    """Run ``module`` in ``dtype``, as MindSpore's ``Cell.to_float``.

    Floating inputs are cast to ``dtype`` on entry, the forward runs under ``dtype``
    (``torch.autocast`` off for float32), and floating outputs leave in ``dtype``. For float32
    the module's parameters are also stored in float32 (restoring the original float32 values
    when ``auto_mixed_precision`` had stored them in 16 bits). Returns ``module``.
    """
    if not isinstance(module, nn.Module):
        raise ArgumentError(
            f"to_float(module=...) needs a torch.nn.Module, got {type(module).__name__}"
        )
    target = parse_dtype(dtype, argument="to_float dtype")
    if target == torch.float32:
        store_as(module, torch.float32, buffers=True)
    set_region(module, Region(compute_dtype=target, output_dtype=target, cast_inputs=True))
    # Tell LossScaleOptimizer how these weights are used (float16 math needs loss scaling).
    tag(module, {COMPUTE_ATTR: target})
    return module
