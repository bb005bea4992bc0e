"""The ``mixed_float8`` policy on torchao: which Linear layers get float8 matmuls, and why.

torchao's ``convert_to_float8_training`` swaps ``nn.Linear`` for its ``Float8Linear``, whose
forward casts input and weight to float8 E4M3 with dynamic scales computed from their amax,
and whose backward casts the output gradient (E5M2 under ``tensorwise``, E4M3 under the
rowwise recipes). mixprec only chooses the layers and records why; every float8 cast and
matmul is torchao's. Outside the converted layers the model is what ``mixed_bfloat16`` makes
it.

A Linear layer is converted when all of these hold (``describe(model)`` gives the first that
fails for each layer):

1. it is not kept: ``keep_float32``, ``keep_bfloat16``, ``to_float`` modules and everything
   inside them stay as they are;
2. its type is exactly ``nn.Linear``: a subclass may have a forward of its own, and
   ``MultiheadAttention`` reads its ``out_proj`` weight without calling the module, so a
   swapped ``out_proj`` would show float8 and compute bfloat16;
3. ``in_features`` and ``out_features`` are multiples of 16, which float8 matmul kernels
   (``torch._scaled_mm``) require;
4. it is large enough for float8 to pay: by default torchao's thresholds for the recipe,
   measured on H100 (``tensorwise``: converted unless ``in_features <= 4096`` and
   ``out_features <= 1024``; rowwise recipes: unless ``out_features <= 2048``,
   ``in_features <= 1024``, or both ``out <= 4096`` and ``in <= 2048``). Below them the
   casts and scale computations cost more than the faster matmul saves.
   ``Float8Options(min_features=n)`` replaces this with "both dims >= n", and
   ``module_filter_fn`` (torchao's ``(module, fqn) -> bool``) with any rule;
5. it is not the output head, the last ``nn.Linear`` the model registers (the logits are
   what the loss reads, and float8's 3-bit mantissa costs most there); ``keep_head=False``
   converts it too.

Converted layers keep float32 weights at levels O1 and O2 (torchao's own mode): their weight
is cast to float8 on every forward from whatever it is stored in, so a bfloat16 copy would
add a second rounding and a master copy and save no cast. They run in a bfloat16 region:
torchao casts the input to the autocast dtype only under CUDA autocast, and a float32 input
would make the layer return float32 and, with ``rowwise_with_gw_hp``, fail in backward.

No loss scaling: each float8 cast has its own dynamic scale (per tensor or per row), so
gradients are scaled into E5M2/E4M3's range by the cast itself, and the rest of the model
is bfloat16, which has float32's exponent range.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import inspect
import logging
import re
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType

import torch
from torch import nn

from mixprec._dtypes import dtype_name
from mixprec._errors import ArgumentError
from mixprec._warn import warn_at_caller
from mixprec.policy import parse_float8_recipe
from mixprec.region import Region, set_region

__all__ = ["FLOAT8_ATTR", "Float8Choice", "Float8Options", "float8_choice", "is_float8"]

#: The ``Float8Choice`` set on every Linear layer a float8 policy considered.
FLOAT8_ATTR = "_mixprec_float8"

#: float8 matmul kernels take dims that are multiples of this.
ALIGNMENT = 16

ModuleFilter = Callable[[nn.Module, str], bool]


def _check_filter_signature(fn: Callable[..., object]) -> None:
    """torchao calls ``module_filter_fn(module, fqn)`` for every Linear: refuse, when it is
    given, a callable that cannot take two positional arguments (one that hides its
    signature, a C builtin, is let through)."""
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):
        return
    try:
        signature.bind(None, "")
    except TypeError as err:
        name = getattr(fn, "__qualname__", type(fn).__name__)
        raise ArgumentError(
            f"Float8Options(module_filter_fn={name}{signature}): torchao calls it as "
            f"fn(module, fqn) -> bool, which this signature cannot take ({err}); give a "
            "callable of two positional arguments, e.g. lambda module, fqn: ..."
        ) from None


@dataclass(frozen=True)
class Float8Options:
    """Which Linear layers a float8 policy converts (see the module docstring).

    ``min_features``: convert layers whose ``in_features`` and ``out_features`` are both at
    least this; ``None`` uses torchao's per-recipe thresholds measured on H100.
    ``keep_head``: keep the output head (the last ``nn.Linear``) in bfloat16.
    ``module_filter_fn``: torchao's ``(module, fqn) -> bool``, in place of the size rule;
    the type, alignment, keep and head rules still apply.
    ``fsdp_float8_all_gather``: FSDP2 gathers the converted layers' sharded weights in
    float8 (half of bfloat16's bytes); tensorwise recipe only, as in torchao.
    """

    min_features: int | None = None
    keep_head: bool = True
    module_filter_fn: ModuleFilter | None = None
    fsdp_float8_all_gather: bool = False

    def __post_init__(self) -> None:
        n = self.min_features
        if n is not None and (isinstance(n, bool) or not isinstance(n, int) or n < 1):
            raise ArgumentError(f"min_features={n!r} is invalid; use an int >= 1, or None")
        for name in ("keep_head", "fsdp_float8_all_gather"):
            if not isinstance(getattr(self, name), bool):
                raise ArgumentError(f"{name} must be a bool, got {getattr(self, name)!r}")
        fn = self.module_filter_fn
        if fn is not None and not callable(fn):
            raise ArgumentError(
                "module_filter_fn must be a callable (module, fqn) -> bool, got "
                f"{type(fn).__name__}"
            )
        if fn is not None:
            _check_filter_signature(fn)
            if n is not None:
                raise ArgumentError(
                    f"min_features={n!r} and module_filter_fn are both given; module_filter_fn "
                    "replaces the size rule, so min_features would be ignored: give one"
                )


@dataclass(frozen=True)
class Float8Choice:
    """What a float8 policy did with one Linear layer, and why."""

    converted: bool
    recipe: str
    #: The dtype its forward matmul runs in: torchao's E4M3 dtype when converted.
    compute: str
    reason: str


def float8_choice(module: nn.Module) -> Float8Choice | None:
    """The ``Float8Choice`` recorded on ``module``, or ``None`` (not a considered Linear)."""
    choice = getattr(module, FLOAT8_ATTR, None)
    return choice if isinstance(choice, Float8Choice) else None


def is_float8(module: nn.Module) -> bool:
    """Whether ``module`` was converted to torchao's float8 Linear by a float8 policy."""
    choice = float8_choice(module)
    return choice is not None and choice.converted


# torchao's import-time noise that says nothing about the user's model: its optional native
# kernels (``_C*.so``, built for other CUDA or Python versions) that fail to load, and
# torch's deprecation of ``register_constant()`` on the Enum classes torchao registers.
_HARMLESS_LOGS = {
    "torchao": re.compile(r"Failed to load .*_C[^/]*\.so"),
    "torch.utils._pytree": re.compile(r"is an Enum subclass .*register_constant\(\)"),
}
_HARMLESS_WARNING = r".*is an Enum subclass .*register_constant\(\)"


class _DropHarmless(logging.Filter):
    """Drops the records of one logger whose message matches ``pattern``."""

    def __init__(self, pattern: re.Pattern[str]) -> None:
        super().__init__()
        self.pattern = pattern

    def filter(self, record: logging.LogRecord) -> bool:
        return self.pattern.search(record.getMessage()) is None


def torchao_float8() -> ModuleType:
    """``torchao.float8``, or an ``ImportError`` saying how to install it.

    The import runs with torchao's known-harmless import-time log lines and warnings
    (``_HARMLESS_LOGS``) dropped; anything else it logs or warns still reaches the user."""
    filters = {name: _DropHarmless(pattern) for name, pattern in _HARMLESS_LOGS.items()}
    for name, log_filter in filters.items():
        logging.getLogger(name).addFilter(log_filter)
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=_HARMLESS_WARNING, category=FutureWarning)
            warnings.filterwarnings("ignore", message=_HARMLESS_WARNING, category=UserWarning)
            return importlib.import_module("torchao.float8")
    except ImportError as err:
        raise ImportError(
            "float8 policies (mixed_float8...) need torchao >= 0.18: "
            "pip install 'mixprec[float8]' (or pip install torchao)"
        ) from err
    finally:
        for name, log_filter in filters.items():
            logging.getLogger(name).removeFilter(log_filter)


