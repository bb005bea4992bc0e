"""Where a training step's time and memory go, so that a speed or memory figure can say why.

``matmul_ms`` measures, with ``torch.profiler``, how much of a step the matrix
multiplications and convolutions take: the only work 16-bit units speed up. A step where
they are a small share is overhead-bound (optimizer, casts, Python) and gains little from
mixed precision whatever the hardware. ``memory_parts`` counts the bytes of what a run
keeps per parameter: weights, float32 masters, optimizer state and gradients.
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
from torch import nn

#: Below this speedup a mixed run is said to buy nothing (run-to-run noise is ~5%).
GAIN_THRESHOLD = 1.1


def _is_matmul(op: str) -> bool:
    """aten's matrix products and convolutions, forward and backward (``aten::addmm``,
    ``aten::mm``, ``aten::bmm``, ``aten::mkldnn_convolution``, ``aten::convolution_backward``,
    oneDNN's ``mkldnn::`` kernels). Wrappers such as ``aten::linear`` match too; their own
    (self) time is what is summed, so nothing is counted twice."""
    name = op.lower()
    return "mm" in name.split("::")[-1] or "conv" in name or name.startswith("mkldnn::")


def matmul_ms(step: Callable[[], object], steps: int = 5) -> float:
    """Milliseconds a call of ``step`` spends in matmuls and convolutions (their self CPU
    time, summed over ``steps`` profiled calls after one warm-up call, divided by
    ``steps``). The profiler's own overhead lands on the ops' launch, not in the kernels,
    so this is close to the unprofiled figure; the step time it is compared with should be
    measured without the profiler."""
    from torch.profiler import ProfilerActivity, profile

    step()
    with _quiet_stderr(), profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            step()
    total_us: float = sum(e.self_cpu_time_total for e in prof.key_averages() if _is_matmul(e.key))
    return float(total_us) / 1000.0 / steps


@contextlib.contextmanager
def _quiet_stderr() -> Iterator[None]:
    """Kineto writes a line to file descriptor 2 as each profile starts and stops
    ("profiler_start"), whatever its log level: those would land in the user's output.
    File descriptor 2 points at /dev/null for the profiled steps only, and is restored."""
    sys.stderr.flush()
    saved = os.dup(2)
    try:
        with open(os.devnull, "w") as null:
            os.dup2(null.fileno(), 2)
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)


@dataclass(frozen=True)
class MemoryParts:
    """Bytes a training run keeps for its parameters, by kind."""

    weights: int  # the model's parameters, in their storage dtype
    weights_dtypes: tuple[str, ...]
    masters: int  # float32 copies the optimizer steps in place of 16-bit weights
    optimizer_state: int  # e.g. Adam's two moments
    gradients: int  # the model's .grad and the masters' .grad

    def describe(self) -> str:
        mb = 2.0**20
        text = f"weights {self.weights / mb:.1f} ({'/'.join(self.weights_dtypes)})"
        if self.masters:
            text += f", float32 masters {self.masters / mb:.1f}"
        return (
            text + f", optimizer state {self.optimizer_state / mb:.1f}, "
            f"gradients {self.gradients / mb:.1f}"
        )


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def memory_parts(model: nn.Module, optimizer: torch.optim.Optimizer) -> MemoryParts:
    """What ``model`` and ``optimizer`` hold now. A ``LossScaleOptimizer``'s inner
    optimizers are read; a parameter they step that is not one of the model's is a master."""
    params = list(model.parameters())
    own = {p.data_ptr() for p in params}
    inner: list[torch.optim.Optimizer] = getattr(optimizer, "optimizers", None) or [optimizer]
    masters: dict[int, torch.Tensor] = {}
    state = 0
    for opt in inner:
        for group in opt.param_groups:
            for p in group["params"]:
                if p.data_ptr() not in own:
                    masters[p.data_ptr()] = p
        for values in opt.state.values():
            state += sum(_nbytes(v) for v in values.values() if isinstance(v, torch.Tensor))
    grads = [p.grad for p in [*params, *masters.values()] if p.grad is not None]
    return MemoryParts(
        weights=sum(_nbytes(p) for p in params),
        weights_dtypes=tuple(sorted({str(p.dtype).removeprefix("torch.") for p in params})),
        masters=sum(_nbytes(p) for p in masters.values()),
        optimizer_state=state,
        gradients=sum(_nbytes(g) for g in grads),
    )
