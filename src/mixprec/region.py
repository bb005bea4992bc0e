"""Regions: a module whose forward runs under one compute dtype, and ``to_float``.

A region's floating inputs are cast on entry, ``torch.autocast`` runs its ops in the compute
dtype (or is switched off for float32), and its floating outputs are cast on exit.
``auto_mixed_precision`` makes the model a region and adds float32 regions inside it;
``to_float`` makes any module one. The cast rules themselves are in ``casting``.
"""

from __future__ import annotations

import contextlib
import inspect
import itertools
import types
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import torch
from torch import nn

from mixprec._device import autocast_available
from mixprec._dtypes import parse_dtype
from mixprec._errors import ArgumentError
from mixprec._input_casts import InputLook, cast_inputs, positional_names
from mixprec._param_tags import tag
from mixprec._rebuilt import Casts, write_back
from mixprec._upcast_saves import keep_16bit_sources
from mixprec.casting import (
    COMPUTE_ATTR,
    REGION_ATTR,
    Float32Functions,
    cast_linked,
    first_floating,
    store_as,
)

__all__ = [
    "PLAIN_MODULES",
    "Region",
    "clear_region",
    "get_region",
    "needs_float32_functions",
    "set_region",
    "to_float",
]

M = TypeVar("M", bound=nn.Module)


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
    would see every cast and amax of torchao's float8 scaling, for nothing.

    ``keep_inputs``: set on the model's own region, with ``labels`` always among them."""

    compute_dtype: torch.dtype
    output_dtype: torch.dtype | None
    cast_inputs: bool = True
    output_like_input: bool = False
    link_sources: bool = False
    plain: bool = False
    #: The prepared model's own region (its inputs are the caller's): the arguments named
    #: here pass the cast as given, and its first forwards look at the cast (_input_casts).
    keep_inputs: frozenset[str] | None = None


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
        self._look = InputLook() if region.keep_inputs is not None else None
        # The names of forward's positional arguments (keep_inputs names them).
        self._positional = positional_names(self) if region.keep_inputs is not None else []

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

    @property
    def __code__(self) -> types.CodeType:
        # torch.export (non-strict) names its shape environment after forward's code.
        forward = self.inner or type(self.module).forward
        return getattr(forward, "__code__", _RegionForward.__call__.__code__)  # type: ignore[no-any-return]

    def cast_at_boundary(self, args: Any, kwargs: Any) -> tuple[Any, Any, list[Any] | None]:
        """The model's inputs cast but those its region keeps, and the copies to watch for
        writes in its first forwards (eager, 16-bit: ``InputLook``), for ``after_forward``.
        Fabric's ``convert_input``, which casts before the model, calls it too."""
        compute, names = self.region.compute_dtype, self.region.keep_inputs or frozenset()
        args_cast, kwargs_cast, casts = cast_inputs(args, kwargs, compute, names, self._positional)
        look = self._look
        eager = not torch.compiler.is_compiling()
        watched: list[Any] | None = None
        if eager and look is not None and compute != torch.float32 and look.due():
            cast = (args_cast, kwargs_cast)
            watched = look.before((args, kwargs), cast, self._positional, compute)
        if casts is not None:  # containers rebuilt: what the model sets in them goes back
            watched = [*(watched or []), casts]
        return args_cast, kwargs_cast, watched

    def after_forward(self, watched: list[Any] | None) -> None:
        """Write back what the model set in rebuilt containers, and say a write of the
        model into a cast copy (a first forward's look), among ``watched``."""
        if not watched:
            return
        for casts in watched:
            if isinstance(casts, Casts):
                write_back(casts)
        if self._look is not None:
            self._look.after([w for w in watched if not isinstance(w, Casts)])

    def _float32_functions(self) -> bool:
        if self._generation != _generation:
            needs = needs_float32_functions(self.module)
            if torch.compiler.is_compiling():
                return needs  # no cache write while tracing: it would be a guard to fail
            self._needs_mode, self._generation = needs, _generation
            for sub in self.module.modules():  # a module added to one of these: look again
                sub.__dict__[_WALKED] = True
        return self._needs_mode

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        region = self.region
        compute = region.compute_dtype
        device_type = _device_type(self.module, args)
        arriving = first_floating(args) if region.output_like_input else None
        saves = None
        watched = None
        if region.cast_inputs and region.keep_inputs is not None:  # the model's boundary
            args, kwargs, watched = self.cast_at_boundary(args, kwargs)
        elif region.cast_inputs:  # an island inside: containers written back too
            given = args
            args, kwargs, casts = cast_inputs(args, kwargs, compute, frozenset(), [])
            watched = None if casts is None else [casts]
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
        saving = saves if saves is not None else contextlib.nullcontext()
        if not watched:  # no try block: dynamo resumes after a graph break outside one only
            with autocast, mode, saving:
                output = self._run_forward(args, kwargs)
        else:  # rebuilt containers, a first forward's cast copies: looked at after it,
            try:  # also after an exception (what the model set so far is the caller's)
                with autocast, mode, saving:
                    output = self._run_forward(args, kwargs)
            finally:
                self.after_forward(watched)
        dtype = arriving.dtype if arriving is not None else region.output_dtype
        if dtype is None or output is None:
            return output
        # The link is a Python attribute on a tensor: a compiled graph's outputs cannot carry
        # one (losses.cross_entropy says so once when it meets such an output).
        link = region.link_sources and not torch.compiler.is_compiling()
        return cast_linked(output, dtype, link=link, outputs=True)