def _pays_off(recipe: str, in_features: int, out_features: int) -> bool:
    """torchao's auto-filter thresholds (``float8_linear_utils._auto_filter_for_*``): the
    sizes where its H100 benchmarks measured float8 faster than bfloat16 for the recipe.
    ``rowwise_with_gw_hp`` has none of its own; it uses rowwise's, its forward's kernel."""
    k, n = in_features, out_features
    if recipe == "tensorwise":
        return not (k <= 4096 and n <= 1024)
    return not (n <= 2048 or k <= 1024 or (n <= 4096 and k <= 2048))


def _threshold_text(recipe: str, options: Float8Options) -> str:
    if options.min_features is not None:
        return f"smaller than min_features={options.min_features}"
    rule = (
        "in_features > 4096 or out_features > 1024"
        if recipe == "tensorwise"
        else "out_features > 2048, in_features > 1024, not both out <= 4096 and in <= 2048"
    )
    return f"below torchao's {recipe} size threshold ({rule}; measured on H100)"


def linear_refusal(module: nn.Module) -> str | None:
    """Why torchao's float8 Linear cannot replace ``module`` (exactly ``nn.Linear``, in/out
    features multiples of ``ALIGNMENT``), or ``None`` when it can. The one statement of
    that rule: conversion, ``mp.autotune`` and plans all ask it."""
    if type(module) is not nn.Linear:
        if isinstance(module, nn.Linear):
            return f"{type(module).__name__} is a Linear subclass whose forward may differ"
        kind = type(module).__name__
        return f"it is a {kind}; float8 applies to nn.Linear layers (exactly that type)"
    k, n = module.in_features, module.out_features
    if k % ALIGNMENT or n % ALIGNMENT:
        return f"in/out features {k}/{n} are not multiples of {ALIGNMENT}"
    return None


