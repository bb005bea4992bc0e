"""Timing the modes: in one process, interleaved, with paired ratios against float32.

Every mode trains the same model (same initial weights, same batch) with SGD. Modes are timed
in turns (one block of steps each, repeated) so that machine noise hits all of them alike;
ratios are against float32, and against plain ``torch.autocast`` in the mode's 16-bit dtype
(``autocast_peer``), in the same run.
"""

from __future__ import annotations

import math
import multiprocessing
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from mixprec._compile import recompile_room
from mixprec._device import resolve_device
from mixprec._rng import leaves_rng
from mixprec.bench.explain import reasons
from mixprec.bench.faults import FaultMeter
from mixprec.bench.memory import MemoryArgs, _peak_memory
from mixprec.bench.modes import (
    COMPILED,
    MODES,
    Step,
    _matmul_dtype,
    _sync,
    autocast_peer,
    build_step,
    check_compile_mode,
    check_mode,
    require_float8,
    tf32,
    uses_tf32,
)
from mixprec.bench.workloads import get_workload
from mixprec.float8 import Float8Options

#: Dense peak TFLOP/s per GPU, by the words of its name and matmul dtype, from the vendors'
#: data sheets (float32 without TF32, as ``run`` measures it). A name matches when all its
#: words are words of the device's name, the most specific first ("H100 PCIe" before
#: "H100", the SXM part); "L4" is not "L40S". float8 modes are measured against the
#: bfloat16 peak (see ``_matmul_dtype``). Another GPU gets no MFU.
PEAK_TFLOPS: dict[str, dict[str, float]] = {
    "H200": {"bfloat16": 989.4, "float16": 989.4, "tfloat32": 494.7, "float32": 66.9},
    "GH200": {"bfloat16": 989.4, "float16": 989.4, "tfloat32": 494.7, "float32": 66.9},
    "H100 PCIe": {"bfloat16": 756.0, "float16": 756.0, "tfloat32": 378.0, "float32": 51.2},
    "H100": {"bfloat16": 989.4, "float16": 989.4, "tfloat32": 494.7, "float32": 66.9},
    "A100": {"bfloat16": 312.0, "float16": 312.0, "tfloat32": 156.0, "float32": 19.5},
    "L40S": {"bfloat16": 362.1, "float16": 362.1, "tfloat32": 183.0, "float32": 91.6},
    "L40": {"bfloat16": 181.0, "float16": 181.0, "tfloat32": 90.5, "float32": 90.5},
    "L4": {"bfloat16": 121.0, "float16": 121.0, "tfloat32": 60.0, "float32": 30.3},
}

#: ``run``'s progress callback: called once per unit of work done (``run_units`` counts
#: them), with what was done, such as ``"O2-bf16: round 2/5"``.
Progress = Callable[[str], None]


def _quiet(done: str) -> None:
    """The default ``Progress``: says nothing."""


def run_units(modes: Sequence[str], repeats: int, memory: bool = True, explain: bool = True) -> int:
    """How many times ``run`` calls its ``progress`` with these arguments: for each mode
    (float32 included, each mode once), after its warm-up, after each of its ``repeats``
    timed rounds and, with ``memory``, after its memory probe; with ``explain``, once more
    after the matmul profiles behind the reasons (``no_gain``)."""
    count = len(_run_modes(modes))
    return count * (1 + repeats + int(memory)) + int(explain)


def _run_modes(modes: Sequence[str]) -> list[str]:
    """The modes ``run`` times: each once, in order, float32 first where it is missing."""
    unique = list(dict.fromkeys(modes))
    return unique if "float32" in unique else ["float32", *unique]


def peak_tflops(device: torch.device, kind: str) -> float | None:
    """The data-sheet peak of ``device`` for ``kind`` (see ``PEAK_TFLOPS``), or None."""
    if device.type != "cuda":
        return None
    words = set(torch.cuda.get_device_name(device).upper().replace("-", " ").split())
    for name in sorted(PEAK_TFLOPS, key=lambda n: -len(n.split())):
        if set(name.upper().split()) <= words:
            return PEAK_TFLOPS[name].get(kind)
    return None


