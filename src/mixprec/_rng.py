"""Capturing and rewinding the random number generators, so that repeated passes over a batch
draw the same numbers (dropout masks) and the caller's run is left as it was."""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import torch


@contextlib.contextmanager
def same_draws() -> Iterator[Callable[[], None]]:
    """Yields ``rewind``: a doctor calls it before each pass over the batch, so that every
    pass draws the same random numbers (dropout masks) and the runs compare like for like.
    On exit the generators are as the caller left them: a diagnosis does not change the
    training run that follows it. CUDA's are saved where CUDA is initialised already (a
    model or batch on a GPU has done it); initialising it only to save them would cost a
    CPU-only run a CUDA context."""
    cpu = torch.get_rng_state()
    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else None

    def rewind() -> None:
        torch.set_rng_state(cpu)
        if cuda is not None:
            torch.cuda.set_rng_state_all(cuda)

    try:
        yield rewind
    finally:
        rewind()


F = TypeVar("F", bound=Callable[..., Any])


def leaves_rng(fn: F) -> F:
    """``fn`` with the generators left as the caller had them (``same_draws``): a benchmark
    that seeds its models and draws dropout masks must not reseed the caller's run."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        with same_draws():
            return fn(*args, **kwargs)

    return wrapper  # type: ignore[return-value]
