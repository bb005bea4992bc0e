"""Benchmark harness: mixprec's modes against plain PyTorch, in one process, interleaved.

``workloads`` holds what is trained, ``modes`` how (and each mode's training step),
``runner`` the timing, ``explain`` why a mode buys little, ``memory`` the peak-memory
probes, ``report`` the table and JSON, ``chart`` the bar chart. ``mixprec bench`` is the
command line over them.
"""

from __future__ import annotations

from mixprec.bench.chart import chart, mode_colours, plot
from mixprec.bench.memory import MemoryArgs, PeakMemory, max_batch
from mixprec.bench.modes import (
    ALL_MODES,
    AUTOCAST_PEERS,
    BASELINE_MODES,
    COMPILED,
    FLOAT8_MODES,
    MODE_HELP,
    MODES,
    POLICY_MODES,
    Step,
    autocast_peer,
    build_step,
    check_compile_mode,
    check_mode,
    compile_modes,
    is_float8_mode,
    mode_for_policy,
    require_float8,
    with_compiled,
)
from mixprec.bench.report import (
    bf16_support,
    device_description,
    device_name,
    from_json,
    notes,
    table,
    to_json,
)
from mixprec.bench.runner import PEAK_TFLOPS, ModeResult, Progress, peak_tflops, run, run_units
from mixprec.bench.workloads import (
    DEFAULT_WORKLOADS,
    WORKLOAD_HELP,
    WORKLOADS,
    Workload,
    get_workload,
    lm_flops,
    workload_factory,
)

__all__ = [
    "ALL_MODES",
    "AUTOCAST_PEERS",
    "BASELINE_MODES",
    "COMPILED",
    "DEFAULT_WORKLOADS",
    "FLOAT8_MODES",
    "MODES",
    "MODE_HELP",
    "PEAK_TFLOPS",
    "POLICY_MODES",
    "WORKLOADS",
    "WORKLOAD_HELP",
    "MemoryArgs",
    "ModeResult",
    "PeakMemory",
    "Progress",
    "Step",
    "Workload",
    "autocast_peer",
    "bf16_support",
    "build_step",
    "chart",
    "check_compile_mode",
    "check_mode",
    "compile_modes",
    "device_description",
    "device_name",
    "from_json",
    "get_workload",
    "is_float8_mode",
    "lm_flops",
    "max_batch",
    "mode_colours",
    "mode_for_policy",
    "notes",
    "peak_tflops",
    "plot",
    "require_float8",
    "run",
    "run_units",
    "table",
    "to_json",
    "with_compiled",
    "workload_factory",
]