def _refusal(
    name: str,
    module: nn.Linear,
    recipe: str,
    options: Float8Options,
    head: str | None,
    float32: set[int],
    bfloat16: set[int],
    inside_attention: set[int],
) -> str | None:
    """Why ``module`` is not converted, or ``None`` when it is."""
    k, n = module.in_features, module.out_features
    if id(module) in float32:
        return "in a keep_float32 or to_float region (its own dtype, not float8)"
    if id(module) in bfloat16:
        return "kept bfloat16 (keep_bfloat16)"
    if id(module) in inside_attention:
        return "inside MultiheadAttention, which reads its weight without calling it"
    kernel = linear_refusal(module)
    if kernel is not None:
        return kernel
    if options.module_filter_fn is not None:
        if not options.module_filter_fn(module, name):
            return "module_filter_fn returned False"
    elif options.min_features is not None:
        if min(k, n) < options.min_features:
            return _threshold_text(recipe, options)
    elif not _pays_off(recipe, k, n):
        return _threshold_text(recipe, options)
    if options.keep_head and name == head:
        return "output head (the last Linear) kept bfloat16; keep_head=False converts it"
    return None


@functools.cache
def cpu_kernel_error(rowwise: bool) -> str | None:
    """None when this CPU's ``torch._scaled_mm`` runs (per-tensor scales, or per row and
    column with ``rowwise``), else the first line of its error: oneDNN has no float8 matmul
    below AVX512, and torch 2.11's CPU kernel takes per-tensor scales only."""

    # On the CPU in float32 whatever the defaults (set_default_device/dtype, a meta scope):
    # torch refuses float64 scales with a ValueError, and an answer is cached for good.
    def ones(*shape: int) -> torch.Tensor:
        return torch.ones(shape, device="cpu", dtype=torch.float32)

    a = ones(ALIGNMENT, ALIGNMENT).to(torch.float8_e4m3fn)
    rows, cols = (ones(ALIGNMENT, 1), ones(1, ALIGNMENT)) if rowwise else (ones(), ones())
    try:
        torch._scaled_mm(a, a.t(), scale_a=rows, scale_b=cols, out_dtype=torch.bfloat16)
    except (RuntimeError, ValueError, TypeError) as error:
        return str(error).strip().splitlines()[0][:160]
    return None


