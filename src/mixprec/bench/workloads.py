"""The benchmark's workloads: a model factory, one batch and a loss each, by name.

``WORKLOADS`` holds the bundled ones (MLPs, a CNN, causal LMs); ``get_workload`` also loads a
user's ``module:function`` returning a ``Workload``.
"""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from mixprec._errors import ArgumentError
from mixprec.float8 import Float8Options
from mixprec.models import CausalLM, cnn, lm_loss, mlp


@dataclass(frozen=True)
class Workload:
    """A model factory, one batch, a loss, and how many samples a step sees."""

    name: str
    make_model: Callable[[], nn.Module]
    batch: tuple[torch.Tensor, torch.Tensor]
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    samples: int
    tokens: int = 0
    flops: float = 0.0  # model FLOPs of one training step (forward + backward), 0 if unknown
    #: Which Linear layers the float8 modes convert; ``None``: torchao's size thresholds
    #: (``Float8Options()``), measured on H100, under which small models convert nothing.
    float8: Float8Options | None = None


def _mlp(batch: int) -> Workload:
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(batch, 784, generator=g), torch.randint(0, 10, (batch,), generator=g)
    return Workload(f"mlp-b{batch}", lambda: mlp(784), (x, y), _float32_cross_entropy, batch)


def _float32_cross_entropy(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """The classifier loss users write: in float32 whatever the model returns."""
    return F.cross_entropy(out.float(), y)


def _lm(
    d_model: int = 512, layers: int = 4, batch: int = 8, length: int = 256, heads: int = 8
) -> Workload:
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, 8192, (batch, length), generator=g)

    def make() -> CausalLM:
        return CausalLM(vocab=8192, d_model=d_model, n_layers=layers, n_heads=heads, max_len=length)

    n_tokens = batch * length
    # float8 modes convert every Linear of the blocks (none has a dim below d_model; all are
    # multiples of 16), whatever d_model is, so that the float8 figures measure float8 in
    # all the blocks' matmuls and not torchao's size rule, which converts nothing at
    # --small's d=64. The head stays bfloat16 (Float8Options.keep_head). At d >= 2048 these
    # are the layers torchao's tensorwise rule converts anyway (its rowwise rule: half).
    return Workload(
        f"lm-d{d_model}", make, (tokens, tokens), lambda out, t: lm_loss(out, t), batch,
        tokens=n_tokens, flops=lm_flops(_on_meta(make), n_tokens, length),
        float8=Float8Options(min_features=d_model),
    )  # fmt: skip


def _on_meta(make: Callable[[], CausalLM]) -> CausalLM:
    """The model's structure without allocating or initialising its weights."""
    with torch.device("meta"):
        return make()


def lm_flops(model: CausalLM, tokens: int, length: int) -> float:
    """Training FLOPs of a step of ``tokens`` tokens in sequences of ``length``: 6 per
    weight of the matrix multiplies per token (forward 2, backward 4), plus attention's
    scores and weighted sum, 12 * layers * d_model * length per token (Kaplan et al. 2020,
    without the causal halving, as MFU figures are usually quoted). Embedding lookups
    are not matrix work and do not count."""
    embeddings = sum(m.weight.numel() for m in (model.embed, model.pos))
    weights = sum(p.numel() for p in model.parameters()) - embeddings
    d_model, layers = model.embed.embedding_dim, len(model.blocks)
    return float(6 * weights * tokens + 12 * layers * d_model * length * tokens)


def _cnn(batch: int = 64) -> Workload:
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(batch, 28, 28, generator=g), torch.randint(0, 10, (batch,), generator=g)
    return Workload("cnn", lambda: cnn(1, 10), (x, y), _float32_cross_entropy, batch)


# Each takes an optional batch size (for --max-batch); None is the workload's own.
WORKLOADS: dict[str, Callable[[int | None], Workload]] = {
    "mlp-b64": lambda b: _mlp(b or 64),
    "mlp-b8192": lambda b: _mlp(b or 8192),
    "lm-d512": lambda b: _lm(batch=b or 8),
    "cnn": lambda b: _cnn(b or 64),
    # For GPUs (float8's speed target is set at d >= 2048): 8 blocks of d=2048, 16 heads of
    # 128, 8 x 1024 tokens a step, 22 model TFLOPs. It runs on CPU, slowly.
    "lm-d2048": lambda b: _lm(2048, 8, b or 8, 1024, heads=16),
}

