"""The benchmark's results as a text table and as JSON, with the device they ran on and
notes on what the figures of this device do not measure."""

from __future__ import annotations

import json
import mmap
from collections.abc import Sequence
from dataclasses import asdict, fields

import torch

from mixprec._device import resolve_device
from mixprec._hardware import cpu_16bit_units, cpu_fast, cpu_model, cpuinfo_field, probe_hardware
from mixprec.bench.faults import FAULT_SHARE, KEEP_HEAP_ENV, MIN_FAULTS, allocator
from mixprec.bench.modes import COMPILED, _matmul_dtype, is_float8_mode
from mixprec.bench.runner import ModeResult


def table(workload: str, results: list[ModeResult]) -> str:
    """The results as a text table; ``vs autocast`` where a mode's autocast peer ran;
    float8 modes add their converted Linear layers (``fp8``: converted/all) and, below,
    their speed against ``O2-bf16`` run the same way. Below those, one line for each mode
    that buys little over float32, with the measured reason (``ModeResult.no_gain``); then
    compiled modes slower than eager, and modes that spend much of a step in page faults."""
    header = f"{'mode':<34} {'level':<5}"
    float8 = any(r.float8_layers is not None for r in results)
    if float8:
        header += f" {'fp8':>5}"
    header += f" {'ms/step':>9} {'samples/s':>10} {'vs f32':>7}"
    peers = any(r.vs_autocast is not None for r in results)
    if peers:
        header += f" {'vs autocast':>11}"
    header += f" {'peak MB':>8} {'loss':>8}"
    lm = any(r.tokens_per_s is not None for r in results)
    if lm:
        header += f" {'tokens/s':>9} {'TFLOP/s':>8} {'MFU':>6}"
    compiled = any(r.compile_s is not None for r in results)
    if compiled:
        header += f" {'compile s':>9}"
    lines = [f"workload {workload}", header, "-" * len(header)]
    for r in results:
        line = f"{r.mode:<34} {r.level:<5}"
        if float8:
            layers = f"{r.float8_layers}/{r.linear_layers}" if r.float8_layers is not None else "-"
            line += f" {layers:>5}"
        line += f" {r.ms_per_step:>9.2f} {r.samples_per_s:>10.0f} {r.speedup:>6.2f}x"
        if peers:
            line += f" {r.vs_autocast:>10.2f}x" if r.vs_autocast is not None else f" {'-':>11}"
        line += f" {_fmt(r.peak_mb, '8.0f')} {r.final_loss:>8.4f}"
        if lm:
            line += f" {_fmt(r.tokens_per_s, '9.0f')} {_fmt(r.tflops, '8.3f')}"
            line += f" {100 * r.mfu:5.1f}%" if r.mfu is not None else f" {'-':>6}"
        if compiled:
            line += f" {_fmt(r.compile_s, '9.1f')}"
        lines.append(line)
    by_mode = {r.mode: r for r in results}
    unit = "tokens/s" if lm else "samples/s"
    for r in results:
        bf16 = by_mode.get("O2-bf16" + (COMPILED if r.mode.endswith(COMPILED) else ""))
        if r.float8_layers is not None and bf16 is not None:
            lines.append(
                f"{r.mode}: {bf16.ms_per_step / r.ms_per_step:.2f}x the {unit} of {bf16.mode}"
            )
    lines += [f"{workload} {r.mode}: {r.no_gain}" for r in results if r.no_gain]
    lines += slower_compiled(workload, results)
    lines += fault_lines(workload, results)
    return "\n".join(lines)


#: A compiled mode this much slower than its eager twin is said to be (noise below).
SLOWER_COMPILED = 1.05


