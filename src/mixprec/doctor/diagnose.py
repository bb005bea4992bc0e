"""The 16-bit doctor: which layer overflows or underflows in 16 bits, and what to do.

``diagnose`` runs one batch twice, in float32 and under the policy, with hooks on every
module (``passes.run``), and compares them module by module (``risk``), keeping what comes
within the headroom of the 16-bit range (``headroom``); for float16 it then checks its own
recommendation by doing on that batch what the dynamic loss scaler would
(``passes.back_off``), and over a few optimizer steps (``verify``). A float8 policy goes to
the float8 doctor (``doctor.float8``).
"""

from __future__ import annotations

import copy
import math
import warnings
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.utils._pytree import tree_map_only

from mixprec._dtypes import HALF_DTYPES, dtype_name
from mixprec._errors import ArgumentError
from mixprec._input_casts import BOUNDARY_LOOK
from mixprec._rng import same_draws
from mixprec.doctor._common import (
    check_callable,
    check_finite_batch,
    float32_model,
    float32_upcast,
    inputs_cast_to_inf,
)
from mixprec.doctor.advice import advice
from mixprec.doctor.headroom import (
    EDGE_RISK,
    HEADROOM,
    flag_small_gradients,
    measure,
    recommend,
)
from mixprec.doctor.passes import (
    back_off,
    error,
    finite_run,
    lost,
    max_abs,
    min_nonzero,
    nonfinite,
    run,
)
from mixprec.doctor.report import ModuleReport, Report
from mixprec.doctor.risk import (
    SCALE_FLOOR,
    loss_scale_range,
    nonfinite_origin,
    own_code_origin,
    score,
)
from mixprec.doctor.verify import CHECK_STEPS, OptimizerLike, check_optimizer, check_plan
from mixprec.dtype_table import module_dtypes
from mixprec.float8 import Float8Options
from mixprec.keep import ROOT_NAME, named_modules
from mixprec.levels import KeepEntry, applied, auto_mixed_precision
from mixprec.policy import PolicyLike, get_policy
from mixprec.region import get_region

if TYPE_CHECKING:
    from mixprec.doctor.float8 import Float8Report

__all__ = ["diagnose"]


_LOSS = "a callable (output, targets) -> loss, such as torch.nn.functional.cross_entropy"


def diagnose(
    model: nn.Module,
    inputs: Any,
    targets: Any,
    loss_fn: Callable[..., torch.Tensor],
    policy: PolicyLike = "mixed_float16",
    level: str = "auto",
    loss_scale: float | None = None,
    *,
    float8: Float8Options | None = None,
    keep_bfloat16: Iterable[KeepEntry] = (),
    keep_float32: Iterable[KeepEntry] = (),
    optimizer: OptimizerLike | None = None,
    check_steps: int = CHECK_STEPS,
    headroom: float = HEADROOM,
) -> Report | Float8Report:
    """Run one batch in float32 and under ``policy``/``level`` and report, per module, the
    value ranges against the 16-bit dtype, how close they come to its limits (``*_fraction``),
    underflow, non-finite values and the error against float32. ``model`` is a float32
    model; it is copied, never modified. A model in bfloat16 or float16 is diagnosed as its
    float32 upcast copy, a float32 model holding the rounded values, with one warning. A
    batch holding inf/NaN is refused.

    ``loss_scale``: the scale the mixed run's backward uses, as training would; by default
    what the policy implies (2**16, ``DynamicLossScaler``'s start, for float16; 1 otherwise).
    Underflow fractions are measured at that scale; pass 1 to see the unscaled gradients.

    ``recommended_keep_float32`` leaves ``headroom`` (a fraction of the range, ``2**-4``:
    a factor 16): it lists the leaves whose float32 inputs or outputs come within it of the
    16-bit max (the overflowing layer and its consumer), and, for float16, those whose
    gradients do even at the scaler's floor (loss scale 1). For float16 it then applies the
    list to a copy and backs the scale off from ``loss_scale`` as ``DynamicLossScaler``
    would on this batch (``loss_scale_reached``, ``backoff_steps``), keeping any further leaf
    that still overflows at the floor; and checks the plan over ``check_steps`` optimizer
    steps (``optimizer``: an optimizer, or a function of the parameters that builds one;
    default Adam, lr 1e-3), keeping what those steps push over and lowering the start where
    they back off (``Report.check``; 0 turns the check off). Leaves whose small gradients
    come within ``headroom`` of the flush to zero are named in ``at_edge``.

    A float8 policy (``mixed_float8``...) gives ``diagnose_float8``'s ``Float8Report``: per
    float8 layer, its casts' amax, scales, saturation and flush, and its error against
    bfloat16; ``float8``, ``keep_bfloat16`` and ``keep_float32`` are passed to it (and are
    float8-only: other policies diagnose the model without keeps, to find them);
    ``optimizer``, ``check_steps`` and ``headroom`` are 16-bit only."""
    if torch.is_inference_mode_enabled():
        raise ArgumentError(
            "diagnose runs backward passes, which torch.inference_mode() forbids: call it "
            "outside that block"
        )
    # The doctor's own copies: the caller's tensors get no gradient and no hook from it.
    inputs, targets = tree_map_only(torch.Tensor, torch.Tensor.detach, (inputs, targets))
    # Backward passes are its measurements: under the caller's torch.no_grad() they would
    # be skipped, and the gradient figures read as zeros. (A `with`, not a decorator: the
    # warnings inside are located at the caller's line, past mixprec's frames alone.)
    with torch.enable_grad(), warnings.catch_warnings():
        # The report says what the inputs' cast loses (inputs_overflow), in its own words.
        warnings.filterwarnings("ignore", message=BOUNDARY_LOOK)
        return _diagnose(
            model, inputs, targets, loss_fn, policy, level, loss_scale, float8=float8,
            keep_bfloat16=keep_bfloat16, keep_float32=keep_float32, optimizer=optimizer,
            check_steps=check_steps, headroom=headroom,
        )  # fmt: skip


