"""Benchmark harness: mixprec's modes against plain PyTorch, in one process, interleaved.

Every mode trains the same model (same initial weights, same batch) with SGD. Baselines are
what users write by hand: float32, and ``torch.autocast`` with ``torch.amp.GradScaler``.
Modes are timed in turns (one block of steps each, repeated) so that machine noise hits all
of them alike; ratios are against float32 in the same run.
"""

from __future__ import annotations

import contextlib
import importlib
import json
import math
import multiprocessing
import os
import statistics
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from mixprec._compile import compile_step
from mixprec._dtypes import dtype_name
from mixprec._hardware import cpuinfo_field, probe_hardware
from mixprec.float8 import Float8Options, layer_counts, torchao_float8
from mixprec.levels import applied, auto_mixed_precision
from mixprec.models import CausalLM, cnn, lm_loss, mlp
from mixprec.optim import LossScaleOptimizer
from mixprec.policy import Policy
from mixprec.scaling import all_finite

if TYPE_CHECKING:
    from matplotlib.figure import Figure

Step = Callable[[], torch.Tensor]


@dataclass(frozen=True)
class Workload:
    """A model factory, one batch, a loss, and how many samples a step sees."""

    name: str
    make_model: Callable[[], nn.Module]
    batch: tuple[torch.Tensor, torch.Tensor]
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    samples: int
    tokens: int = 0
    flops: float = 0.0  # model FLOPs of one training step (forward + backward), 0 if unknown
    #: Which Linear layers the float8 modes convert; ``None``: torchao's size thresholds
    #: (``Float8Options()``), measured on H100, under which small models convert nothing.
    float8: Float8Options | None = None


def _mlp(batch: int) -> Workload:
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(batch, 784, generator=g), torch.randint(0, 10, (batch,), generator=g)
    return Workload(f"mlp-b{batch}", lambda: mlp(784), (x, y), _float32_cross_entropy, batch)


def _float32_cross_entropy(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """The classifier loss users write: in float32 whatever the model returns."""
    return F.cross_entropy(out.float(), y)


def _lm(
    d_model: int = 512, layers: int = 4, batch: int = 8, length: int = 256, heads: int = 8
) -> Workload:
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, 8192, (batch, length), generator=g)

    def make() -> CausalLM:
        return CausalLM(vocab=8192, d_model=d_model, n_layers=layers, n_heads=heads, max_len=length)

    n_tokens = batch * length
    # float8 modes convert every Linear of the blocks (none has a dim below d_model; all are
    # multiples of 16), whatever d_model is, so that the float8 figures measure float8 in
    # all the blocks' matmuls and not torchao's size rule, which converts nothing at
    # --small's d=64. The head stays bfloat16 (Float8Options.keep_head). At d >= 2048 these
    # are the layers torchao's tensorwise rule converts anyway (its rowwise rule: half).
    return Workload(
        f"lm-d{d_model}", make, (tokens, tokens), lambda out, t: lm_loss(out, t), batch,
        tokens=n_tokens, flops=lm_flops(_on_meta(make), n_tokens, length),
        float8=Float8Options(min_features=d_model),
    )  # fmt: skip


def _on_meta(make: Callable[[], CausalLM]) -> CausalLM:
    """The model's structure without allocating or initialising its weights."""
    with torch.device("meta"):
        return make()


def lm_flops(model: CausalLM, tokens: int, length: int) -> float:
    """Training FLOPs of a step of ``tokens`` tokens in sequences of ``length``: 6 per
    weight of the matrix multiplies per token (forward 2, backward 4), plus attention's
    scores and weighted sum, 12 * layers * d_model * length per token (Kaplan et al. 2020,
    without the causal halving, as MFU figures are usually quoted). Embedding lookups
    are not matrix work and do not count."""
    embeddings = sum(m.weight.numel() for m in (model.embed, model.pos))
    weights = sum(p.numel() for p in model.parameters()) - embeddings
    d_model, layers = model.embed.embedding_dim, len(model.blocks)
    return float(6 * weights * tokens + 12 * layers * d_model * length * tokens)


