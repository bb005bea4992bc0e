"""``compile=`` of ``Trainer``, ``build_train_step``, ``mixprec train`` and ``mixprec bench``.

One place that checks the option and applies ``torch.compile`` to a training step's forward
and loss. The optimizer step stays outside the graph: its skip-on-overflow decision reads one
flag back to the host, which a graph cannot branch on without breaking (see docs/compile.md).
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import weakref
from collections.abc import Callable, Iterator, Mapping
from typing import Any, TypeVar

import torch
from torch import nn

from mixprec._errors import ArgumentError
from mixprec._warn import warn_at_caller
from mixprec.region import get_region

__all__ = [
    "CompileOption",
    "compile_options",
    "compile_step",
    "recompile_room",
    "say_if_past_recompile_limit",
]

F = TypeVar("F", bound=Callable[..., Any])

#: ``True`` (torch.compile's defaults), ``False``, or keyword arguments of ``torch.compile``.
CompileOption = bool | Mapping[str, Any]


def compile_options(compile: CompileOption, where: str = "compile") -> dict[str, Any] | None:
    """``None`` for no compilation, else the ``torch.compile`` keyword arguments to use."""
    if compile is False or compile is None:
        return None
    if compile is True:
        return {}
    if not isinstance(compile, Mapping):
        raise ArgumentError(
            f"{where}={compile!r} is invalid; pass True, False or a dict of torch.compile "
            "options such as {'mode': 'max-autotune-no-cudagraphs', 'fullgraph': True}"
        )
    valid = [p for p in inspect.signature(torch.compile).parameters if p != "model"]
    unknown = sorted(str(k) for k in compile if k not in valid)
    if unknown:
        raise ArgumentError(
            f"{where} has unknown torch.compile option(s) {', '.join(unknown)}; "
            f"valid: {', '.join(valid)}"
        )
    # The values, as torch checks them when it builds its wrapper (no tracing): a bad mode,
    # backend or inductor option failed after the model and optimizer had been changed.
    try:
        torch.compile(lambda: None, **compile)
    except Exception as err:  # RuntimeError, InvalidBackend, AssertionError: torch's own
        first = (str(err).strip().splitlines() or [type(err).__name__])[0]
        raise ArgumentError(
            f"{where}={dict(compile)!r} is refused by torch.compile: {first}"
        ) from None
    return dict(compile)


def compile_step(fn: F, options: Mapping[str, Any], model: nn.Module) -> F:
    """``torch.compile(fn, **options)``, with dynamo's RNN support switched on while it runs
    when ``model`` has RNN/GRU/LSTM layers (dynamo refuses to trace them by default, and they
    trace whole-graph when allowed; the setting is restored after each call)."""
    compiled = torch.compile(fn, **options)
    if not any(isinstance(m, nn.RNNBase) for m in model.modules()):
        return compiled  # type: ignore[return-value]

    @functools.wraps(fn)
    def with_rnns(*args: Any, **kwargs: Any) -> Any:
        with torch._dynamo.config.patch(allow_rnn=True):
            return compiled(*args, **kwargs)

    return with_rnns  # type: ignore[return-value]


# Prepared models compile_step compiled: counted for good (dynamo keeps a dead model's
# cache entry, and its place under the limit), each once.
_COMPILED = weakref.WeakSet[nn.Module]()
_COUNT = [0]


def _recompile_limit() -> int:
    config = torch._dynamo.config
    return int(getattr(config, "recompile_limit", getattr(config, "cache_size_limit", 8)))


def say_if_past_recompile_limit(model: nn.Module) -> None:
    """Each prepared model's region forward is an object of its own, on which dynamo guards:
    the graphs of two prepared models are not shared, and past ``recompile_limit`` of them
    in one process the forward runs eagerly, said by one torch log line. Said once here,
    for the training steps users build (not autotune's or the bench's own copies)."""
    if get_region(model) is None or model in _COMPILED:
        return
    _COMPILED.add(model)
    _COUNT[0] += 1
    if _COUNT[0] == _recompile_limit() + 1:
        warn_at_caller(
            f"compile: {_COUNT[0]} prepared models compiled in this process; dynamo "
            "compiles each one's forward anew and, past torch._dynamo.config."
            f"recompile_limit ({_recompile_limit()}), runs it eagerly (no speed-up). Compile "
            "each model in a process of its own, or raise that limit"
        )


@contextlib.contextmanager
def recompile_room(functions: int) -> Iterator[None]:
    """Raise dynamo's per-code-object recompile limit by ``functions`` while the block runs.

    Compiled closures of one function (one per bench mode, say) share its code object, and
    dynamo compiles at most ``recompile_limit`` (8) versions of it: past that, a call runs
    eagerly, still timed as compiled. (``cache_size_limit`` before torch 2.6.)"""
    config = torch._dynamo.config
    name = "recompile_limit" if hasattr(config, "recompile_limit") else "cache_size_limit"
    with config.patch(**{name: getattr(config, name) + functions}):
        yield
