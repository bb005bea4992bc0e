"""Where a training step's time and memory go, so that a speed or memory figure can say why.

``matmul_ms`` (and ``profile_step``, with the step's time in the same profiled calls)
measures, with ``torch.profiler``, how much of a step the matrix
multiplications and convolutions take: the only work 16-bit units speed up. A step where
they are a small share is overhead-bound (optimizer, casts, Python) and gains little from
mixed precision whatever the hardware. ``why_no_gain`` words, from those figures, why a
mixed step gains less than ``GAIN_THRESHOLD``, for ``mixprec train`` and ``mixprec bench``
alike. ``memory_parts`` counts the bytes of what a run keeps per parameter: weights,
float32 masters, optimizer state and gradients.
"""

from __future__ import annotations

import contextlib
import os
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
from torch import nn

from mixprec import _hardware

#: Below this speedup a mixed run is said to buy nothing (run-to-run noise is ~5%).
GAIN_THRESHOLD = 1.1


def _is_matmul(op: str) -> bool:
    """aten's matrix products and convolutions, forward and backward (``aten::addmm``,
    ``aten::mm``, ``aten::bmm``, ``aten::mkldnn_convolution``, ``aten::convolution_backward``,
    oneDNN's ``mkldnn::`` kernels). Wrappers such as ``aten::linear`` match too; their own
    (self) time is what is summed, so nothing is counted twice."""
    name = op.lower()
    return "mm" in name.split("::")[-1] or "conv" in name or name.startswith("mkldnn::")


@dataclass(frozen=True)
class StepProfile:
    """A step's time and its part in matmuls and convolutions, from the same profiled calls
    (``profile_step``)."""

    ms: float  # wall time of a profiled call
    matmul_ms: float  # of which in matmuls and convolutions

    @property
    def matmul_share(self) -> float:
        """The matmuls' part of the step, 0 to 1: as the profiler's overhead lands outside
        the kernels, slightly below the unprofiled share."""
        return min(self.matmul_ms / self.ms, 1.0) if self.ms > 0 else 0.0


def profile_step(step: Callable[[], object], steps: int = 5, device: str = "cpu") -> StepProfile:
    """Milliseconds a call of ``step`` takes and spends in matmuls and convolutions (their
    self CPU time), each summed over ``steps`` profiled calls after one warm-up call, and
    divided by ``steps``. The profiler's own overhead lands on the ops' launch, not in the
    kernels, so the matmul figure is close to the unprofiled one; the wall time includes
    that overhead. On a loaded machine a time measured apart drifts from both: compare the
    share (``matmul_share``), which holds.

    ``device="cuda"``: the GPU time of the kernels the matmul ops launch (their self device
    time), as a CUDA op's CPU time is its launch only. The kernels themselves, which the
    profiler also lists under their own names, are not counted a second time."""
    from torch.profiler import DeviceType, ProfilerActivity, profile

    cuda = device.startswith("cuda")
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    step()
    if cuda:
        torch.cuda.synchronize(device)  # the warm-up's queued kernels stay out of the timing
    with _quiet_stderr(), profile(activities=activities) as prof:
        start = time.perf_counter()
        for _ in range(steps):
            step()
        if cuda:
            torch.cuda.synchronize()
        wall_s = time.perf_counter() - start
    total_us = 0.0
    for e in prof.key_averages():
        if e.device_type == DeviceType.CPU and _is_matmul(e.key):
            total_us += e.self_device_time_total if cuda else e.self_cpu_time_total
    return StepProfile(ms=1000.0 * wall_s / steps, matmul_ms=float(total_us) / 1000.0 / steps)


def matmul_ms(step: Callable[[], object], steps: int = 5, device: str = "cpu") -> float:
    """Milliseconds a call of ``step`` spends in matmuls and convolutions (see
    ``profile_step``); the step time it is compared with should be measured without the
    profiler, on a machine whose load stays put (else compare ``profile_step``'s share)."""
    return profile_step(step, steps, device).matmul_ms


