"""Peak training memory: ``PeakMemory``, the probe of one mode in a fresh process, and the
largest batch that fits a budget (``max_batch``)."""

from __future__ import annotations

import multiprocessing
import os
from collections.abc import Callable

import torch

from mixprec._device import resolve_device
from mixprec._rng import leaves_rng
from mixprec.bench.modes import _sync, build_step, check_mode, require_float8, tf32
from mixprec.bench.workloads import get_workload
from mixprec.float8 import Float8Options


class PeakMemory:
    """Peak memory from the moment it is created, in MiB: CUDA's allocator peak, or on Linux
    the process's peak RSS (its counter reset now) above the RSS now. ``mb()`` is ``None``
    where neither can be measured."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.before: float | None = None
        if device.type == "cuda":  # the device measured, not the current one (cuda:1)
            torch.cuda.reset_peak_memory_stats(device)
            self.before = float(torch.cuda.memory_allocated(device))
            return
        try:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")  # resets the peak-RSS counter (VmHWM)
            self.before = _proc_status_mb("VmRSS")
        except OSError:
            self.before = None

    @property
    def kind(self) -> str:
        return "CUDA allocated" if self.device.type == "cuda" else "peak RSS above the start"

    def mb(self) -> float | None:
        if self.before is None:
            return None
        if self.device.type == "cuda":
            return (torch.cuda.max_memory_allocated(self.device) - self.before) / 2**20
        return _proc_status_mb("VmHWM") - self.before


#: ``_peak_memory``'s arguments: workload, mode, device, small, steps, batch, outputs_16bit,
#: compile_mode, float8.
MemoryArgs = tuple[str, str, str, bool, int, int | None, bool, str | None, Float8Options | None]


def _peak_memory(args: MemoryArgs) -> float | None:
    """Peak training memory of one mode in MiB, measured alone in this (fresh) process:
    tensor memory from the model's creation on (CUDA's allocator peak; on CPU the
    profiler's allocation records, as RSS would add the C allocator's fragmentation and
    its noise), or peak RSS where the records are not available."""
    spec, mode, device_name, small, steps, batch, outputs_16bit, compile_mode, float8 = args
    device = resolve_device(device_name)
    work = get_workload(spec, small, batch)

    def train() -> None:
        step = build_step(mode, work, device, outputs_16bit=outputs_16bit,
                          compile_mode=compile_mode, float8=float8)  # fmt: skip
        for _ in range(steps):
            step()
        _sync(device)

    if device.type == "cpu":
        peak = _cpu_allocated_peak_mb(train)
        if peak is not None:
            return peak
    memory = PeakMemory(device)
    with tf32(False):  # float32 as the timed rounds run it (float32-tf32 turns it on itself)
        train()
    return memory.mb()


def _cpu_allocated_peak_mb(run: Callable[[], None]) -> float | None:
    """The peak of CPU tensor memory allocated while ``run`` runs, in MiB, from the
    profiler's allocation and free records (``None`` if this torch does not expose them)."""
    from torch.profiler import ProfilerActivity, profile

    # The profiler logs its start and stop on stderr (fd 2, from C++): silence it here.
    saved = os.dup(2)
    try:
        with open(os.devnull, "w") as null:
            os.dup2(null.fileno(), 2)
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            run()
    finally:
        os.dup2(saved, 2)
        os.close(saved)
    try:
        events = prof.profiler.kineto_results.events()  # type: ignore[union-attr]
        deltas = sorted((e.start_ns(), e.nbytes()) for e in events if e.name() == "[memory]")
    except AttributeError:
        return None
    live = peak = 0
    for _, nbytes in deltas:
        live += nbytes
        peak = max(peak, live)
    return peak / 2**20


def _proc_status_mb(field: str) -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024  # kB
    raise OSError(f"{field} not in /proc/self/status")


@leaves_rng
def max_batch(
    workload: str,
    mode: str,
    budget_mb: float,
    device: str = "auto",
    small: bool = False,
    limit: int = 1 << 16,
    outputs_16bit: bool = False,
    float8: Float8Options | None = None,
    progress: Callable[[int, bool], None] | None = None,
    compile_mode: str | None = None,
) -> int:
    """The largest batch of ``workload`` whose training step, in ``mode`` alone in a fresh
    process, peaks within ``budget_mb``: doubling, then bisection (0 if none fits). The
    search goes no further than ``limit``: where ``limit`` itself fits it is returned, and a
    larger batch may fit too. ``progress(batch, fits)`` is called after each probe."""
    check_mode(mode)
    require_float8([mode])
    ctx = multiprocessing.get_context("spawn")

    def fits(batch: int) -> bool:
        with ctx.Pool(1) as pool:
            args: MemoryArgs = (workload, mode, device, small, 1, batch, outputs_16bit,
                                compile_mode, float8)  # fmt: skip
            peak = pool.apply(_peak_memory, (args,))
        if peak is None:
            raise RuntimeError("peak memory cannot be measured on this platform")
        if progress is not None:
            progress(batch, peak <= budget_mb)
        return peak <= budget_mb

    low, high = 0, 1
    while high <= limit and fits(high):
        low, high = high, high * 2
    if high > limit:  # doubling overshot the limit: the limit itself is probed, not skipped
        if low == limit or fits(limit):
            return limit
        high = limit
    while high - low > max(1, low // 16):  # within ~6%
        middle = (low + high) // 2
        low, high = (middle, high) if fits(middle) else (low, middle)
    return low