def slower_compiled(workload: str, results: list[ModeResult]) -> list[str]:
    """One line for each compiled mode slower than the same mode run eagerly in this run:
    ``torch.compile`` is not always faster (on CPU its generated kernels can lose to
    oneDNN's), and a user who compiles by default should hear it, not pick the slower path
    silently."""
    eager = {r.mode: r for r in results if not r.mode.endswith(COMPILED)}
    lines = []
    for r in results:
        twin = eager.get(r.mode.removesuffix(COMPILED)) if r.mode.endswith(COMPILED) else None
        if twin is not None and r.ms_per_step > SLOWER_COMPILED * twin.ms_per_step:
            lines.append(
                f"{workload} {r.mode}: compiled is slower than eager here ({r.ms_per_step:.2f} "
                f"vs {twin.ms_per_step:.2f} ms a step, {twin.ms_per_step / r.ms_per_step:.2f}x): "
                "train this workload eagerly on this machine (compile=False)"
            )
    return lines


def fault_lines(workload: str, results: Sequence[ModeResult]) -> list[str]:
    """One line for each mode whose step takes ``MIN_FAULTS`` page faults or more and
    spends ``FAULT_SHARE`` or more of its CPU time in the kernel, with how to keep the
    heap. The MiB assume one base page a fault (transparent huge pages map more)."""
    lines = []
    for r in results:
        faults, share = r.page_faults, r.kernel_share
        if faults is None or share is None or faults < MIN_FAULTS or share < FAULT_SHARE:
            continue
        mib = faults * mmap.PAGESIZE / 2**20
        lines.append(
            f"{workload} {r.mode}: {faults:.0f} page faults a step (at least {mib:.0f} MiB "
            f"taken from the OS again), {share:.0%} of its CPU time in the kernel: the C "
            f"allocator hands freed memory back after each step. Keep it: {KEEP_HEAP_ENV} "
            "in the environment (glibc), or jemalloc/tcmalloc; see docs/benchmarks.md"
        )
    return lines


def _fmt(value: float | None, spec: str) -> str:
    width = int(spec.split(".")[0])
    return format(value, spec) if value is not None else "-".rjust(width)


def notes(modes: Sequence[str], device: str = "auto") -> list[str]:
    """What the figures of ``modes`` on ``device`` do not measure: 16-bit and float8
    matmuls that this device emulates, and eager float8 on CUDA (fast compiled only)."""
    dev = resolve_device(device)
    dtypes = {_matmul_dtype(m) for m in modes if not is_float8_mode(m)}
    float8 = [m for m in modes if is_float8_mode(m)]
    found: list[str] = []
    if dev.type == "cpu":
        if ("bfloat16" in dtypes or float8) and not cpu_fast("bfloat16"):
            found.append(
                ("CPU with AVX512-BF16 and no AMX: bfloat16 matmuls measured slower than "
                 "float32's here" if cpu_16bit_units() else
                 "CPU without AVX512-BF16 or AMX: bfloat16 matmuls are emulated here, slower "
                 "than float32")
                + "; the bf16 figures compare the modes at equal, slow matmuls, not "
                "bfloat16's speed"
            )  # fmt: skip
        if "float16" in dtypes and not cpu_fast("float16"):
            found.append("CPU without AMX-FP16: float16 matmuls are emulated here, very slowly")
    if dev.type == "cpu" and float8:
        found.append(
            "float8 on CPU is emulated (torch's CPU _scaled_mm; no CPU float8 matrix units): "
            "the fp8 figures measure the emulation, not float8's speed, which needs CUDA "
            "sm_89+ (H100/H200, L4) and +compile"
        )
    if dev.type == "cuda" and any(not m.endswith(COMPILED) for m in float8):
        found.append(
            "float8 is fast under torch.compile only (it fuses torchao's scaling and casts): "
            "compare the +compile fp8 modes"
        )
    return found


def device_name(device: str = "auto") -> str:
    """The GPU's name, or the CPU's model name, of ``device`` as given to ``run``."""
    dev = resolve_device(device)
    return torch.cuda.get_device_name(dev) if dev.type == "cuda" else _cpu_name()


