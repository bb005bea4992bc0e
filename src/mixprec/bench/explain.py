"""Why a mode buys little over float32: the one line ``mixprec bench`` prints under a
workload's table for each mode that computes in 16 bits and whose speedup is below
``GAIN_THRESHOLD``, with the measured reason, worded as ``mixprec train`` words it
(``_step_profile.why_no_gain``)."""

from __future__ import annotations

from collections.abc import Mapping

import torch

from mixprec._hardware import cpu_fast, slow_16bit_why
from mixprec._step_profile import (
    GAIN_THRESHOLD,
    no_gain_line,
    other_work,
    profile_step,
    why_no_gain,
)
from mixprec.bench.modes import COMPILED, Step, _matmul_dtype, is_float8_mode
from mixprec.policy import Policy

#: Profiled calls of a step behind its matmul time (after one warm-up call): each costs a
#: step, and the LM's float32 step takes half a second on a 2-core CPU.
PROFILED_STEPS = 3


def emulated(mode: str, device: torch.device) -> str | None:
    """What ``device`` lacks where it emulates ``mode``'s 16-bit (or float8) matmuls,
    slower than float32; ``None`` where it runs them on matrix units, or they are float32."""
    if device.type != "cpu":
        return None
    if is_float8_mode(mode):
        return "float8 matmuls are emulated on CPU (no float8 matrix units)"
    dtype = _matmul_dtype(mode)
    if dtype == "bfloat16" and not cpu_fast("bfloat16"):
        return slow_16bit_why("bfloat16")
    if dtype == "float16" and not cpu_fast("float16"):
        return "float16 matmuls are emulated on this CPU (no AMX-FP16)"
    return None


def _other_work(mode: str, step: Step) -> str:
    """What ``mode``'s step does besides its matmuls: a ``torch.autocast`` loop and O1 keep
    no float32 masters (the step's ``level``: ``"-"`` for the loops, ``build_step``); float16
    modes and a GradScaler scale the loss."""
    scaled = _matmul_dtype(mode) == "float16" or "-scaler-" in mode
    return other_work(masters=getattr(step, "level", "-") == "O2", loss_scaling=scaled)


def _auto_float32(mode: str) -> bool:
    """``auto`` where this hardware's policy is float32."""
    return mode.removesuffix(COMPILED) == "auto" and _matmul_dtype(mode) == "float32"


def needs_reason(mode: str, speedup: float) -> bool:
    """Whether ``mode`` gets a line: below ``GAIN_THRESHOLD``, and computing in 16 bits
    (or float8), or ``auto`` where it picks float32."""
    if speedup >= GAIN_THRESHOLD:
        return False
    return _matmul_dtype(mode) != "float32" or _auto_float32(mode)


def reasons(
    steps: Mapping[str, Step],
    ms_per_step: Mapping[str, float],
    speedups: Mapping[str, float],
    device: torch.device,
) -> tuple[dict[str, str], dict[str, float]]:
    """The line of each mode that ``needs_reason`` (mode: line), and the matmul time of
    each step profiled for it (mode: ms a step). Steps are profiled (``profile_step``) only
    where the reason needs it: float32's and the mode's, unless the mode's matmuls are
    emulated here (the step times say that) or it is ``auto`` picking float32. A matmul
    time is the profiled share of the step times ``ms_per_step``: the share holds where the
    machine's load changes between the timed rounds and the profile, a time would not."""
    lines: dict[str, str] = {}
    matmuls: dict[str, float] = {}

    def profiled(mode: str) -> float:
        if mode not in matmuls:
            share = profile_step(steps[mode], PROFILED_STEPS, device.type).matmul_share
            matmuls[mode] = share * ms_per_step[mode]
        return matmuls[mode]

    base_ms = ms_per_step["float32"]
    for mode, speedup in speedups.items():
        if not needs_reason(mode, speedup):
            continue
        if _auto_float32(mode):
            lines[mode] = (
                f"auto picks float32 here ({Policy('auto').reason}): {speedup:.2f}x, a float32 run"
            )
            continue
        lacking = emulated(mode, device)
        if lacking is not None:
            reason = why_no_gain(base_ms, ms_per_step[mode], emulated=lacking)
        else:
            reason = why_no_gain(
                base_ms, ms_per_step[mode], base_matmul_ms=profiled("float32"),
                mixed_matmul_ms=profiled(mode), rest=_other_work(mode, steps[mode]),
            )  # fmt: skip
        lines[mode] = no_gain_line(speedup, reason)
    return lines, matmuls