def _warn_cpu(layers: list[nn.Module], recipe: str, policy_name: str) -> None:
    """Converted ``layers`` on the CPU whose recipe this CPU's float8 matmul cannot run:
    said now, as training them here fails in torch with an internal message. Not where CUDA
    is present: the model is then most likely bound for the GPU (Lightning prepares it on
    the CPU and moves it after)."""
    if torch.cuda.is_available():
        return
    if not any(p.device.type == "cpu" for layer in layers for p in layer.parameters()):
        return
    error = cpu_kernel_error(rowwise=recipe != "tensorwise")
    if error is None:
        return
    other = "" if recipe == "tensorwise" or cpu_kernel_error(False) else "'mixed_float8' or "
    warn_at_caller(
        f"policy={policy_name!r}: float8 matmuls with {recipe} scales cannot run on this "
        f"CPU with torch {torch.__version__} (torch._scaled_mm: {error}), so training this "
        "model on the CPU will fail. Move it to a CUDA GPU with float8 matrix units (compute "
        f"capability >= 8.9) before preparing it, or use {other}'mixed_bfloat16'."
    )


def _check_device(model: nn.Module, policy_name: str) -> None:
    """float8 matmuls need float8 matrix units on CUDA (sm_89+); the CPU emulates them."""
    for param in model.parameters():
        if param.device.type == "cuda" and torch.version.hip is None:
            major, minor = torch.cuda.get_device_capability(param.device)
            if (major, minor) < (8, 9):
                raise ValueError(
                    f"policy={policy_name!r} needs float8 matrix units: CUDA compute "
                    f"capability >= 8.9 (H100/H200, L4, RTX 40xx); "
                    f"{torch.cuda.get_device_name(param.device)} is sm_{major}{minor}. "
                    "Use 'mixed_bfloat16'."
                )
            return


def check_float8(model: nn.Module, recipe: str, *, policy_name: str, options: Float8Options) -> str:
    """Refuse what ``convert_to_float8`` would refuse, before anything changes the model
    (torchao missing, a GPU without float8 matmuls, options the recipe cannot take); returns
    the recipe's canonical name."""
    recipe = parse_float8_recipe(recipe)
    torchao_float8()
    _check_device(model, policy_name)
    if options.fsdp_float8_all_gather and recipe != "tensorwise":
        raise ArgumentError(
            f"Float8Options(fsdp_float8_all_gather=True) needs the tensorwise recipe "
            f"(torchao gathers float8 weights only with one scale per tensor), got "
            f"{recipe!r}; use policy 'mixed_float8'"
        )
    return recipe