def _diagnose(
    model: nn.Module,
    inputs: Any,
    targets: Any,
    loss_fn: Callable[..., torch.Tensor],
    policy: PolicyLike,
    level: str,
    loss_scale: float | None,
    *,
    float8: Float8Options | None,
    keep_bfloat16: Iterable[KeepEntry],
    keep_float32: Iterable[KeepEntry],
    optimizer: OptimizerLike | None,
    check_steps: int,
    headroom: float,
) -> Report | Float8Report:
    """``diagnose``'s work, with gradients on."""
    check_callable("diagnose", "loss_fn", loss_fn, _LOSS)
    if get_policy(policy).float8_recipe is not None:
        if loss_scale is not None:
            raise ArgumentError(
                f"loss_scale={loss_scale!r} does not apply to float8 policies: each float8 "
                "cast has its own scale; leave it None"
            )
        sixteen = [n for n, v in (("optimizer", optimizer is not None),
                                  ("check_steps", check_steps != CHECK_STEPS),
                                  ("headroom", headroom != HEADROOM)) if v]  # fmt: skip
        if sixteen:
            raise ArgumentError(
                f"diagnose: {', '.join(sixteen)} apply to 16-bit policies only; the float8 "
                "doctor replays each float8 layer on the batch"
            )
        from mixprec.doctor.float8 import diagnose_float8

        return diagnose_float8(
            model, inputs, targets, loss_fn, policy, level,
            float8=float8, keep_bfloat16=keep_bfloat16, keep_float32=keep_float32,
        )  # fmt: skip
    given = [n for n, v in (("float8", float8), ("keep_bfloat16", keep_bfloat16),
                            ("keep_float32", keep_float32)) if v]  # fmt: skip
    if given:
        raise ArgumentError(
            f"diagnose: {', '.join(given)} apply to float8 policies only; policy "
            f"{get_policy(policy).name!r} is diagnosed without keeps, to find them"
        )
    model = float32_model(model, "diagnose")
    check_finite_batch(inputs, targets, "diagnose")
    check_optimizer(optimizer)
    if isinstance(check_steps, bool) or not (isinstance(check_steps, int) and check_steps >= 0):
        raise ArgumentError(
            f"check_steps={check_steps!r} is invalid; it must be an int >= 0 (0: no check)"
        )
    if isinstance(headroom, bool) or not (isinstance(headroom, (int, float)) and 0 < headroom <= 1):
        raise ArgumentError(
            f"headroom={headroom!r} is invalid; it must be a fraction of the range in (0, 1] "
            "(1: no margin)"
        )
    resolved = get_policy(policy)
    if loss_scale is None:
        loss_scale = 2.0**16 if resolved.loss_scaling == "dynamic" else 1.0
    if not (isinstance(loss_scale, (int, float)) and 0 < loss_scale < math.inf):
        raise ArgumentError(f"loss_scale={loss_scale!r} is invalid; it must be finite and > 0")
    # A 16-bit model is diagnosed as its float32 upcast, from which every copy below starts.
    model = float32_upcast(model, "diagnose")
    reference = copy.deepcopy(model).float()
    mixed = auto_mixed_precision(copy.deepcopy(model), resolved, level)
    # Each `same_draws` block starts from the caller's RNG state and restores it.
    with same_draws() as rewind:
        ref_calls, ref_loss = run(reference, inputs, targets, loss_fn, 1.0, rewind)
        mixed_calls, mixed_loss = run(mixed, inputs, targets, loss_fn, float(loss_scale), rewind)
    compute = resolved.compute_dtype
    limit = float(torch.finfo(compute).max)
    # Modules that compute in float32 under the policy (islands, kept modules, inside them).
    islands = {row.name for row in module_dtypes(mixed) if row.compute == "float32"}
    grad_dtypes = _gradient_dtypes(mixed, mixed_calls)
    reports = _module_reports(
        ref_calls, mixed_calls, compute, float(loss_scale), islands, grad_dtypes
    )
    # Where values are computed: the leaves, and a module with children whose own forward
    # made the inf/NaN (a hand-written attention's q @ k^T), which only keeping it fixes.
    leaves = {n or ROOT_NAME for n, m in model.named_modules() if not list(m.children())}
    leaves |= _own_arithmetic_origins(model, reports)
    origin = nonfinite_origin(reports, leaves)
    done = applied(mixed)
    # At O2/O3 the inputs are cast to 16 bits before any layer (see cast_inf below): an
    # input the cast makes inf looks like the model's own code starting it.
    casts_inputs = done is not None and done.level in ("O2", "O3")
    made_inf = inputs_cast_to_inf(inputs, compute) if casts_inputs else []
    own_code = None if made_inf else own_code_origin(reports, leaves)
    for rep in reports:
        score(rep, compute, limit, origin, own_code)

    dynamic = resolved.loss_scaling == "dynamic"
    floor = min(SCALE_FLOOR, float(loss_scale)) if dynamic else float(loss_scale)
    measure(reports, limit, floor)
    recommended = recommend(reports, leaves, compute, limit, floor, headroom)
    # The mixed run at this scale with nothing kept had nothing non-finite: nothing to back off.
    healthy = finite_run(mixed_calls, mixed_loss)
    # At O2/O3 the inputs are cast to 16 bits before any layer. Where that made them inf
    # and the run non-finite, a keep list helps only if it keeps the model itself (float32
    # throughout; every layer kept still gets inf), so none is recommended until they are
    # in range. (An inf that harms nothing, a -1e9 mask, an unused input, is left alone.)
    cast_inf = made_inf if not healthy and ROOT_NAME not in recommended else []
    reached, backoff, half = None, 0, {r.name for r in reports if not r.float32}
    if cast_inf:  # no keep list, back-off or plan check can make those inputs finite
        recommended = []
    elif compute == torch.float16 and healthy and not recommended:
        reached = float(loss_scale)  # the mixed run at this scale had nothing non-finite
    elif compute == torch.float16:
        with same_draws() as rewind:
            recommended, reached, backoff, half = back_off(
                model, inputs, targets, loss_fn, resolved, level, recommended,
                reports, float(loss_scale), floor, limit, leaves, rewind,
            )  # fmt: skip
    check = None
    trainable = any(p.requires_grad for p in model.parameters())
    if (
        compute == torch.float16
        and reached is not None
        and check_steps
        and half & leaves
        and trainable
    ):
        with same_draws() as rewind:
            recommended, check, half = check_plan(
                model, (inputs, targets, loss_fn), resolved, level, recommended, reached,
                floor, leaves, optimizer, check_steps, rewind,
            )  # fmt: skip
        by_name = {r.name: r for r in reports}
        for name in check.added:
            by_name[name].risk += EDGE_RISK
            by_name[name].reasons.append(
                f"inf/NaN after {check.optimizer} steps (the plan's check): kept in float32"
            )
        if check.scale < reached:  # the check's steps backed off further: start there
            backoff += round(math.log2(reached / check.scale))
            reached = check.scale
    order = {r.name: r.order for r in reports}
    recommended.sort(key=lambda n: order.get(n, len(order)))
    # Small gradients flush where training runs: at the scale reached, not the one measured.
    runs_at, left = reached or float(loss_scale), half & leaves
    flushed = {
        name: lost(ref_calls[name]["grad"] * runs_at, grad_dtypes.get(name, compute))[0]
        for name in left
        if name in ref_calls and ref_calls[name]["grad"] is not None
    }
    at_edge = flag_small_gradients(reports, left, compute, runs_at, headroom, flushed)
    # The loss scale range for what stays in 16 bits once the recommendation is applied.
    # (None on inf inputs: no scale to suggest until they are in range.)
    scale, scale_range = (
        (None, None)
        if cast_inf
        else loss_scale_range([r for r in reports if r.name in left], compute)
    )
    bf16_max = float(torch.finfo(torch.bfloat16).max)
    at_risk = any(max(r.input_fraction, r.output_fraction, r.grad_fraction) > headroom
                  for r in reports)  # fmt: skip
    # Where float32 overflows too (its loss is not finite), bfloat16 overflows with it.
    bf16_helps = (
        compute == torch.float16
        and at_risk
        and math.isfinite(ref_loss)
        and all(max(r.max_output, r.max_backward) < bf16_max for r in reports)
    )
    report = Report(
        policy=resolved.name,
        level=done.level if done else level,
        compute_dtype=dtype_name(compute),
        loss_float32=ref_loss,
        loss_mixed=mixed_loss,
        loss_scale=float(loss_scale),
        modules=reports,
        recommended_keep_float32=recommended,
        suggested_loss_scale=scale,
        loss_scale_range=scale_range,
        bfloat16_would_help=bf16_helps,
        advice=[],
        loss_scale_reached=reached,
        backoff_steps=backoff,
        model=type(model).__name__,
        headroom=float(headroom),
        at_edge=at_edge,
        check=check,
        inputs_overflow=cast_inf,
        own_code=own_code,
    )
    report.advice = advice(report, compute, left)
    return report