@dataclass
class ModeResult:
    """One mode's figures from ``run``."""

    mode: str
    level: str
    ms_per_step: float
    samples_per_s: float
    speedup: float  # median over rounds of float32's ms / this mode's ms in the same round
    final_loss: float
    peak_mb: float | None
    tokens_per_s: float | None = None
    tflops: float | None = None  # achieved model TFLOP/s (workloads that state their FLOPs)
    mfu: float | None = None  # model FLOPs utilisation: tflops / the device's peak
    compile_s: float | None = None  # +compile modes: the first step's time above a steady one
    float8_layers: int | None = None  # float8 modes: Linear layers converted to float8...
    linear_layers: int | None = None  # ...of this many
    speedup_min: float | None = None  # the lowest of the rounds' ratios behind ``speedup``...
    speedup_max: float | None = None  # ...and the highest: the spread between rounds
    #: The plain ``torch.autocast`` mode this one is compared with (``autocast_peer``),
    #: where it ran, and the median over rounds of its ms / this mode's ms in the same round.
    autocast_peer: str | None = None
    vs_autocast: float | None = None
    #: Where the mode computes in 16 bits and ``speedup`` is below ``GAIN_THRESHOLD``: the
    #: line that says so and why, measured (``bench.explain``)...
    no_gain: str | None = None
    #: ...and the ms a step in matmuls and convolutions of each mode profiled for it.
    matmul_ms: float | None = None
    #: On CPU (not Windows), medians over the rounds: the minor page faults a step, and the
    #: share of the step's CPU time spent in the kernel (``bench.faults``); None elsewhere.
    page_faults: float | None = None
    kernel_share: float | None = None


@leaves_rng
def run(
    workload: str,
    modes: Sequence[str] = MODES,
    repeats: int = 5,
    steps: int = 3,
    warmup: int = 2,
    device: str = "auto",
    memory: bool = True,
    small: bool = False,
    min_round_ms: float = 100.0,
    outputs_16bit: bool = False,
    compile_mode: str | None = None,
    float8: Float8Options | None = None,
    progress: Progress = _quiet,
    explain: bool = True,
) -> list[ModeResult]:
    """Benchmark ``modes`` on ``workload``; ``repeats`` rounds per mode, interleaved, after
    ``warmup`` steps each (at least 2). A round is ``steps`` steps, or more where the
    fastest mode would finish them in under ``min_round_ms`` (a 1 ms step timed 3 at a time
    measures the timer and the cache left by the previous mode); every mode runs the same
    number of steps, so their final losses compare. Rounds run the modes forwards and
    backwards in turn. ms/step is the median of the per-round ms/step; the speedup, the
    median of the per-round ratios to float32, and their lowest and highest are kept
    (``speedup_min``, ``speedup_max``); ``vs_autocast``, the median of the per-round
    ratios to the mode's ``autocast_peer``, where the peer is among the modes. With
    ``explain``, a mode that computes in 16 bits and gains less than ``GAIN_THRESHOLD``
    over float32 gets the measured reason (``no_gain``), which may profile a few more
    steps of it and of float32 (``bench.explain``). A mode named twice runs once.
    ``outputs_16bit``, ``compile_mode`` and ``float8`` as in ``build_step``; a ``+compile``
    mode's compile time is its first step's time above its steady-state ms/step, kept
    apart. float8 modes need torchao: ``ImportError`` naming ``mixprec[float8]`` first.
    ``progress`` is called after each unit of work (see ``run_units``)."""
    for mode in modes:
        check_mode(mode)
    if compile_mode is not None:
        check_compile_mode(compile_mode)
    require_float8(modes)
    modes = _run_modes(modes)
    dev = resolve_device(device)
    work = get_workload(workload, small)
    if any(m.endswith(COMPILED) for m in modes):
        # Every mode's step shares one code object; dynamo would take this workload's new
        # shapes for dynamic ones after the previous workload's (automatic dynamic shapes).
        torch._dynamo.reset()
    built = {
        mode: build_step(mode, work, dev, outputs_16bit=outputs_16bit,
                         compile_mode=compile_mode, float8=float8)
        for mode in modes
    }  # fmt: skip
    no_gain: dict[str, str] = {}
    matmuls: dict[str, float] = {}
    # float32 without TF32 (which rounds matmul inputs to 10 mantissa bits on CUDA), for a
    # true float32 baseline; the profiles behind the reasons too, float32 as timed.
    meters = {m: FaultMeter() for m in modes} if dev.type == "cpu" else {}
    # One compiled version of that code object per compiled mode, past dynamo's limit of 8.
    with tf32(False), recompile_room(sum(m.endswith(COMPILED) for m in modes)):
        times, last, first = _time_modes(
            built, repeats, steps, warmup, dev, min_round_ms, progress=progress, meters=meters
        )
        ratios = {m: _ratios(times, "float32", m) for m in modes}
        speedups = {m: statistics.median(r) for m, r in ratios.items()}
        ms_per_step = {m: statistics.median(t) for m, t in times.items()}
        if explain:
            no_gain, matmuls = reasons(built, ms_per_step, speedups, dev)
            progress("matmul profiles" if matmuls else "no matmul profile needed")
    peaks: dict[str, float | None] = dict.fromkeys(modes)
    if memory:
        ctx = multiprocessing.get_context("spawn")
        with ctx.Pool(1, maxtasksperchild=1) as pool:
            for mode in modes:
                args: MemoryArgs = (workload, mode, device, small, 2, None, outputs_16bit,
                                    compile_mode, float8)  # fmt: skip
                peaks[mode] = pool.apply(_peak_memory, (args,))
                progress(f"{mode}: peak memory")
    results = []
    for mode in modes:
        ms = ms_per_step[mode]
        peer = autocast_peer(mode)
        vs_peer = None
        if peer is not None and peer in times:
            vs_peer = statistics.median(_ratios(times, peer, mode))
        converted, linears = getattr(built[mode], "float8", None) or (None, None)
        tflops = work.flops / ms / 1e9 if work.flops else None
        peak = peak_tflops(dev, "tfloat32" if uses_tf32(mode) else _matmul_dtype(mode))
        faults, kernel_share = meters[mode].per_step() if mode in meters else (None, None)
        results.append(
            ModeResult(
                mode=mode,
                level=getattr(built[mode], "level", "-"),
                ms_per_step=ms,
                samples_per_s=1000 * work.samples / ms,
                speedup=speedups[mode],
                final_loss=float(last[mode]),
                peak_mb=peaks[mode],
                tokens_per_s=1000 * work.tokens / ms if work.tokens else None,
                tflops=tflops,
                mfu=tflops / peak if tflops is not None and peak else None,
                compile_s=(first[mode] - ms) / 1000 if mode.endswith(COMPILED) else None,
                float8_layers=converted,
                linear_layers=linears,
                speedup_min=min(ratios[mode]),
                speedup_max=max(ratios[mode]),
                autocast_peer=peer if vs_peer is not None else None,
                vs_autocast=vs_peer,
                no_gain=no_gain.get(mode),
                matmul_ms=matmuls.get(mode),
                page_faults=faults,
                kernel_share=kernel_share,
            )
        )
    return results