#: Dense peak TFLOP/s per GPU, by name fragment and matmul dtype, from the vendors' data
#: sheets (SXM parts; float32 without TF32, as ``run`` measures it). float8 modes are
#: measured against the bfloat16 peak (see ``_matmul_dtype``).
PEAK_TFLOPS: dict[str, dict[str, float]] = {
    "H200": {"bfloat16": 989.4, "float16": 989.4, "float32": 66.9},
    "H100": {"bfloat16": 989.4, "float16": 989.4, "float32": 66.9},
    "A100": {"bfloat16": 312.0, "float16": 312.0, "float32": 19.5},
    "L4": {"bfloat16": 121.0, "float16": 121.0, "float32": 30.3},
}


def peak_tflops(device: torch.device, kind: str) -> float | None:
    """The data-sheet peak of ``device`` for ``kind`` (see ``PEAK_TFLOPS``), or None."""
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    for fragment, peaks in PEAK_TFLOPS.items():
        if fragment in name:
            return peaks.get(kind)
    return None


def _matmul_dtype(mode: str) -> str:
    """The dtype whose peak a mode's MFU is against. float8 modes: bfloat16's, as their
    attention, output head and unconverted layers run bfloat16, so that their MFU and a
    bfloat16 mode's compare as their speeds do (against the float8 peak, twice bfloat16's,
    a float8 mode would read half as efficient for the same speed)."""
    base = mode.removesuffix(COMPILED)
    if base == "auto":
        return dtype_name(Policy("auto").compute_dtype)
    if base in FLOAT8_MODES:
        return "bfloat16"
    return {"bf16": "bfloat16", "fp16": "float16"}.get(base.rpartition("-")[2], "float32")


@contextlib.contextmanager
def _true_float32(device: torch.device) -> Iterator[None]:
    """On CUDA, float32 matmuls and convolutions without TF32 (which rounds their inputs
    to 10 mantissa bits), for a true float32 baseline; the settings are restored after."""
    if device.type != "cuda":
        yield
        return
    saved = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved


def _cnn(batch: int = 64) -> Workload:
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(batch, 28, 28, generator=g), torch.randint(0, 10, (batch,), generator=g)
    return Workload("cnn", lambda: cnn(1, 10), (x, y), _float32_cross_entropy, batch)


# Each takes an optional batch size (for --max-batch); None is the workload's own.
WORKLOADS: dict[str, Callable[[int | None], Workload]] = {
    "mlp-b64": lambda b: _mlp(b or 64),
    "mlp-b8192": lambda b: _mlp(b or 8192),
    "lm-d512": lambda b: _lm(batch=b or 8),
    "cnn": lambda b: _cnn(b or 64),
    # For GPUs (float8's speed target is set at d >= 2048): 8 blocks of d=2048, 16 heads of
    # 128, 8 x 1024 tokens a step, 22 model TFLOPs. It runs on CPU, slowly.
    "lm-d2048": lambda b: _lm(2048, 8, b or 8, 1024, heads=16),
}

#: What ``mixprec bench`` runs when no workload is named (lm-d2048 is for GPUs).
DEFAULT_WORKLOADS: tuple[str, ...] = ("mlp-b64", "mlp-b8192", "lm-d512", "cnn")

MODES: tuple[str, ...] = (
    "float32",
    "torch-autocast-bf16",
    "torch-autocast-scaler-bf16",
    "torch-autocast-fp16",
    "O1-bf16",
    "O2-bf16",
    "O3-bf16",
    "auto-bf16",
    "O1-fp16",
    "O2-fp16",
    "auto-fp16",
    "auto",
)

#: float8 modes, one per torchao recipe, and their policies: O2 (the rest of the model
#: stored in bfloat16, float32 masters; converted layers keep float32 weights), as
#: ``auto-bf16``. Not in ``MODES`` (the default list): they need torchao
#: (``mixprec[float8]``), and they are emulated, slowly, without float8 matrix units.
FLOAT8_MODES: dict[str, str] = {
    "O2-fp8": "mixed_float8",  # torchao's tensorwise recipe
    "O2-fp8-rowwise": "mixed_float8_rowwise",
    "O2-fp8-rowwise_with_gw_hp": "mixed_float8_rowwise_with_gw_hp",
}