#: What ``mixprec bench`` runs when no workload is named (lm-d2048 is for GPUs).
DEFAULT_WORKLOADS: tuple[str, ...] = ("mlp-b64", "mlp-b8192", "lm-d512", "cnn")

#: What each bundled workload trains, one line each (``mixprec bench --help``).
WORKLOAD_HELP: dict[str, str] = {
    "mlp-b64": "MLP 784-512-512-10, batch 64",
    "mlp-b8192": "the same MLP, batch 8192",
    "lm-d512": "causal LM, d=512, 4 layers, 8 x 256 tokens, vocabulary 8192",
    "cnn": "small CNN (2 conv+BN blocks), 28 x 28 inputs, batch 64",
    "lm-d2048": "causal LM, d=2048, 8 layers, 8 x 1024 tokens (for GPUs; slow on CPU)",
}


def workload_factory(spec: str) -> Callable[[], object]:
    """The function a ``module:function`` workload spec names, after checking that it can be
    called with no arguments; else one line that says what the spec must name."""
    module, _, func = spec.partition(":")
    try:
        found = getattr(importlib.import_module(module), func, None)
    except ImportError as err:
        raise ArgumentError(f"workload {spec!r}: cannot import module {module!r} ({err})") from None
    except Exception as err:  # the user's module failed as it ran: SyntaxError, any raise
        raise ArgumentError(
            f"workload {spec!r}: cannot import module {module!r} ({_first_line(err)})"
        ) from None
    if not callable(found):
        raise ArgumentError(f"workload {spec!r}: module {module!r} has no function {func!r}")
    try:
        inspect.signature(found).bind()
    except TypeError as err:  # it needs arguments: json:loads, say
        raise ArgumentError(
            f"workload {spec!r}: {module}.{func} cannot be called without arguments ({err}); "
            f"{_FACTORY}"
        ) from None
    except ValueError:  # no signature to inspect (some builtins): the call will tell
        pass
    return found  # type: ignore[no-any-return]


#: What a ``module:function`` workload spec must name.
_FACTORY = "give a function that takes no arguments and returns a mixprec.bench.Workload"


def _first_line(err: BaseException) -> str:
    """``Type: first line of the message``, for a one-line error about a user's code."""
    return f"{type(err).__name__}: {(str(err).strip().splitlines() or [''])[0]}"


def call_factory(spec: str, factory: Callable[[], object], named: str) -> object:
    """``factory()``, where ``spec`` named it; an exception it raises is one line naming
    ``named`` (``workload 'm:f'``, ``--model 'm:f'``), not the user's traceback."""
    try:
        return factory()
    except Exception as err:
        module, _, func = spec.partition(":")
        raise ArgumentError(f"{named}: {module}.{func}() raised {_first_line(err)}") from None


def get_workload(spec: str, small: bool = False, batch: int | None = None) -> Workload:
    """A named workload (at ``batch`` samples if given), or ``module:function`` returning
    a ``Workload`` (``workload_factory``); anything else it returns is refused."""
    if ":" in spec:
        module, _, func = spec.partition(":")
        work = call_factory(spec, workload_factory(spec), f"workload {spec!r}")
        if not isinstance(work, Workload):
            raise ArgumentError(
                f"workload {spec!r}: {module}.{func}() returned {type(work).__name__}, not a "
                f"Workload; {_FACTORY}"
            )
        return work
    if spec not in WORKLOADS:
        raise ArgumentError(
            f"unknown workload {spec!r}; valid: {', '.join(WORKLOADS)} or module:function"
        )
    if small:  # tiny versions for tests
        if spec == "lm-d512":
            return _lm(64, 1, batch or 2, 32)
        if spec == "lm-d2048":  # the width is the point: one block at d=2048, 2 x 64 tokens
            return _lm(2048, 1, batch or 2, 64, heads=16)
        if spec == "mlp-b8192":
            return _mlp(batch or 256)
    return WORKLOADS[spec](batch)
