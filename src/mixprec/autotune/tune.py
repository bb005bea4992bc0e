"""``autotune``: the fastest plan whose numerics stay within an error budget, measured on the
user's model, batch and machine.

1. Candidates the machine or the installed packages cannot run are left out (``units``).
2. One float32 pass records each layer's input, output gradient and range (``measure``).
3. Each candidate is timed on the largest layer it applies to beside float32 (emulated
   float8 on CPU: the smallest, on a few rows); one slower there than ``SLOW`` x float32 is
   left out with the measured figures (emulated 16-bit
   or float8 matmuls: a CPU without the units, ``torch._scaled_mm``'s CPU reference kernel).
4. Every layer runs alone in every remaining candidate: its time and relative error.
5. The search (``search``) and the training check (``check``) decide the plan.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from mixprec._compile import CompileOption, compile_options
from mixprec._errors import ArgumentError, check_int
from mixprec._hardware import cpu_fast, probe_cpu, probe_hardware
from mixprec._rng import same_draws
from mixprec._warn import warn_at_caller
from mixprec.autotune.check import MIN_STEPS, training_check
from mixprec.autotune.measure import LayerData, isolated_run, layer_error, reference_pass
from mixprec.autotune.plan import LayerChoice, Plan
from mixprec.autotune.search import Search
from mixprec.autotune.steps import OptimizerFactory, default_optimizer
from mixprec.autotune.units import (
    Timer,
    WallTimer,
    available,
    check_candidates,
    float8_ready,
    units,
)
from mixprec.doctor import check_callable, check_finite_batch, float32_model

#: Why a layer the tuning batch never called is float32 in the plan.
NOT_CALLED = "not called by the tuning batch: float32, not measured"

__all__ = ["autotune"]

#: A candidate this many times slower than float32 on its largest layer is left out.
SLOW = 1.25
#: The shares of the time budget per-layer measurement and the whole search may use (the
#: training check gets the rest).
MEASURE_SHARE, SEARCH_SHARE = 0.3, 0.6
#: Input rows of the float8 probe on CPU (see ``_rows``).
FLOAT8_PROBE_ROWS = 16


def _hint(dtype: str, device: torch.device) -> str:
    """What the hardware says about a slow candidate."""
    if device.type != "cpu":
        return ""
    if dtype == "float8":
        return "; on CPU torch._scaled_mm is a reference kernel, not float8 matrix units"
    if not cpu_fast(dtype):
        return f"; this CPU has no fast {dtype} matrix units ({probe_cpu().detail})"
    return ""


def _rows(data: LayerData, rows: int) -> LayerData:
    """``data`` with its Linear input and output gradient cut to their first ``rows`` rows
    (leading dimensions flattened): a probe of emulated float8, whose CPU kernel takes
    minutes on a full batch (measured: 3 min for 8192 x 784 @ 784 x 512, and 19 s for 64
    rows of lm-d512's 512 x 8192 head), compares it with float32 on the same rows."""
    x, grad = data.args[0] if len(data.args) == 1 else None, data.grad
    if not isinstance(x, torch.Tensor) or x.dim() < 2 or grad is None or data.kwargs:
        return data
    if x.reshape(-1, x.shape[-1]).shape[0] <= rows:
        return data
    x = x.reshape(-1, x.shape[-1])[:rows]
    grad = grad.reshape(-1, grad.shape[-1])[:rows]
    return LayerData(data.name, data.module, (x,), {}, grad, data.headroom)


def _probe(layers: dict[str, LayerData], kept: list[str], timer: Timer, device: torch.device
           ) -> tuple[list[str], dict[str, str]]:  # fmt: skip
    """Step 3 of the module docstring: which candidates are fast enough to measure."""
    fast, slow = ["float32"], {}
    for dtype in kept[1:]:
        fits = [d for d in layers.values() if dtype != "float8" or float8_ready(d.module)]
        if not fits:
            continue
        big = max(fits, key=lambda d: d.size)
        if dtype == "float8" and device.type == "cpu":
            # Emulated: the smallest layer on a few rows says it as well, in seconds.
            big = _rows(min(fits, key=lambda d: d.size), FLOAT8_PROBE_ROWS)
        base = big.times.get("float32")
        if base is None:
            base = timer.layer(big.name, "float32", isolated_run(big, "float32"))
        try:
            took = timer.layer(big.name, dtype, isolated_run(big, dtype))
        except RuntimeError as error:  # no kernel for it here (oneDNN without float8 on AVX2)
            slow[dtype] = f"fails on this machine: {str(error).splitlines()[0][:160]}"
            continue
        # float32 again, right after: a machine whose load changed meanwhile shifts both.
        base = min(base, timer.layer(big.name, "float32", isolated_run(big, "float32")))
        if big is layers[big.name]:
            big.times[dtype], big.times["float32"] = took, base
        if took > SLOW * base:
            rows = "" if big is layers[big.name] else f", on {FLOAT8_PROBE_ROWS} of its input rows"
            which = "smallest" if dtype == "float8" and device.type == "cpu" else "largest"
            slow[dtype] = (
                f"measured {took / base:.1f}x float32's time on its {which} layer {big.name}"
                f"{rows} ({took * 1e3:.3g} ms against {base * 1e3:.3g} ms){_hint(dtype, device)}"
            )
        else:
            fast.append(dtype)
    return fast, slow


def _measure(data: LayerData, kept: list[str], timer: Timer) -> None:
    """Step 4: the layer alone in each candidate: time and error against float32."""
    results: dict[str, Any] = {}
    for dtype in kept:
        if dtype == "float8" and not float8_ready(data.module):
            continue
        run = isolated_run(data, dtype)

        def keep(run: Callable[[], Any] = run, dtype: str = dtype) -> None:
            results[dtype] = run()

        data.times[dtype] = timer.layer(data.name, dtype, keep)
        data.errors[dtype] = (
            0.0 if dtype == "float32" else layer_error(results[dtype], results["float32"])
        )


def autotune(
    model: nn.Module,
    batch: tuple[Any, Any],
    loss_fn: Callable[[Any, Any], torch.Tensor],
    candidates: tuple[str, ...] = ("float32", "bfloat16", "float16", "float8"),
    error_budget: float = 0.05,
    time_budget_s: float = 60.0,
    optimizer: OptimizerFactory | None = None,
    compile: CompileOption = False,
    check_steps: int = 50,
    timer: Timer | None = None,
    progress: Callable[[str], None] | None = None,
) -> Plan:
    """The fastest per-layer dtype plan for ``model`` whose numerics stay within
    ``error_budget``, measured on ``batch`` (``(inputs, targets)``) with ``loss_fn(output,
    targets)`` on this machine. The model is not changed: apply the plan with
    ``mp.auto_mixed_precision(model, plan=plan)``.

    ``error_budget``: the largest relative error (``||x - x_f32|| / ||x_f32||``) a layer's
    output and gradients, and the training check's loss, may have against float32; the
    default, 0.05, admits bfloat16 (rounding ~0.4%) and usually float8 (E4M3 ~3%); 0 gives
    the float32 plan. ``time_budget_s``: the whole call ends about then: per-layer measurement
    stops at 30% of it (layers left unmeasured stay float32), the search at 60%, and the
    training check runs fewer than ``check_steps`` steps if that is all that fits (2 at
    least, past the budget too: the first step's loss precedes any update).
    ``optimizer``: a factory ``params -> torch.optim.Optimizer`` (SGD, lr 0.01), wrapped in
    ``LossScaleOptimizer`` for whole-step timing and the check. ``compile``: time and check
    steps compiled, as ``Trainer(compile=...)``. ``timer``: how to time (``units.Timer``;
    tests inject one). ``progress``: called with a line of text at each measurement.
    """
    module = float32_model(model, "autotune")
    if not (isinstance(batch, (tuple, list)) and len(batch) == 2):
        raise ArgumentError(
            f"autotune(batch=...) needs (inputs, targets), got {type(batch).__name__}"
        )
    inputs, targets = batch
    check_finite_batch(inputs, targets, "autotune")
    # Checked before the reference pass: each was called only after it (0.6 s in).
    check_callable("autotune", "loss_fn", loss_fn, "a callable (output, targets) -> loss")
    for argument, given, wanted in (
        ("optimizer", optimizer, "a factory params -> torch.optim.Optimizer (such as "
         "lambda params: torch.optim.AdamW(params, lr=1e-3)), or None"),
        ("progress", progress, "a callable taking a line of text, or None"),
    ):  # fmt: skip
        if given is not None:
            check_callable("autotune", argument, given, wanted)
    kept_candidates = check_candidates(candidates)
    # NaN fails `>= 0`; an infinite time budget cannot be divided into shares.
    for name, value, finite in (("error_budget", error_budget, False),
                                ("time_budget_s", time_budget_s, True)):  # fmt: skip
        number = not isinstance(value, bool) and isinstance(value, (int, float))
        if not number or not value >= 0 or (finite and math.isinf(value)):
            raise ArgumentError(
                f"{name}={value!r} is invalid; give a number >= 0" + ", finite" * finite
            )
    check_int("check_steps", check_steps, MIN_STEPS)  # one step's loss precedes any update
    options = compile_options(compile)
    say = progress or (lambda text: None)
    timer = timer or WallTimer()
    start = time.monotonic()
    device = next((p.device for p in module.parameters()), torch.device("cpu"))
    layers_found = units(module)
    kept, left_out = available(kept_candidates, layers_found, device)
    with same_draws() as rewind:
        say("float32 reference pass")
        layers = reference_pass(module, inputs, targets, loss_fn, list(layers_found))
        if error_budget > 0:
            say("probing the candidates")
            kept, slow = _probe(layers, kept, timer, device)
            left_out.update(slow)
            for data in layers.values():
                if time.monotonic() > start + MEASURE_SHARE * time_budget_s:
                    break  # the layers left unmeasured stay float32 ("not measured")
                say(f"measuring {data.name}")
                rewind()
                _measure(data, kept, timer)
        search = Search(
            module, (inputs, targets), loss_fn, optimizer or default_optimizer, options, timer,
            start + SEARCH_SHARE * time_budget_s, layers, kept, float(error_budget), say,
        )  # fmt: skip
        search.run()
        check = training_check(search, check_steps, start + time_budget_s)
    # A layer this batch never calls (a branch, an expert) is named float32 too: left out,
    # it would follow the plan's 16-bit policy unmeasured (float16 without a range look).
    rows = tuple(
        LayerChoice(
            name,
            got.kind,
            search.dtypes[name],
            dict(got.times),
            dict(got.errors),
            got.headroom,
            search.why.get(name, ""),
        )
        if (got := layers.get(name)) is not None
        else LayerChoice(name, type(module).__name__, "float32", why=NOT_CALLED)
        for name, module in layers_found.items()
    )
    if check.sent_to_float32 or check.level_from:  # the plan changed: time it, if time is left
        search.step_times.pop("plan", None)
        if time.monotonic() < start + time_budget_s:
            search.step_times["plan"] = search.time_step(search.dtypes, search.level, "the plan")
    if not check.passed:
        warn_at_caller(
            f"autotune: the plan failed its training check in the time left ({check.gap()}); "
            "it keeps its 16-bit layers, which may not train like float32: give a larger "
            "time_budget_s"
        )
    machine = (probe_cpu() if device.type == "cpu" else probe_hardware()).detail
    # Every layer float32 (a budget broken everywhere, a plan slower than float32): that
    # is O0, as applied; the uniform plan's level would say a level that does not run.
    level = search.level if any(d != "float32" for d in search.dtypes.values()) else "O0"
    return Plan(rows, level, left_out, dict(search.step_times), float(error_budget),
                check, machine)  # fmt: skip