_WALKED = "_mixprec_walked"  # a module some region's cached answer was read from


def _module_added(module: nn.Module, name: str, submodule: nn.Module | None) -> None:
    """A module registered on one a region's cached "needs Float32Functions" answer was read
    from (a head appended to a prepared model after its first forward): the answers are
    stale, else the new module's ``F.log_softmax`` ran in 16 bits. Modules built elsewhere
    change nothing (a compiled model guards on the counter: each bump is a recompile)."""
    global _generation
    if module.__dict__.get(_WALKED):
        _generation += 1


torch.nn.modules.module.register_module_module_registration_hook(_module_added)


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


def to_float(module: M, dtype: str | torch.dtype) -> M:
    """Run ``module`` in ``dtype``, as MindSpore's ``Cell.to_float``.

    Floating inputs are cast to ``dtype`` on entry, the forward runs under ``dtype``
    (``torch.autocast`` off for float32), and floating outputs leave in ``dtype`` (but a
    float64 output, and a float32 scalar where ``dtype`` is 16-bit: ``casting._kept_wide``).
    For float32 the module's parameters are also stored in float32 (restoring the original
    float32 values when ``auto_mixed_precision`` had stored them in 16 bits), and the
    regions inside it that computed in 16 bits are removed (a later ``to_float`` of a child
    sets one again). Returns ``module``.
    """
    if not isinstance(module, nn.Module):
        raise ArgumentError(
            f"to_float(module=...) needs a torch.nn.Module, got {type(module).__name__}"
        )
    target = parse_dtype(dtype, argument="to_float dtype")
    if target == torch.float32:
        store_as(module, torch.float32, buffers=True)
        # The whole module in float32, as MindSpore's recursive to_float: a 16-bit region
        # inside (O3's norms, an O2 EmbeddingBag) cast on to 16 bits what then met float32
        # weights, and the forward failed on dtypes.
        for sub in itertools.islice(module.modules(), 1, None):
            inner = get_region(sub)
            if inner is not None and inner.compute_dtype != torch.float32:
                clear_region(sub)
    set_region(module, Region(compute_dtype=target, output_dtype=target, cast_inputs=True))
    # Tell LossScaleOptimizer how these weights are used (float16 math needs loss scaling).
    tag(module, {COMPUTE_ATTR: target})
    return module