def _own_arithmetic_origins(model: nn.Module, reports: list[ModuleReport]) -> set[str]:
    """Modules with children (not the model itself, which no keep list can name) whose
    output went inf/NaN under the policy from a finite input while no module inside them
    started it: their own forward's arithmetic did."""
    by_name = {r.name: r for r in reports}
    started = {
        r.name for r in reports if r.overflow_origin
    }  # fmt: skip
    found = set()
    for name, module in model.named_modules():
        r = by_name.get(name)
        if not name or r is None or not list(module.children()) or r.name not in started:
            continue
        inside = [other for other in started if other.startswith(name + ".")]
        if not inside:
            found.add(name)
    return found


def _gradient_dtypes(mixed: nn.Module, calls: dict[str, dict[str, Any]]) -> dict[str, torch.dtype]:
    """The dtype each module that ran in the mixed run takes its output gradient in: its
    output's (the model's float32 output keeps a float32 gradient; the 16-bit layer that
    made it takes the cast back, and is measured there), but for a leaf whose own region
    upcasts its 16-bit result (a one-layer model's boundary, a float16 Embedding at O2):
    its backward casts the gradient back to that compute dtype itself."""
    found = {}
    for name, module in named_modules(mixed).items():
        if name not in calls:
            continue
        found[name] = calls[name]["output"].dtype
        region = get_region(module)
        leaf = not list(module.children())
        if leaf and region is not None and region.compute_dtype in HALF_DTYPES:
            found[name] = region.compute_dtype
    return found