def bf16_support(device: str = "auto") -> str:
    """Whether ``device`` (as given to ``run``) runs bfloat16 matrix work fast, and by what:
    on a CPU its AVX512-BF16 / AMX units (``cpu_16bit_units``), on a GPU its compute
    capability (``probe_hardware``). This decides whether the bf16 figures measure
    bfloat16's speed."""
    dev = resolve_device(device)
    hw = probe_hardware()
    if dev.type == "cuda" and hw.device == "cuda":
        return f"{'fast' if hw.bf16_fast else 'no fast'} bf16 ({hw.detail.rpartition('(')[2][:-1]})"
    if dev.type != "cpu":
        return "bf16 speed unknown"
    if not cpu_fast("bfloat16"):
        if cpu_16bit_units():
            return "no fast bf16 (AVX512-BF16 without AMX: bfloat16 matmuls measured slower)"
        return "no fast bf16 (no AVX512-BF16 or AMX: bfloat16 matmuls are emulated)"
    units = [u for u in cpu_16bit_units() if u.endswith("BF16")]
    # No units by name: no CPU flags to read (macOS, Windows), and oneDNN said yes.
    return f"fast bf16 ({', '.join(units) or 'oneDNN bf16 support reported'})"


def device_description(device: str = "auto") -> str:
    """``device`` (as given to ``run``) in a few words, with what decides its 16-bit
    figures: on a CPU its short model name (``cpu_model``), its bfloat16 units
    (``bf16_support``), AMX-FP16 where it has it, and the threads torch uses (``"Intel Xeon,
    fast bf16 (AMX-BF16, AVX512-BF16), 2 threads"``); on a GPU its name and bf16 support.
    The chart's subtitle and the JSON's ``device_description``."""
    dev = resolve_device(device)
    if dev.type == "cuda":
        return f"{torch.cuda.get_device_name(dev)}, {bf16_support(device)}"
    fp16 = ", fast fp16 (AMX-FP16)" if dev.type == "cpu" and cpu_fast("float16") else ""
    threads = torch.get_num_threads()
    return f"{cpu_model()}, {bf16_support(device)}{fp16}, {threads} thread{'s' * (threads != 1)}"


def to_json(
    all_results: dict[str, list[ModeResult]], outputs_16bit: bool = False, device: str = "auto"
) -> str:
    """The results as JSON, with the device they ran on (``device`` as given to ``run``:
    its name, bf16 support, ``device_description`` and torch's CPU threads) and the
    ``notes`` on what its figures do not measure. ``from_json`` reads it back."""
    dev = resolve_device(device)
    modes = list(dict.fromkeys(r.mode for rs in all_results.values() for r in rs))
    return json.dumps(
        {
            "torch": torch.__version__,
            "device": dev.type,
            "device_name": device_name(device),
            "bf16": bf16_support(device),
            "device_description": device_description(device),
            "threads": torch.get_num_threads(),
            "allocator": allocator(),
            "float32_matmul": "IEEE float32 (TF32 off), but TF32 in float32-tf32",
            "outputs_16bit": outputs_16bit,
            "notes": notes(modes, device),
            "results": {w: [asdict(r) for r in rs] for w, rs in all_results.items()},
        },
        indent=2,
    )


def from_json(text: str) -> dict[str, list[ModeResult]]:
    """The results of a ``to_json`` text, by workload, as ``chart`` takes them. A field the
    text lacks takes its default (the committed ``docs/bench_*.json`` hold fewer fields);
    a field ``ModeResult`` does not have is left out."""
    known = {f.name for f in fields(ModeResult)}
    return {
        workload: [ModeResult(**{k: v for k, v in r.items() if k in known}) for r in results]
        for workload, results in json.loads(text)["results"].items()
    }


def _cpu_name() -> str:
    import platform

    return cpuinfo_field("model name") or platform.processor() or "cpu"