#: Opt-in baselines, not in ``MODES``. ``float32-checked``: float32 that skips a step whose
#: gradients hold inf/NaN, checked by hand with ``all_finite``; what skipping costs in any
#: loop, and all that ``LossScaleOptimizer`` adds to float32 training.
BASELINE_MODES: tuple[str, ...] = ("float32-checked",)

#: Every mode ``build_step`` accepts, each also with the ``+compile`` suffix.
ALL_MODES: tuple[str, ...] = (*MODES, *FLOAT8_MODES, *BASELINE_MODES)


def get_workload(spec: str, small: bool = False, batch: int | None = None) -> Workload:
    """A named workload (at ``batch`` samples if given), or ``module:function`` returning
    a ``Workload``."""
    if ":" in spec:
        module, _, func = spec.partition(":")
        return getattr(importlib.import_module(module), func)()  # type: ignore[no-any-return]
    if spec not in WORKLOADS:
        raise ValueError(
            f"unknown workload {spec!r}; valid: {', '.join(WORKLOADS)} or module:function"
        )
    if small:  # tiny versions for tests
        if spec == "lm-d512":
            return _lm(64, 1, batch or 2, 32)
        if spec == "lm-d2048":  # the width is the point: one block at d=2048, 2 x 64 tokens
            return _lm(2048, 1, batch or 2, 64, heads=16)
        if spec == "mlp-b8192":
            return _mlp(batch or 256)
    return WORKLOADS[spec](batch)


def _device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


#: Suffix of a mode run under ``torch.compile`` (``"O2-bf16+compile"``): its forward and loss
#: are one compiled function; backward runs AOTAutograd's compiled graph, the optimizer step
#: stays eager as in ``TrainStep``.
COMPILED = "+compile"


def with_compiled(modes: Sequence[str]) -> list[str]:
    """``modes`` followed by the compiled version of each (``mixprec bench --compile``)."""
    return [*modes, *(m + COMPILED for m in modes if not m.endswith(COMPILED))]


def check_mode(mode: str) -> str:
    """``mode`` without its ``+compile`` suffix, after checking that it names a mode."""
    base = mode.removesuffix(COMPILED)
    if base not in ALL_MODES:
        raise ValueError(
            f"unknown mode {mode!r}; valid: {', '.join(ALL_MODES)}, each optionally with "
            f"{COMPILED!r}" + _policy_hint(base)
        )
    return base


def _policy_hint(name: str) -> str:
    mode = mode_for_policy(name)
    return f" (policy {name!r} is mode {mode!r})" if mode else ""


#: The mode that runs each policy at level O2 (``--policy``, and a policy given as a mode).
POLICY_MODES: dict[str, str] = {
    "mixed_bfloat16": "O2-bf16",
    "mixed_float16": "O2-fp16",
    **{policy: mode for mode, policy in FLOAT8_MODES.items()},
}


def mode_for_policy(name: str) -> str | None:
    """The mode that runs policy ``name`` at level O2 (``"mixed_float8"``: ``"O2-fp8"``),
    for a policy name given where a mode is expected; ``None`` for other names."""
    return POLICY_MODES.get(name)


def is_float8_mode(mode: str) -> bool:
    return mode.removesuffix(COMPILED) in FLOAT8_MODES


def require_float8(modes: Sequence[str]) -> None:
    """``ImportError`` naming ``mixprec[float8]`` when ``modes`` has a float8 mode and
    torchao is not installed."""
    if any(is_float8_mode(m) for m in modes):
        torchao_float8()