def _module_reports(
    ref_calls: dict[str, dict[str, Any]],
    mixed_calls: dict[str, dict[str, Any]],
    compute: torch.dtype,
    loss_scale: float,
    islands: set[str],
    grad_dtypes: dict[str, torch.dtype],
) -> list[ModuleReport]:
    """Each module's figures from the float32 run and the mixed run (recorded by ``run``);
    gradient underflow in the dtype each module takes its output gradient in
    (``_gradient_dtypes``; the compute dtype for a module the mixed run missed)."""
    reports = []
    for name, ref in ref_calls.items():
        mix = mixed_calls.get(name, {})
        out_zero, out_sub = lost(ref["output"], compute)
        scaled_ref = None if ref["grad"] is None else ref["grad"] * loss_scale
        grad_dtype = grad_dtypes.get(name, compute)
        grad_zero, grad_sub = lost(scaled_ref, grad_dtype)
        reports.append(
            ModuleReport(
                name=name,
                kind=ref["kind"],
                order=ref["order"],
                dtype=dtype_name(mix["output"].dtype) if mix else "?",
                # Over every call of the module (a loop's later call may be the one that
                # overflows); the errors compare the first calls.
                max_input=ref["peak_input"],
                max_output=ref["peak_output"],
                max_grad=ref["peak_grad"],
                max_output_mixed=mix.get("peak_output", 0.0),
                max_grad_mixed=mix.get("peak_grad", 0.0),
                nonfinite_output=mix.get("nonfinite_out", 0),
                nonfinite_grad=mix.get("nonfinite_grad_all", 0),
                nonfinite_input=nonfinite(mix.get("input")),
                overflow_origin=bool(mix.get("origin", False)),
                output_underflow=out_zero,
                output_subnormal=out_sub,
                grad_underflow=grad_zero,
                grad_subnormal=grad_sub,
                output_rel_error=error(mix.get("output"), ref["output"]),
                grad_rel_error=error(mix.get("grad"), ref["grad"]),
                float32=name in islands or compute == torch.float32,
                grad_dtype=dtype_name(grad_dtype),
                min_grad=min_nonzero(ref["grad"]),
                max_input_grad=max_abs(ref["input_grad"]),
                max_param_grad=ref["param_grad_max"],
            )
        )
    return reports