def convert_to_float8(
    model: nn.Module,
    recipe: str,
    *,
    policy_name: str,
    float32: set[int],
    bfloat16: set[int],
    options: Float8Options,
) -> dict[str, Float8Choice]:
    """Swap the eligible Linear layers of ``model`` (in place) for torchao's float8 Linear.

    ``float32`` and ``bfloat16``: ids of modules (and their descendants) that must not be
    converted. Every Linear layer gets its ``Float8Choice``; converted ones also get a
    bfloat16 region (see the module docstring). Parameters keep their identity, so an
    optimizer built on the float32 model stays valid; the converted modules are new objects
    (hooks registered on the old ones are not carried over). Returns the choices by name.
    """
    recipe = check_float8(model, recipe, policy_name=policy_name, options=options)
    if isinstance(model, nn.Linear):  # torchao would return a new module: none in place
        raise ArgumentError(
            f"policy {policy_name!r}: the model is itself an nn.Linear, which float8 cannot "
            "convert in place (the converted layer is a new module); wrap it: "
            "model = torch.nn.Sequential(linear)"
        )
    ao = torchao_float8()
    config = ao.Float8LinearConfig.from_recipe_name(recipe)
    if options.fsdp_float8_all_gather:
        config = dataclasses.replace(config, enable_fsdp_float8_all_gather=True)
    forward_dtype = dtype_name(config.cast_config_input.target_dtype)
    linears = [(n, m) for n, m in model.named_modules() if n and isinstance(m, nn.Linear)]
    attention = {
        id(sub)
        for m in model.modules()
        if isinstance(m, nn.MultiheadAttention)
        for sub in m.modules()
    }
    # The head: the last Linear outside attention (whose out_proj, counted, would leave
    # the real head to float8 when attention is registered after it).
    heads = [n for n, m in linears if id(m) not in attention]
    head = heads[-1] if heads else None
    by_id: dict[int, Float8Choice] = {}
    for name, module in linears:
        why = _refusal(name, module, recipe, options, head, float32, bfloat16, attention)
        if why is None:
            k, n = module.in_features, module.out_features
            by_id[id(module)] = Float8Choice(
                True, recipe, forward_dtype, f"float8 {recipe}, {k}->{n}"
            )
        else:
            by_id[id(module)] = Float8Choice(False, recipe, "", why)
    # A Linear shared under several names is chosen once and gets the same choice at each
    # (torchao swaps by name: chosen at its first name alone, it ran float8 there only).
    choices = {
        n: by_id[id(m)]
        for n, m in model.named_modules(remove_duplicate=False)
        if n and id(m) in by_id
    }

    _warn_cpu([m for n, m in linears if by_id[id(m)].converted], recipe, policy_name)

    def chosen(module: nn.Module, fqn: str) -> bool:
        found = by_id.get(id(module))
        return found is not None and found.converted

    # Each name of a converted Linear, with the first name of that Linear.
    first = {id(m): n for n, m in linears}
    aliases = {n: first[id(m)] for n, m in model.named_modules(remove_duplicate=False)
               if n and chosen(m, n)}  # fmt: skip
    ao.convert_to_float8_training(model, module_filter_fn=chosen, config=config)
    # The converted modules are new objects. torchao swaps a shared Linear once under each
    # parent (under one parent, at its first name only): every name gets the module at the
    # Linear's first name, so it stays one module (one hook, one describe line).
    named = dict(model.named_modules(remove_duplicate=False))
    for name, at in aliases.items():
        if named[name] is not named[at]:
            parent, _, attr = name.rpartition(".")
            setattr(model.get_submodule(parent), attr, named[at])
    named = dict(model.named_modules(remove_duplicate=False))
    for name, choice in choices.items():
        module = named[name]
        setattr(module, FLOAT8_ATTR, choice)
        if choice.converted:
            set_region(module, Region(torch.bfloat16, None, cast_inputs=True, plain=True))
    return choices


def layer_counts(model: nn.Module) -> tuple[int, int]:
    """How many Linear layers a float8 policy converted, of the Linear layers it considered."""
    choices = [c for m in model.modules() if (c := float8_choice(m)) is not None]
    return sum(c.converted for c in choices), len(choices)


def summary(model: nn.Module) -> dict[str, object] | None:
    """The float8 recipe and converted layer names (for a checkpoint header), or ``None``."""
    choices = [(n, c) for n, m in model.named_modules() if (c := float8_choice(m)) is not None]
    if not choices:
        return None
    return {
        "recipe": choices[0][1].recipe,
        "converted": [n for n, c in choices if c.converted],
    }