def build_step(
    mode: str,
    work: Workload,
    device: torch.device,
    lr: float = 0.01,
    outputs_16bit: bool = False,
    compile_mode: str | None = None,
    float8: Float8Options | None = None,
) -> Step:
    """The training step of ``mode``, ready to call; returns the (detached) loss.

    ``outputs_16bit``: the model's output reaches the loss in the compute dtype (a policy
    with ``output_dtype`` the compute dtype; autocast's output as it comes) instead of
    float32; the workloads' losses compute in float32 either way. ``compile_mode``: the
    ``mode`` given to ``torch.compile`` for ``+compile`` modes (default: its default).
    ``float8``: which Linear layers float8 modes convert, in place of the workload's
    ``float8`` (whose ``None`` is torchao's size thresholds).

    The step's ``level`` attribute is the level applied (``"-"`` for the hand-written
    loops); its ``float8`` attribute, for float8 modes, is ``(converted, linear layers)``,
    else ``None``."""
    base = check_mode(mode)
    torch.manual_seed(0)
    model = work.make_model().to(device)
    x, y = (t.to(device) for t in work.batch)
    loss_fn = work.loss_fn
    forward_loss: Callable[[], torch.Tensor]
    level = "-"
    float8_layers: tuple[int, int] | None = None
    float32 = base.startswith("float32")
    if float32 or base.startswith("torch-autocast"):
        opt: torch.optim.Optimizer = torch.optim.SGD(model.parameters(), lr=lr)
        params = list(model.parameters())
        dtype = torch.bfloat16 if base.endswith("bf16") else torch.float16
        # The loop users write by hand: autocast around the forward, float32 loss,
        # GradScaler (needed for float16; with bfloat16 users usually drop it, and with it
        # the skipping of non-finite steps, which "-scaler-bf16" keeps).
        scaler = torch.amp.GradScaler(
            device.type, enabled=dtype == torch.float16 or "-scaler-" in base
        )

        def forward_loss() -> torch.Tensor:
            if float32:
                return loss_fn(model(x), y)
            with torch.autocast(device.type, dtype=dtype):
                out = model(x)
            return loss_fn(out if outputs_16bit else out.float(), y)

        def backward_step(loss: torch.Tensor) -> None:
            if float32:
                loss.backward()
                if base == "float32" or bool(all_finite(p.grad for p in params)):
                    opt.step()
                return
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()

        zero_grad: Callable[[], None] = lambda: opt.zero_grad(set_to_none=True)  # noqa: E731
    else:
        prep, _, precision = base.partition("-")
        half = "bfloat16" if precision == "bf16" else "float16"
        converts: Float8Options | None = None
        if base in FLOAT8_MODES:
            policy = Policy(FLOAT8_MODES[base])
            if outputs_16bit:
                policy = Policy(f"params=float32,compute=bfloat16,output=bfloat16,"
                                f"float8={policy.float8_recipe}")  # fmt: skip
            converts = float8 if float8 is not None else work.float8 or Float8Options()
        elif base == "auto":
            policy = Policy("auto")  # what this machine's hardware picks, as mixprec train
        elif prep == "O3":
            policy = Policy(half)  # pure 16-bit: its outputs are 16-bit already
        elif outputs_16bit:
            policy = Policy(param_dtype="float32", compute_dtype=half, output_dtype=half)
        else:
            policy = Policy(f"mixed_{half}")
        auto_mixed_precision(
            model, policy, prep.upper() if prep != "auto" else "auto", float8=converts
        )
        level = applied(model).level  # type: ignore[union-attr]
        if converts is not None:
            float8_layers = layer_counts(model)
        lso = LossScaleOptimizer(torch.optim.SGD(model.parameters(), lr=lr))

        def forward_loss() -> torch.Tensor:
            return loss_fn(model(x), y)

        def backward_step(loss: torch.Tensor) -> None:
            lso.backward(loss)
            lso.step()

        zero_grad = lso.zero_grad
    if mode.endswith(COMPILED):
        options = {} if compile_mode is None else {"mode": compile_mode}
        forward_loss = compile_step(forward_loss, options, model)

    # CUDA graphs reuse a graph's output memory at its next replay, so a compiled mode's loss
    # kept past that (the last one is read after the other modes ran) is copied out.
    copy_loss = mode.endswith(COMPILED)

    def step() -> torch.Tensor:
        zero_grad()
        loss = forward_loss()
        backward_step(loss)
        return loss.detach().clone() if copy_loss else loss.detach()

    step.level = level  # type: ignore[attr-defined]
    step.float8 = float8_layers  # type: ignore[attr-defined]
    return step


@dataclass
class ModeResult:
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


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