def why_no_gain(
    base_ms: float,
    mixed_ms: float,
    *,
    base_matmul_ms: float | None = None,
    mixed_matmul_ms: float | None = None,
    emulated: str | None = None,
    base: str = "float32",
    rest: str = "casts, float32 masters, optimizer",
) -> str:
    """Why a mixed step of ``mixed_ms`` gains less than ``GAIN_THRESHOLD`` over a ``base``
    one (a float32 step unless named) of ``base_ms``, worded from measured figures: how
    much of each step is matmuls (``matmul_ms``), the only work 16-bit math speeds up.
    ``emulated``: what the device lacks where it emulates the mixed step's 16-bit matmuls
    (such as "bfloat16 matmuls are emulated on this CPU (no AVX512-BF16 or AMX)"); the step
    times say the rest. ``rest``: what the mixed step does besides matmuls
    (``other_work``; the default is an O2 step's). The first that holds:

    - the matmuls are emulated;
    - the mixed step's matmuls took as long as ``base``'s or longer: how many times
      longer, that they are emulated where this machine has no GPU and no fast bfloat16
      (``_emulated_here``), and the rest of the step where it grew too;
    - the ``base`` step is overhead-bound: under half of it is matmuls, so even free
      matmuls would leave most of it (also where the mixed step's matmuls were not
      profiled);
    - the mixed step's matmuls are hardly faster (less than 1.2x) than ``base``'s;
    - its matmuls are faster, and the rest of its step (``rest``) grew by more than they
      saved.
    """
    if emulated is not None:
        return f"{emulated}: {mixed_ms:.2f} ms a step against {base}'s {base_ms:.2f} ms"
    if base_matmul_ms is None:
        return f"{mixed_ms:.2f} ms a step against {base}'s {base_ms:.2f} ms"
    other = base_ms - base_matmul_ms
    if mixed_matmul_ms is not None and 0 < base_matmul_ms <= mixed_matmul_ms:
        # Before the overhead-bound branch: its "the only part 16-bit math speeds up" is
        # untrue of matmuls that got slower (bfloat16's 0.33 against float32's 0.13 ms).
        return _slower_matmuls(base_ms, mixed_ms, base_matmul_ms, mixed_matmul_ms, base, rest)
    if base_matmul_ms < 0.5 * base_ms or mixed_matmul_ms is None:
        grown = "stay"
        if mixed_matmul_ms is not None and mixed_ms - mixed_matmul_ms > 1.05 * other:
            grown = f"grow to {mixed_ms - mixed_matmul_ms:.2f} ms in the mixed step"
        return (
            f"the step is overhead-bound, {base_matmul_ms:.2f} of {base_ms:.2f} ms in matmuls, "
            f"the only part 16-bit math speeds up; the other {other:.2f} ms (optimizer, casts, "
            f"Python) {grown}. A larger batch or model gains."
        )
    if mixed_matmul_ms * 1.2 > base_matmul_ms:
        return (
            f"its matmuls are hardly faster than {base}'s: {mixed_matmul_ms:.2f} against "
            f"{base_matmul_ms:.2f} ms of a {base_ms:.2f} ms {base} step"
        )
    return (
        f"its matmuls took {mixed_matmul_ms:.2f} ms against {base}'s {base_matmul_ms:.2f}, "
        f"but the rest of its step ({rest}) took {mixed_ms - mixed_matmul_ms:.2f} ms against "
        f"{base}'s {other:.2f}"
    )


def _emulated_here() -> bool:
    """Whether a step timed here ran its 16-bit matmuls emulated: a machine without CUDA
    (with CUDA, the step may have run on either device) whose CPU has no fast bfloat16, and
    so no fast float16 either. From the cached CPU flags: cheap."""
    hw = _hardware.probe_hardware()  # by the module: tests set what it says
    return hw.device == "cpu" and not hw.bf16_fast


def _slower_matmuls(
    base_ms: float, mixed_ms: float, base_matmul_ms: float, mixed_matmul_ms: float,
    base: str, rest: str,
) -> str:  # fmt: skip
    """``why_no_gain`` where the mixed step's matmuls took as long as ``base``'s or longer."""
    times = f"{mixed_matmul_ms / base_matmul_ms:.1f}"
    how = "no faster than" if times == "1.0" else f"{times}x slower than"
    # Emulation explains slower matmuls against float32's only: a 16-bit base is emulated too.
    why = f", as {_hardware.slow_16bit_why()}" if base == "float32" and _emulated_here() else ""
    text = (
        f"its matmuls are {how} {base}'s{why}: {mixed_matmul_ms:.2f} against "
        f"{base_matmul_ms:.2f} ms of a {base_ms:.2f} ms {base} step"
    )
    other, mixed_other = base_ms - base_matmul_ms, mixed_ms - mixed_matmul_ms
    if mixed_other > 1.05 * other:  # the rest grew too (run-to-run noise is ~5%)
        text += (
            f", and the rest of its step ({rest}) took {mixed_other:.2f} ms against {base}'s "
            f"{other:.2f}"
        )
    return text


def other_work(*, masters: bool, loss_scaling: bool = False) -> str:
    """What a mixed step does besides its matmuls, for ``why_no_gain``'s ``rest``: casts,
    float32 masters only where it keeps them (O2; not O1 or a ``torch.autocast`` loop),
    loss scaling only where it scales (float16, a GradScaler), and its optimizer step."""
    return ", ".join(
        ["casts"] + ["float32 masters"] * masters + ["loss scaling"] * loss_scaling + ["optimizer"]
    )


def no_gain_line(speedup: float, reason: str, over: str | None = None) -> str:
    """The one line that says a mixed run buys (almost) nothing: its ``speedup`` over
    float32, or over the run named ``over``, and ``why_no_gain``'s reason."""
    against = f" over {over}" if over is not None else ""
    return f"mixed precision buys little{against} here ({speedup:.2f}x): {reason}"


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