def _ratios(times: dict[str, list[float]], base: str, mode: str) -> list[float]:
    """Each round's ``base`` ms over ``mode``'s in the same round: paired, so that load
    drifting between rounds (a shared machine) cancels instead of tilting the medians."""
    return [b / t for b, t in zip(times[base], times[mode], strict=True)]


def _time_modes(
    built: dict[str, Step],
    repeats: int,
    steps: int,
    warmup: int,
    dev: torch.device,
    min_round_ms: float,
    progress: Progress = _quiet,
    meters: dict[str, FaultMeter] | None = None,
) -> tuple[dict[str, list[float]], dict[str, torch.Tensor], dict[str, float]]:
    """Per mode: the ms/step of each round, the loss of the last step, and the ms of the
    first step (which compiles, for compiled modes). ``progress`` after each mode's warm-up
    and each mode's round. Each mode in ``meters`` counts its rounds' page faults."""
    meters = meters or {}
    last: dict[str, torch.Tensor] = {}
    first: dict[str, float] = {}
    fastest = float("inf")
    for mode, step in built.items():
        for i in range(max(warmup, 2)):  # the first step is cold: calibrate on a later one
            _sync(dev)
            start = time.perf_counter()
            last[mode] = step()
            _sync(dev)
            ms = 1000 * (time.perf_counter() - start)
            if i == 0:
                first[mode] = ms
            else:
                fastest = min(fastest, ms)
        progress(f"{mode}: warm-up")
    steps = max(steps, math.ceil(min_round_ms / max(fastest, 1e-3)))
    times: dict[str, list[float]] = {mode: [] for mode in built}
    order = list(built.items())
    for r in range(repeats):
        # Every other round backwards: no mode always follows the same one (whose cache
        # and allocator state it would inherit).
        for mode, step in order if r % 2 == 0 else order[::-1]:
            meter = meters.get(mode)
            _sync(dev)
            if meter is not None:
                meter.start()
            start = time.perf_counter()
            for _ in range(steps):
                last[mode] = step()
            _sync(dev)
            times[mode].append(1000 * (time.perf_counter() - start) / steps)
            if meter is not None:
                meter.stop(steps)
            progress(f"{mode}: round {r + 1}/{repeats}")
    return times, last, first
