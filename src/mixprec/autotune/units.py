"""What a plan gives a dtype (the matrix-work layers), which candidate dtypes can run here,
and how the autotuner's time is measured (``Timer``; tests inject one)."""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from typing import Protocol

import torch
from torch import nn

from mixprec._errors import ArgumentError
from mixprec._module_kinds import is_half_storage
from mixprec._plan_apply import PLAN_DTYPES
from mixprec.float8 import ALIGNMENT, linear_refusal, torchao_float8

__all__ = ["Timer", "WallTimer", "available", "check_candidates", "float8_ready", "units"]


def units(model: nn.Module) -> dict[str, nn.Module]:
    """The layers a plan names: the outermost matrix-work modules (Linear, conv, embedding,
    attention, RNN: the modules O2 stores in 16 bits), in the model's order. The rest of
    the model (activations, norms, functional code) follows the plan's level and policy."""
    found: dict[str, nn.Module] = {}
    inside: set[int] = set()
    for name, module in model.named_modules():
        if not name or id(module) in inside or not is_half_storage(module, torch.float32):
            continue
        found[name] = module
        inside.update(id(sub) for sub in module.modules())
    return found


def float8_ready(module: nn.Module) -> bool:
    """Whether torchao's float8 Linear can replace ``module`` (exact ``nn.Linear``, dims
    multiples of 16)."""
    return linear_refusal(module) is None


def check_candidates(candidates: object) -> tuple[str, ...]:
    """``candidates`` as a tuple of plan dtypes, float32 first (always measured: it is the
    reference and every layer's fallback)."""
    if isinstance(candidates, str) or not isinstance(candidates, Sequence):
        raise ArgumentError(
            f"candidates={candidates!r} is invalid; give a tuple of dtypes from "
            f"{', '.join(PLAN_DTYPES)}"
        )
    for c in candidates:
        if c not in PLAN_DTYPES:
            raise ArgumentError(f"candidates holds {c!r}; valid dtypes: {', '.join(PLAN_DTYPES)}")
    return ("float32", *(d for d in PLAN_DTYPES[1:] if d in candidates))


def available(
    candidates: tuple[str, ...], layers: Mapping[str, nn.Module], device: torch.device
) -> tuple[list[str], dict[str, str]]:
    """The candidates this machine and the installed packages can run, and why each other
    one cannot. Speed is not judged here: ``measure`` times what runs."""
    kept, left_out = [], {}
    for dtype in candidates:
        reason = None
        if dtype == "bfloat16" and device.type == "cuda" and not torch.cuda.is_bf16_supported():
            reason = f"{torch.cuda.get_device_name(device)} has no bfloat16 support"
        elif dtype == "float8":
            reason = _float8_reason(layers, device)
        if reason is None:
            kept.append(dtype)
        else:
            left_out[dtype] = reason
    return kept, left_out


def _float8_reason(layers: Mapping[str, nn.Module], device: torch.device) -> str | None:
    try:
        torchao_float8()
    except ImportError as err:
        return str(err)
    if device.type == "cuda" and torch.version.hip is None:
        major, minor = torch.cuda.get_device_capability(device)
        if (major, minor) < (8, 9):
            return (
                f"float8 matmuls need CUDA compute capability >= 8.9; this GPU is sm_{major}{minor}"
            )
    if not any(float8_ready(m) for m in layers.values()):
        return f"no layer is an nn.Linear with in/out features multiples of {ALIGNMENT}"
    return None


class Timer(Protocol):
    """How ``autotune`` times: ``layer`` a layer's forward and backward alone in ``dtype``,
    ``step`` a whole training step under the plan ``dtypes`` at ``level``. Each calls
    ``run`` (at least once: it also measures the numerics) and returns seconds."""

    def layer(self, name: str, dtype: str, run: Callable[[], object]) -> float: ...

    def step(self, dtypes: Mapping[str, str], level: str, run: Callable[[], object]) -> float: ...


class WallTimer:
    """Wall-clock timing: ``warmup`` untimed calls, then the fastest of ``repeats`` (CUDA
    work is waited for before each reading). The fastest, not the median: on a shared
    machine other work only ever adds time, so the minimum is the least disturbed reading.
    A call whose warm-up takes over ``slow`` seconds is timed by it alone: so slow a
    candidate loses by far, and repeats would spend the time budget on it."""

    def __init__(
        self, repeats: int = 3, warmup: int = 1, layer_repeats: int = 2, slow: float = 0.5
    ) -> None:
        self.repeats, self.warmup, self.layer_repeats = repeats, warmup, layer_repeats
        self.slow = slow

    def _time(self, run: Callable[[], object], repeats: int) -> float:
        for _ in range(self.warmup):
            start = time.perf_counter()
            run()
            _sync()
            once = time.perf_counter() - start
            if once > self.slow:  # emulated float8 on CPU: seconds a call, far off anyway
                return once
        times = []
        for _ in range(repeats):
            _sync()
            start = time.perf_counter()
            run()
            _sync()
            times.append(time.perf_counter() - start)
        return min(times)

    def layer(self, name: str, dtype: str, run: Callable[[], object]) -> float:
        return self._time(run, self.layer_repeats)

    def step(self, dtypes: Mapping[str, str], level: str, run: Callable[[], object]) -> float:
        return self._time(run, self.repeats)


def _sync() -> None:
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()
