"""The benchmark's modes: what each trains with, and the training step of each.

Baselines are what users write by hand (float32, ``torch.autocast`` with or without
``torch.amp.GradScaler``); the other modes are mixprec's levels and policies. Every mode also
runs compiled, with the ``+compile`` suffix (``COMPILED``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch

from mixprec._compile import compile_step
from mixprec._dtypes import dtype_name
from mixprec._errors import ArgumentError
from mixprec._rng import leaves_rng
from mixprec.bench.workloads import Workload
from mixprec.float8 import Float8Options, layer_counts, torchao_float8
from mixprec.levels import applied, auto_mixed_precision
from mixprec.optim import LossScaleOptimizer
from mixprec.policy import Policy
from mixprec.scaling import all_finite

Step = Callable[[], torch.Tensor]


#: Suffix of a mode run under ``torch.compile`` (``"O2-bf16+compile"``): its forward and loss
#: are one compiled function; backward runs AOTAutograd's compiled graph, the optimizer step
#: stays eager as in ``TrainStep``.
COMPILED = "+compile"

#: What ``mixprec bench`` runs when no mode is named.
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
#: loop, and all that ``LossScaleOptimizer`` adds to float32 training. ``float32-tf32``:
#: float32 with TF32 matmuls and convolutions (CUDA's tensor cores; ``float32`` turns TF32
#: off for a true float32 baseline), what a GPU user gets without 16-bit.
BASELINE_MODES: tuple[str, ...] = ("float32-checked", "float32-tf32")

#: Every mode ``build_step`` accepts, each also with the ``+compile`` suffix.
ALL_MODES: tuple[str, ...] = (*MODES, *FLOAT8_MODES, *BASELINE_MODES)

#: What each mode trains with, one line each (``mixprec bench --help``). Every mode trains
#: the workload's model with SGD from the same weights on the same batch.
MODE_HELP: dict[str, str] = {
    "float32": "float32 weights and math: the baseline of 'vs f32'",
    "torch-autocast-bf16": "torch.autocast bfloat16 around the forward, a plain optimizer "
    "step, no GradScaler: the peer of the bf16 modes ('vs autocast')",
    "torch-autocast-scaler-bf16": "the same with an enabled torch.amp.GradScaler, which skips "
    "steps with inf/NaN gradients",
    "torch-autocast-fp16": "torch.autocast float16 with torch.amp.GradScaler: the peer of the "
    "fp16 modes",
    "O1-bf16": "mixprec O1: autocast in bfloat16, float32 weights",
    "O2-bf16": "mixprec O2: bfloat16 weights, float32 masters in LossScaleOptimizer",
    "O3-bf16": "mixprec O3: every weight bfloat16, no masters",
    "auto-bf16": "mixprec mixed_bfloat16 at level auto (O2)",
    "O1-fp16": "mixprec O1 in float16, dynamic loss scaling",
    "O2-fp16": "mixprec O2 in float16, dynamic loss scaling",
    "auto-fp16": "mixprec mixed_float16 at level auto (O2)",
    "auto": "mixprec's default: the policy this hardware picks (auto), level auto",
    "O2-fp8": "float8 Linear layers, torchao's tensorwise recipe (policy mixed_float8; "
    "needs mixprec[float8])",
    "O2-fp8-rowwise": "the same, rowwise recipe (mixed_float8_rowwise)",
    "O2-fp8-rowwise_with_gw_hp": "the same, rowwise with high-precision weight gradients "
    "(mixed_float8_rowwise_with_gw_hp)",
    "float32-checked": "float32 that skips a step whose gradients hold inf/NaN (all_finite)",
    "float32-tf32": "float32 weights, TF32 matmuls and convolutions (CUDA; elsewhere the same "
    "as float32)",
}

#: The plain ``torch.autocast`` loop a mode of each 16-bit matmul dtype is compared with
#: ("vs autocast"): bfloat16 without a GradScaler (it needs none, and users drop it),
#: float16 with one (it needs it).
AUTOCAST_PEERS: dict[str, str] = {
    "bfloat16": "torch-autocast-bf16",
    "float16": "torch-autocast-fp16",
}


def autocast_peer(mode: str) -> str | None:
    """The plain ``torch.autocast`` mode that ``mode`` is compared with, run the same way
    (a ``+compile`` mode against the compiled peer): the peer of its matmul dtype
    (``AUTOCAST_PEERS``; float8 modes: bfloat16's; ``auto``: the dtype it picks here).
    ``None`` for a mode whose matmuls run in float32, and for a peer itself (its "vs
    autocast" would be 1.00x against itself)."""
    peer = AUTOCAST_PEERS.get(_matmul_dtype(mode))
    if peer is None or mode.removesuffix(COMPILED) == peer:
        return None
    return peer + (COMPILED if mode.endswith(COMPILED) else "")


#: The mode that runs each policy at level O2 (``--policy``, and a policy given as a mode).
POLICY_MODES: dict[str, str] = {
    "mixed_bfloat16": "O2-bf16",
    "mixed_float16": "O2-fp16",
    **{policy: mode for mode, policy in FLOAT8_MODES.items()},
}


def with_compiled(modes: Sequence[str]) -> list[str]:
    """``modes`` followed by the compiled version of each (``mixprec bench --compile``),
    each mode once: a compiled mode already in ``modes`` is not added again."""
    return list(dict.fromkeys([*modes, *(m.removesuffix(COMPILED) + COMPILED for m in modes)]))


def compile_modes() -> tuple[str, ...]:
    """The ``mode`` values this torch's ``torch.compile`` takes (``default``,
    ``reduce-overhead``, ``max-autotune``, ``max-autotune-no-cudagraphs``, ...)."""
    import torch._inductor  # only when a compile mode is checked: it is slow to import

    return tuple(torch._inductor.list_mode_options())


def check_compile_mode(compile_mode: str) -> str:
    """``compile_mode`` if ``torch.compile`` takes it; else an error that lists those it
    takes, before any work (torch would refuse it at the first compiled step)."""
    valid = compile_modes()
    if compile_mode not in valid:
        raise ArgumentError(
            f"unknown compile mode {compile_mode!r}; torch.compile's modes are: " + ", ".join(valid)
        )
    return compile_mode


def check_mode(mode: str) -> str:
    """``mode`` without its ``+compile`` suffix, after checking that it names a mode."""
    base = mode.removesuffix(COMPILED)
    if base not in ALL_MODES:
        raise ArgumentError(
            f"unknown mode {mode!r}; valid: {', '.join(ALL_MODES)}, each optionally with "
            f"{COMPILED!r}" + _policy_hint(base)
        )
    return base


def _policy_hint(name: str) -> str:
    mode = mode_for_policy(name)
    return f" (policy {name!r} is mode {mode!r})" if mode else ""


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


def uses_tf32(mode: str) -> bool:
    """Whether ``mode`` runs its float32 matmuls in TF32 (its MFU is against TF32's peak)."""
    return mode.removesuffix(COMPILED) == "float32-tf32"


@contextlib.contextmanager
def tf32(enabled: bool) -> Iterator[None]:
    """TF32 matmuls and convolutions on or off (CUDA reads these; other devices ignore
    them), restored after. Through ``fp32_precision`` where torch has it (2.9+): once a
    user has set that, reading the older ``allow_tf32`` flags raises."""
    matmul = torch.backends.cuda.matmul
    conv: Any = getattr(torch.backends.cudnn, "conv", None)
    if hasattr(matmul, "fp32_precision") and hasattr(conv, "fp32_precision"):
        saved = matmul.fp32_precision, conv.fp32_precision
        matmul.fp32_precision = conv.fp32_precision = "tf32" if enabled else "ieee"
        try:
            yield
        finally:
            matmul.fp32_precision, conv.fp32_precision = saved
        return
    legacy = matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = enabled
    try:
        yield
    finally:
        matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = legacy


def _sync(device: torch.device) -> None:
    """Wait until ``device`` has run the work queued so far (CUDA runs asynchronously)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)  # the device timed, not the current one


@leaves_rng
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
                if base != "float32-checked" or bool(all_finite(p.grad for p in params)):
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
            if outputs_16bit and policy.is_mixed:  # as every other mode's, under the flag
                policy = Policy(param_dtype="float32", compute_dtype=policy.compute_dtype,
                                output_dtype=policy.compute_dtype)  # fmt: skip
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

    # The bench runs every mode with TF32 off (``runner.run``); this one turns it
    # on around its own steps only, as the modes' rounds interleave.
    tf32_on = uses_tf32(mode)

    def step() -> torch.Tensor:
        with tf32(True) if tf32_on else contextlib.nullcontext():
            zero_grad()
            loss = forward_loss()
            backward_step(loss)
        return loss.detach().clone() if copy_loss else loss.detach()

    step.level = level  # type: ignore[attr-defined]
    step.float8 = float8_layers  # type: ignore[attr-defined]
    return step