class PeakMemory:
    """Peak memory from the moment it is created, in MiB: CUDA's allocator peak, or on Linux
    the process's peak RSS (its counter reset now) above the RSS now. ``mb()`` is ``None``
    where neither can be measured."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.before: float | None = None
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats()
            self.before = float(torch.cuda.memory_allocated())
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
            return (torch.cuda.max_memory_allocated() - self.before) / 2**20
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
    device = _device(device_name)
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
) -> list[ModeResult]:
    """Benchmark ``modes`` on ``workload``; ``repeats`` rounds per mode, interleaved, after
    ``warmup`` steps each (at least 2). A round is ``steps`` steps, or more where the
    fastest mode would finish them in under ``min_round_ms`` (a 1 ms step timed 3 at a time
    measures the timer and the cache left by the previous mode); every mode runs the same
    number of steps, so their final losses compare. Rounds run the modes forwards and
    backwards in turn. ms/step is the median of the per-round ms/step; the speedup, the
    median of the per-round ratios to float32.
    ``outputs_16bit``, ``compile_mode`` and ``float8`` as in ``build_step``; a ``+compile``
    mode's compile time is its first step's time above its steady-state ms/step, kept
    apart. float8 modes need torchao: ``ImportError`` naming ``mixprec[float8]`` first."""
    for mode in modes:
        check_mode(mode)
    require_float8(modes)
    if "float32" not in modes:
        modes = ["float32", *modes]
    dev = _device(device)
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
    with _true_float32(dev):
        times, last, first = _time_modes(built, repeats, steps, warmup, dev, min_round_ms)
    peaks: dict[str, float | None] = dict.fromkeys(modes)
    if memory:
        ctx = multiprocessing.get_context("spawn")
        with ctx.Pool(1, maxtasksperchild=1) as pool:
            for mode in modes:
                args: MemoryArgs = (workload, mode, device, small, 2, None, outputs_16bit,
                                    compile_mode, float8)  # fmt: skip
                peaks[mode] = pool.apply(_peak_memory, (args,))
    results = []
    for mode in modes:
        ms = statistics.median(times[mode])
        # Paired: each round's float32 time over the mode's in the same round, so load that
        # drifts between rounds (a shared machine) cancels instead of tilting the medians.
        speedup = statistics.median(
            b / t for b, t in zip(times["float32"], times[mode], strict=True)
        )
        converted, linears = getattr(built[mode], "float8", None) or (None, None)
        tflops = work.flops / ms / 1e9 if work.flops else None
        peak = peak_tflops(dev, _matmul_dtype(mode))
        results.append(
            ModeResult(
                mode=mode,
                level=getattr(built[mode], "level", "-"),
                ms_per_step=ms,
                samples_per_s=1000 * work.samples / ms,
                speedup=speedup,
                final_loss=float(last[mode]),
                peak_mb=peaks[mode],
                tokens_per_s=1000 * work.tokens / ms if work.tokens else None,
                tflops=tflops,
                mfu=tflops / peak if tflops is not None and peak else None,
                compile_s=(first[mode] - ms) / 1000 if mode.endswith(COMPILED) else None,
                float8_layers=converted,
                linear_layers=linears,
            )
        )
    return results


def _time_modes(
    built: dict[str, Step],
    repeats: int,
    steps: int,
    warmup: int,
    dev: torch.device,
    min_round_ms: float,
) -> tuple[dict[str, list[float]], dict[str, torch.Tensor], dict[str, float]]:
    """Per mode: the ms/step of each round, the loss of the last step, and the ms of the
    first step (which compiles, for compiled modes)."""
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
    steps = max(steps, math.ceil(min_round_ms / max(fastest, 1e-3)))
    times: dict[str, list[float]] = {mode: [] for mode in built}
    order = list(built.items())
    for r in range(repeats):
        # Every other round backwards: no mode always follows the same one (whose cache
        # and allocator state it would inherit).
        for mode, step in order if r % 2 == 0 else order[::-1]:
            _sync(dev)
            start = time.perf_counter()
            for _ in range(steps):
                last[mode] = step()
            _sync(dev)
            times[mode].append(1000 * (time.perf_counter() - start) / steps)
    return times, last, first


def max_batch(
    workload: str,
    mode: str,
    budget_mb: float,
    device: str = "auto",
    small: bool = False,
    limit: int = 1 << 16,
    outputs_16bit: bool = False,
    float8: Float8Options | None = None,
) -> int:
    """The largest batch of ``workload`` whose training step, in ``mode`` alone in a fresh
    process, peaks within ``budget_mb``: doubling, then bisection (0 if none fits)."""
    check_mode(mode)
    require_float8([mode])
    ctx = multiprocessing.get_context("spawn")

    def fits(batch: int) -> bool:
        with ctx.Pool(1) as pool:
            args: MemoryArgs = (workload, mode, device, small, 1, batch, outputs_16bit, None,
                                float8)  # fmt: skip
            peak = pool.apply(_peak_memory, (args,))
        if peak is None:
            raise RuntimeError("peak memory cannot be measured on this platform")
        return peak <= budget_mb

    low, high = 0, 1
    while high <= limit and fits(high):
        low, high = high, high * 2
    if high > limit:
        return low
    while high - low > max(1, low // 16):  # within ~6%
        middle = (low + high) // 2
        low, high = (middle, high) if fits(middle) else (low, middle)
    return low


def table(workload: str, results: list[ModeResult]) -> str:
    """The results as a text table; float8 modes add their converted Linear layers (``fp8``:
    converted/all) and, below, their speed against ``O2-bf16`` run the same way."""
    header = f"{'mode':<34} {'level':<5}"
    float8 = any(r.float8_layers is not None for r in results)
    if float8:
        header += f" {'fp8':>5}"
    header += f" {'ms/step':>9} {'samples/s':>10} {'vs f32':>7} {'peak MB':>8} {'loss':>8}"
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
        line += (
            f" {r.ms_per_step:>9.2f} {r.samples_per_s:>10.0f} "
            f"{r.speedup:>6.2f}x {_fmt(r.peak_mb, '8.0f')} {r.final_loss:>8.4f}"
        )
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
    return "\n".join(lines)


def _fmt(value: float | None, spec: str) -> str:
    width = int(spec.split(".")[0])
    return format(value, spec) if value is not None else "-".rjust(width)


def notes(modes: Sequence[str], device: str = "auto") -> list[str]:
    """What the figures of ``modes`` on ``device`` do not measure: 16-bit and float8
    matmuls that this device emulates, and eager float8 on CUDA (fast compiled only)."""
    dev = _device(device)
    dtypes = {_matmul_dtype(m) for m in modes if not is_float8_mode(m)}
    float8 = [m for m in modes if is_float8_mode(m)]
    found: list[str] = []
    hw = probe_hardware()
    if dev.type == "cpu" and hw.device == "cpu":
        if ("bfloat16" in dtypes or float8) and not hw.bf16_fast:
            found.append(
                f"{hw.detail}: bfloat16 matmuls are emulated here, slower than float32; the "
                "bf16 figures compare the modes at equal, slow matmuls, not bfloat16's speed"
            )
        if "float16" in dtypes and not hw.fp16_fast:
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
    dev = _device(device)
    return torch.cuda.get_device_name(dev) if dev.type == "cuda" else _cpu_name()


def to_json(
    all_results: dict[str, list[ModeResult]], outputs_16bit: bool = False, device: str = "auto"
) -> str:
    """The results as JSON, with the device they ran on (``device`` as given to ``run``)
    and the ``notes`` on what its figures do not measure."""
    dev = _device(device)
    modes = list(dict.fromkeys(r.mode for rs in all_results.values() for r in rs))
    return json.dumps(
        {
            "torch": torch.__version__,
            "device": dev.type,
            "device_name": device_name(device),
            "float32_matmul": "IEEE float32 (TF32 off)",
            "outputs_16bit": outputs_16bit,
            "notes": notes(modes, device),
            "results": {w: [asdict(r) for r in rs] for w, rs in all_results.items()},
        },
        indent=2,
    )


def _cpu_name() -> str:
    import platform

    return cpuinfo_field("model name") or platform.processor() or "cpu"


def mode_colours(modes: Sequence[str]) -> dict[str, tuple[float, ...]]:
    """A distinct colour for each of ``modes`` (``MODE`` and ``MODE+compile`` alike).

    Each mode without its suffix gets a hue, in ``ALL_MODES`` order: tab20's ten, then
    tab20b's five and tab20c's five. Where both ``MODE`` and ``MODE+compile`` are in
    ``modes``, the eager one takes the hue's dark shade and the compiled one its light
    shade, so that the pair reads as one; alone, either takes the dark shade. 20 hues x 2
    shades: every mode and its compiled twin at once get different colours."""
    from matplotlib import colormaps

    # Called with i: colour i. (dark, light): tab20 pairs its shades; tab20b and tab20c
    # have four shades a hue, dark to light.
    tab20, tab20b, tab20c = colormaps["tab20"], colormaps["tab20b"], colormaps["tab20c"]
    shades = [(tab20(2 * i), tab20(2 * i + 1)) for i in range(10)]
    shades += [(cmap(4 * i + 1), cmap(4 * i + 3)) for cmap in (tab20b, tab20c) for i in range(5)]
    known = list(ALL_MODES)
    bases = sorted(
        {m.removesuffix(COMPILED) for m in modes},
        key=lambda b: (known.index(b) if b in known else len(known), b),
    )
    colours: dict[str, tuple[float, ...]] = {}
    for mode in modes:
        base = mode.removesuffix(COMPILED)
        dark, light = shades[bases.index(base) % len(shades)]
        paired = base in modes and base + COMPILED in modes
        colours[mode] = tuple(
            float(c) for c in (light if paired and mode.endswith(COMPILED) else dark)
        )
    return colours


def chart(all_results: dict[str, list[ModeResult]], subtitle: str | None = None) -> Figure:
    """Bar chart of speedups against float32, one group of bars per workload, one colour
    per mode (``mode_colours``) across the groups. float32 is the line at 1, not a bar (its
    speedup is 1 by definition); ``float32+compile`` is a bar. ``subtitle``: a second
    title line, such as the device."""
    from matplotlib.figure import Figure  # no pyplot: no GUI backend, no global figure

    workloads = list(all_results)
    modes = [m for m in dict.fromkeys(r.mode for w in workloads for r in all_results[w])
             if m != "float32"]  # fmt: skip
    colours = mode_colours(modes)
    width = 0.8 / max(len(modes), 1)
    ncol = 1 if len(modes) <= 16 else 2
    fig = Figure(figsize=(max(5.0, 1.6 * len(workloads)) + 2.2 * ncol, 4.8))
    ax = fig.subplots()
    for i, mode in enumerate(modes):
        values = [next((r.speedup for r in all_results[w] if r.mode == mode), math.nan)
                  for w in workloads]  # fmt: skip
        bars = ax.bar([j + i * width for j in range(len(workloads))], values, width,
                      label=mode, color=colours[mode])  # fmt: skip
        if len(modes) <= 4:
            ax.bar_label(bars, fmt="%.2f", fontsize=7, padding=1)
        elif len(modes) <= 10:  # upright, so that neighbours' labels do not overlap
            ax.bar_label(bars, fmt="%.2f", fontsize=6, padding=2, rotation=90)
    ax.axhline(1.0, color="black", lw=1, label="float32 (baseline, 1.0)")
    ax.set_xticks([j + 0.4 - width / 2 for j in range(len(workloads))], workloads)
    ax.set_xlabel("workload")
    ax.set_ylabel("speedup vs float32 (higher is faster)")
    title = "mixprec bench: training-step speed against float32"
    ax.set_title(title + (f"\n{subtitle}" if subtitle else ""), fontsize=10)
    ax.margins(y=0.12)
    ax.legend(fontsize=8, ncol=ncol, loc="upper left", bbox_to_anchor=(1.01, 1.0),
              borderaxespad=0.0)  # fmt: skip
    fig.tight_layout()
    return fig


def plot(all_results: dict[str, list[ModeResult]], path: str, subtitle: str | None = None) -> None:
    """``chart`` written to ``path`` (PNG, 120 dpi)."""
    chart(all_results, subtitle).savefig(path, dpi=120)
