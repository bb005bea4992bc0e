"""Numerics diagnostics: which layer overflows or underflows in 16 bits, and what to do.

``diagnose`` runs one batch twice, in float32 and under the policy, with hooks on every
module, and compares them; for float16 it then checks its own recommendation by doing on
that batch what the dynamic loss scaler would (see ``_back_off``).
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from mixprec._calling import call
from mixprec._dtypes import dtype_name
from mixprec._rng import same_draws
from mixprec.casting import first_floating
from mixprec.doctor._common import float32_model, to_json
from mixprec.float8 import Float8Options
from mixprec.levels import KeepEntry, applied, auto_mixed_precision, module_dtypes
from mixprec.policy import Policy, PolicyLike, get_policy
from mixprec.scaling import DynamicConfig

if TYPE_CHECKING:
    from matplotlib.figure import Figure

    from mixprec.doctor.float8 import Float8Report

__all__ = ["ModuleReport", "Report", "diagnose"]

# Relative error (||mixed - float32|| / ||float32||) above which a module is flagged. Healthy
# layers measured ~4e-4 (float16) and ~3e-3 (bfloat16) on outputs; gradients are noisier
# (ReLU gates flip on rounding near zero): up to 0.05 (float16) and 0.08 (bfloat16). The
# limits sit well above that, so only real damage shows.
OUTPUT_ERROR_LIMIT = {torch.bfloat16: 0.1, torch.float16: 0.02, torch.float32: 1e-4}
GRAD_ERROR_LIMIT = {torch.bfloat16: 0.5, torch.float16: 0.25, torch.float32: 1e-4}
# Fraction of non-zero gradient values that vanish in 16 bits before flagging a module.
UNDERFLOW_LIMIT = 0.05
# The lowest loss scale a float16 run reaches: DynamicLossScaler's default min_scale. Backing
# off below it is not possible, so a backward that overflows float16 there overflows at every
# step: such modules must compute in float32 (or the run needs bfloat16).
SCALE_FLOOR = DynamicConfig().floor


@dataclass
class ModuleReport:
    """One module's numbers; ``max_*`` are maxima of |value| over the finite values."""

    name: str
    kind: str
    order: int  # forward execution order
    dtype: str  # the dtype its output has under the policy
    max_input: float
    max_output: float
    max_grad: float
    max_output_mixed: float
    max_grad_mixed: float
    nonfinite_output: int
    nonfinite_grad: int
    nonfinite_input: int
    output_underflow: float  # fraction of non-zero float32 outputs that are 0 in 16 bits
    output_subnormal: float  # ... that are subnormal in 16 bits
    grad_underflow: float
    grad_subnormal: float
    output_rel_error: float
    grad_rel_error: float
    float32: bool  # computes in float32 under the policy (an island)
    min_grad: float = 0.0  # smallest non-zero |gradient| in float32
    max_input_grad: float = 0.0  # max |gradient of its input| (float32 run)
    max_param_grad: float = 0.0  # max |gradient of its own parameters| (float32 run)
    risk: float = 0.0
    reasons: list[str] = field(default_factory=list)

    @property
    def max_backward(self) -> float:
        """The largest |gradient| its backward receives or produces (float32 run, unscaled):
        of its output, of its input, of its parameters. Times the loss scale, this is what
        the 16-bit backward must hold."""
        return max(self.max_grad, self.max_input_grad, self.max_param_grad)


class _Recorder:
    """Forward hooks on every module: input, output, and the gradients of both, per call
    (the first call of each module); ``_run`` adds its parameters' gradients."""

    def __init__(self, model: nn.Module) -> None:
        self.calls: dict[str, dict[str, Any]] = {}
        self.handles = [
            m.register_forward_hook(self._hook(name or "(model)"))
            for name, m in model.named_modules()
        ]

    def _hook(self, name: str) -> Callable[..., None]:
        def hook(module: nn.Module, args: Any, output: Any) -> None:
            out = first_floating(output)
            if out is None or name in self.calls:  # first call of each module only
                return
            inp = first_floating(args)
            entry: dict[str, Any] = {
                "kind": type(module).__name__,
                "order": len(self.calls),
                "module": module,
                "input": None if inp is None else inp.detach(),
                "output": out.detach(),
                "grad": None,
                "input_grad": None,
            }
            self.calls[name] = entry
            if out.requires_grad:
                out.register_hook(lambda g: entry.__setitem__("grad", g.detach()))
            if inp is not None and inp.requires_grad:
                inp.register_hook(lambda g: entry.__setitem__("input_grad", g.detach()))

        return hook

    def remove(self) -> None:
        for h in self.handles:
            h.remove()


# Both read 16-bit tensors through float32: the same values, and 16-bit reductions are
# emulated (slow) on CPUs.
def _max_abs(t: torch.Tensor | None) -> float:
    if t is None or t.numel() == 0:
        return 0.0
    values = t.detach().float().abs()
    return float(torch.where(torch.isfinite(values), values, 0.0).max())


def _nonfinite(t: torch.Tensor | None) -> int:
    return 0 if t is None else int((~torch.isfinite(t.detach().float())).sum())


def _finite_run(calls: dict[str, dict[str, Any]], loss: float) -> bool:
    """A recorded run had a finite loss and no inf/NaN in any output or backward."""
    return math.isfinite(loss) and not any(
        c["nonfinite_backward"] or _nonfinite(c["output"]) for c in calls.values()
    )


def _lost(t: torch.Tensor | None, dtype: torch.dtype) -> tuple[float, float]:
    """Fractions of non-zero float32 values that flush to zero / are subnormal in ``dtype``."""
    if t is None or dtype == torch.float32:
        return 0.0, 0.0
    values = t.float()
    nonzero = values[(values != 0) & torch.isfinite(values)]
    if nonzero.numel() == 0:
        return 0.0, 0.0
    cast = nonzero.to(dtype)
    tiny = torch.finfo(dtype).tiny  # smallest normal number
    zero = float((cast == 0).float().mean())
    sub = float(((cast != 0) & (cast.abs() < tiny)).float().mean())
    return zero, sub


def _rel_error(mixed: torch.Tensor | None, ref: torch.Tensor | None) -> float:
    if mixed is None or ref is None or mixed.shape != ref.shape:
        return 0.0
    diff = mixed.float() - ref.float()
    if not torch.isfinite(diff).all():
        return math.inf
    norm = float(ref.float().norm())
    return float(diff.norm()) / norm if norm > 0 else 0.0


def _min_nonzero(t: torch.Tensor | None) -> float:
    if t is None:
        return 0.0
    values = t.float().abs()
    values = values[(values > 0) & torch.isfinite(values)]
    if values.numel() == 0:
        return 0.0
    # The 1st percentile, so a handful of stray tiny values do not dictate the scale.
    return float(torch.quantile(values[:1_000_000], 0.01))


def _run(
    model: nn.Module,
    inputs: Any,
    targets: Any,
    loss_fn: Callable[..., torch.Tensor],
    scale: float,
    rewind: Callable[[], None],
) -> tuple[dict[str, dict[str, Any]], float]:
    """One forward and backward, the loss multiplied by ``scale``, after ``rewind()`` (every
    pass draws the same random numbers); the recorded gradients are divided by the scale
    again (in float32) so they compare with the float32 run.

    Per module besides the recorder's entries: ``param_grad_max`` (unscaled, finite values)
    and ``nonfinite_backward``, the inf/NaN count of its output, input and parameter
    gradients as computed (scaled), which is what the scaler's check sees."""
    recorder = _Recorder(model)
    try:
        rewind()
        model.zero_grad(set_to_none=True)
        loss = loss_fn(call(model, inputs), targets)
        if loss.requires_grad:
            (loss * scale).backward()
    finally:
        recorder.remove()
    for entry in recorder.calls.values():
        module = entry.pop("module")
        params = [p.grad for p in module.parameters(recurse=False) if p.grad is not None]
        entry["param_grad_max"] = max((_max_abs(g) for g in params), default=0.0) / scale
        entry["nonfinite_backward"] = (
            _nonfinite(entry["grad"])
            + _nonfinite(entry["input_grad"])
            + sum(_nonfinite(g) for g in params)
        )
        if scale != 1.0:
            if entry["grad"] is not None:
                entry["scaled_grad"] = entry["grad"]
                entry["grad"] = entry["grad"].float() / scale
            if entry["input_grad"] is not None:
                entry["input_grad"] = entry["input_grad"].float() / scale
    return recorder.calls, float(loss.detach().float())


@dataclass
class Report:
    """What ``diagnose`` found. ``culprits()``, ``recommended_keep_float32``,
    ``suggested_loss_scale``, ``bfloat16_would_help``, ``to_json()``, ``plot(path)``.

    ``loss_scale_reached``: float16 only: the scale a ``DynamicLossScaler`` starting at
    ``loss_scale`` backs off to on this batch with the recommendation applied, after
    ``backoff_steps`` skipped steps (checked by running the 16-bit backward there)."""

    policy: str
    level: str
    compute_dtype: str
    loss_float32: float
    loss_mixed: float
    loss_scale: float  # the scale the mixed run's backward used
    modules: list[ModuleReport]
    recommended_keep_float32: list[str]
    suggested_loss_scale: float | None
    loss_scale_range: tuple[float, float] | None
    bfloat16_would_help: bool
    advice: list[str]
    loss_scale_reached: float | None = None
    backoff_steps: int = 0
    model: str = ""  # the model's class name

    def culprits(self) -> list[ModuleReport]:
        """Flagged modules, most dangerous first (ties: execution order)."""
        flagged = [m for m in self.modules if m.risk > 0]
        return sorted(flagged, key=lambda m: (-m.risk, m.order))

    @property
    def healthy(self) -> bool:
        return not self.culprits()

    def __str__(self) -> str:
        lines = [
            f"policy {self.policy}, level {self.level}, loss scale {self.loss_scale:g}: "
            f"loss {self.loss_mixed:.6g} (float32 {self.loss_float32:.6g})",
        ]
        header = (
            f"{'module':<28} {'type':<14} {'dtype':<9} {'max |out|':>10} {'max |grad|':>10} "
            f"{'grad 0%':>7} {'out err':>8} {'grad err':>8}  flags"
        )
        lines += [header, "-" * len(header)]
        for m in sorted(self.modules, key=lambda m: m.order):
            lines.append(
                f"{m.name[:28]:<28} {m.kind[:14]:<14} {m.dtype:<9} {m.max_output:>10.3g} "
                f"{m.max_grad:>10.3g} {100 * m.grad_underflow:>6.1f}% "
                f"{m.output_rel_error:>8.2g} {m.grad_rel_error:>8.2g}  {'; '.join(m.reasons)}"
            )
        culprits = self.culprits()
        lines.append("")
        if not culprits:
            lines.append(f"healthy: no module at risk in {self.compute_dtype}")
        else:
            names = ", ".join(m.name for m in culprits)
            lines.append(f"culprits, most dangerous first: {names}")
        lines += [f"- {a}" for a in self.advice]
        return "\n".join(lines)

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["culprits"] = [m.name for m in self.culprits()]
        return data

    def to_json(self, **kwargs: Any) -> str:
        return to_json(self.to_dict(), **kwargs)

    def plot(self, path: str) -> Figure:
        """Per-module max |output|, max |gradient| (of its output, input or weights) and
        small |gradient| (of its output) in the float32 run, on a log scale, against the
        16-bit dtype's largest and smallest normal values: as they are for outputs, divided
        by the loss scale for gradients (the backward holds the gradient times the scale).
        Modules recommended for float32 are shaded. A zero (an all-zero output; an all-zero
        or absent gradient) has no place on a log axis: it is a gap in its line and a mark
        in a grey lane below the axis. Saves a PNG to ``path``; returns the closed figure."""
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from matplotlib.ticker import FuncFormatter, NullLocator

        mods = sorted(self.modules, key=lambda m: m.order)
        info = torch.finfo(getattr(torch, self.compute_dtype))
        fig, ax = plt.subplots(figsize=(max(8.0, 0.45 * len(mods) + 4.0), 5.0))
        x = list(range(len(mods)))
        kept = set(self.recommended_keep_float32)
        shaded = [i for i, m in enumerate(mods) if m.name in kept]
        for i in shaded:
            label = "recommended keep_float32" if i == shaded[0] else None
            ax.axvspan(i - 0.45, i + 0.45, color="tab:red", alpha=0.1, lw=0, label=label)
        series = [
            ("max |output|", "o-", "tab:blue", [m.max_output for m in mods]),
            ("max |gradient| (output, input, weights)", "s-", "tab:orange",
             [m.max_backward for m in mods]),
            ("small |gradient| (1st pct.)", "v:", "tab:green", [m.min_grad for m in mods]),
        ]  # fmt: skip
        for label, style, color, values in series:
            # A log axis has no 0: zeros are gaps in the lines, marked in their own lane.
            shown = [v if v > 0 else math.nan for v in values]
            ax.semilogy(x, shown, style, color=color, label=label)
        scale = self.loss_scale
        ax.axhline(info.max, color="red", ls="--", label=f"{self.compute_dtype} max")
        ax.axhline(info.tiny, color="darkorange", ls="--", label=f"{self.compute_dtype} min normal")
        if scale != 1.0:
            ax.axhline(
                info.max / scale,
                color="red",
                ls=":",
                label=f"{self.compute_dtype} max / loss scale {scale:g} (gradients)",
            )
            ax.axhline(
                info.tiny / scale,
                color="darkorange",
                ls=":",
                label=f"min normal / loss scale {scale:g} (gradients)",
            )
        reached = self.loss_scale_reached
        if reached is not None and reached != scale:
            ax.axhline(
                info.max / reached,
                color="purple",
                ls=":",
                label=f"{self.compute_dtype} max / scale {reached:g} reached",
            )
        zeros = [
            (what, marker, [i for i, v in enumerate(values) if v == 0])
            for what, marker, values in (
                ("zero output", "o", [m.max_output for m in mods]),
                # None at all, too: a Flatten of the input has nothing to send one to.
                ("zero or no gradient", "x", [m.max_backward for m in mods]),
            )
        ]
        if any(found for _, _, found in zeros):
            # A grey lane below every value: 8% of the axis height, in log space.
            low, high = ax.get_ylim()
            lane = low / (high / low) ** 0.09
            ax.set_ylim(lane, high)
            ax.axhspan(lane, low, color="0.85", lw=0, label="0 (no place on a log axis)")
            # The lane's one tick reads "0"; the log ticks stay above it.
            middle = math.sqrt(lane * low)
            log_format = ax.yaxis.get_major_formatter()
            ax.set_yticks([middle, *(t for t in ax.get_yticks() if low <= t <= high)])
            ax.yaxis.set_major_formatter(
                FuncFormatter(lambda v, pos: "0" if v < low else log_format(v, pos))
            )
            ax.yaxis.set_minor_locator(NullLocator())
            for what, marker, found in zeros:
                if found:
                    ax.plot(
                        found,
                        [middle] * len(found),
                        marker,
                        color="black",
                        ls="none",
                        ms=7,
                        label=what,
                    )
        ax.set_xticks(x, [m.name for m in mods], rotation=60, ha="right", fontsize=7)
        ax.set_xlim(-0.6, len(mods) - 0.4)
        ax.set_xlabel("module (forward execution order)")
        ax.set_ylabel("|value| in the float32 run (gradients unscaled)")
        detail = f"level {self.level}, {self.compute_dtype} compute, loss scale {scale:g}"
        if reached is not None and reached != scale:
            detail += f" (backs off to {reached:g})"
        ax.set_title(
            f"mixprec doctor: {self.model or 'model'} under {self.policy}\n{detail}",
            fontsize=10,
        )
        ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0)
        fig.tight_layout()
        fig.savefig(path, dpi=120)
        plt.close(fig)
        return fig


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
) -> Report | Float8Report:
    """Run one batch in float32 and under ``policy``/``level`` and report, per module, the
    value ranges against the 16-bit dtype, underflow, non-finite values and the error
    against float32. ``model`` is a float32 model; it is copied, never modified.

    ``loss_scale``: the scale the mixed run's backward uses, as training would; by default
    what the policy implies (2**16, ``DynamicLossScaler``'s start, for float16; 1 otherwise).
    Underflow fractions are measured at that scale; pass 1 to see the unscaled gradients.

    ``recommended_keep_float32`` accounts for the backward as well as the forward: for
    float16 it also lists the leaves whose gradients overflow even at the scaler's floor
    (loss scale 1), then applies the list to a copy and backs the scale off from
    ``loss_scale`` as ``DynamicLossScaler`` would on this batch (``loss_scale_reached``,
    ``backoff_steps``), keeping any further leaf that still overflows at the floor.

    A float8 policy (``mixed_float8``...) gives ``diagnose_float8``'s ``Float8Report``: per
    float8 layer, its casts' amax, scales, saturation and flush, and its error against
    bfloat16; ``float8``, ``keep_bfloat16`` and ``keep_float32`` are passed to it (and are
    float8-only: other policies diagnose the model without keeps, to find them)."""
    if get_policy(policy).float8_recipe is not None:
        if loss_scale is not None:
            raise ValueError(
                f"loss_scale={loss_scale!r} does not apply to float8 policies: each float8 "
                "cast has its own scale; leave it None"
            )
        from mixprec.doctor.float8 import diagnose_float8

        return diagnose_float8(
            model, inputs, targets, loss_fn, policy, level,
            float8=float8, keep_bfloat16=keep_bfloat16, keep_float32=keep_float32,
        )  # fmt: skip
    given = [n for n, v in (("float8", float8), ("keep_bfloat16", keep_bfloat16),
                            ("keep_float32", keep_float32)) if v]  # fmt: skip
    if given:
        raise ValueError(
            f"diagnose: {', '.join(given)} apply to float8 policies only; policy "
            f"{get_policy(policy).name!r} is diagnosed without keeps, to find them"
        )
    model = float32_model(model, "diagnose")
    resolved = get_policy(policy)
    if loss_scale is None:
        loss_scale = 2.0**16 if resolved.loss_scaling == "dynamic" else 1.0
    if not (isinstance(loss_scale, (int, float)) and 0 < loss_scale < math.inf):
        raise ValueError(f"loss_scale={loss_scale!r} is invalid; it must be finite and > 0")
    reference = copy.deepcopy(model).float()
    mixed = auto_mixed_precision(copy.deepcopy(model), resolved, level)
    # Each `same_draws` block starts from the caller's RNG state and restores it.
    with same_draws() as rewind:
        ref_calls, ref_loss = _run(reference, inputs, targets, loss_fn, 1.0, rewind)
        mixed_calls, mixed_loss = _run(mixed, inputs, targets, loss_fn, float(loss_scale), rewind)
    compute = resolved.compute_dtype
    limit = float(torch.finfo(compute).max)
    # Modules that compute in float32 under the policy (islands, kept modules, inside them).
    islands = {row.name for row in module_dtypes(mixed) if row.compute == "float32"}
    leaves = {n or "(model)" for n, m in model.named_modules() if not list(m.children())}

    reports = []
    for name, ref in ref_calls.items():
        mix = mixed_calls.get(name, {})
        out_zero, out_sub = _lost(ref["output"], compute)
        scaled_ref = None if ref["grad"] is None else ref["grad"] * loss_scale
        grad_zero, grad_sub = _lost(scaled_ref, compute)
        rep = ModuleReport(
            name=name,
            kind=ref["kind"],
            order=ref["order"],
            dtype=dtype_name(mix["output"].dtype) if mix else "?",
            max_input=_max_abs(ref["input"]),
            max_output=_max_abs(ref["output"]),
            max_grad=_max_abs(ref["grad"]),
            max_output_mixed=_max_abs(mix.get("output")),
            max_grad_mixed=_max_abs(mix.get("grad")),
            nonfinite_output=_nonfinite(mix.get("output")),
            nonfinite_grad=_nonfinite(mix.get("scaled_grad", mix.get("grad"))),
            nonfinite_input=_nonfinite(mix.get("input")),
            output_underflow=out_zero,
            output_subnormal=out_sub,
            grad_underflow=grad_zero,
            grad_subnormal=grad_sub,
            output_rel_error=_rel_error(mix.get("output"), ref["output"]),
            grad_rel_error=_rel_error(mix.get("grad"), ref["grad"]),
            float32=name in islands or compute == torch.float32,
            min_grad=_min_nonzero(ref["grad"]),
            max_input_grad=_max_abs(ref["input_grad"]),
            max_param_grad=ref["param_grad_max"],
        )
        reports.append(rep)
    origin = _origin(reports, leaves)
    for rep in reports:
        _score(rep, compute, limit, origin)

    # Forward: leaves whose values leave the 16-bit range (the overflowing layer and its
    # consumer), and those whose output turns inf/NaN from finite inputs.
    recommended = [
        r.name
        for r in sorted(reports, key=lambda r: r.order)
        if r.name in leaves
        and not r.float32
        and (
            r.max_input > limit
            or r.max_output > limit
            or (r.nonfinite_output > 0 and r.nonfinite_input == 0)
        )
    ]
    # Backward: the gradient a float32 block sends back to the 16-bit layers before it is
    # as large as the block's forward gain. A dynamic scaler backs off until the 16-bit
    # backward fits, but not below its floor: a leaf whose gradients exceed the range even
    # there overflows at every step, so it is kept too (float32 figures; power-of-two
    # scaling is exact, so floor * gradient is what the 16-bit backward would hold).
    dynamic = resolved.loss_scaling == "dynamic"
    floor = min(SCALE_FLOOR, float(loss_scale)) if dynamic else float(loss_scale)
    for r in reports:
        if r.name in leaves and not r.float32 and floor * r.max_backward > limit:
            r.risk += 100 + floor * r.max_backward / limit
            r.reasons.append(
                f"gradients up to {r.max_backward:.3g} exceed {dtype_name(compute)} max "
                f"{limit:.4g} even at loss scale {floor:g}"
            )
            if r.name not in recommended:
                recommended.append(r.name)
    reached, backoff, half = None, 0, {r.name for r in reports if not r.float32}
    # The mixed run at this scale with nothing kept had nothing non-finite: nothing to back off.
    healthy = _finite_run(mixed_calls, mixed_loss)
    if compute == torch.float16 and healthy and not recommended:
        reached = float(loss_scale)  # the mixed run at this scale had nothing non-finite
    elif compute == torch.float16:
        with same_draws() as rewind:
            recommended, reached, backoff, half = _back_off(
                model, inputs, targets, loss_fn, resolved, level, recommended,
                reports, float(loss_scale), floor, limit, leaves, rewind,
            )  # fmt: skip
    order = {r.name: r.order for r in reports}
    recommended.sort(key=lambda n: order.get(n, len(order)))
    # The loss scale range for what stays in 16 bits once the recommendation is applied.
    scale, scale_range = _loss_scale([r for r in reports if r.name in half & leaves], compute)
    bf16_max = float(torch.finfo(torch.bfloat16).max)
    overflow = any(
        r.max_input > limit or r.max_output > limit or floor * r.max_backward > limit
        for r in reports
    )
    bf16_helps = (
        compute == torch.float16
        and overflow
        and all(max(r.max_output, r.max_backward) < bf16_max for r in reports)
    )
    done = applied(mixed)
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
    )
    report.advice = _advice(report, compute, half & leaves)
    return report


def _back_off(
    model: nn.Module,
    inputs: Any,
    targets: Any,
    loss_fn: Callable[..., torch.Tensor],
    policy: Policy,
    level: str,
    keep: list[str],
    reports: list[ModuleReport],
    start: float,
    floor: float,
    limit: float,
    leaves: set[str],
    rewind: Callable[[], None],
) -> tuple[list[str], float, int, set[str]]:
    """Check the recommendation the way training would meet it: on a copy prepared with
    ``keep`` in float32, do what ``DynamicLossScaler`` does on this batch (a skipped step
    changes no weight, so every retry sees the same batch and weights): halve the scale
    while the 16-bit backward overflows, down to ``floor``. If it still overflows there,
    keep the 16-bit leaf where the inf/NaN starts and start again.

    Each pass first runs at ``floor``: a further culprit is found with one run. Once the
    floor passes, the scale reached is searched from a prediction made with the float32
    gradients of the leaves left in 16 bits (exact for powers of two), confirmed by real
    backwards. Returns the keep list, the scale reached, the number of steps skipped
    reaching it, and the modules left in 16 bits."""
    keep = list(keep)
    peaks = {r.name: r.max_backward for r in reports}
    steps_to_floor = math.ceil(math.log2(start / floor)) if start > floor else 0
    half: set[str] = set()
    for _ in range(len(leaves) + 1):
        prepared = copy.deepcopy(model)
        named = {n or "(model)": m for n, m in prepared.named_modules()}
        auto_mixed_precision(prepared, policy, level, keep_float32=[named[n] for n in keep])
        half = {r.name for r in module_dtypes(prepared) if r.compute != "float32"}
        calls, loss = _run(prepared, inputs, targets, loss_fn, floor, rewind)
        if not _finite_run(calls, loss):
            culprit = _first_nonfinite_leaf(calls, half & leaves)
            if culprit is None:  # nothing left in 16 bits to keep: float32 itself overflows
                return keep, floor, steps_to_floor, half
            keep.append(culprit)
            continue
        peak = max((peaks.get(n, 0.0) for n in half & leaves), default=0.0)
        scale, steps = start, 0
        while scale > floor and scale * peak > limit:
            scale, steps = max(scale / 2, floor), steps + 1
        while scale > floor:
            calls, loss = _run(prepared, inputs, targets, loss_fn, scale, rewind)
            if _finite_run(calls, loss):
                break
            scale, steps = max(scale / 2, floor), steps + 1
        return keep, scale, steps, half
    return keep, floor, steps_to_floor, half


def _first_nonfinite_leaf(calls: dict[str, dict[str, Any]], half: set[str]) -> str | None:
    """The 16-bit leaf where inf/NaN starts: forward order first (a non-finite output from
    finite input), then backward order (the leaf run last whose output, input or parameter
    gradients are non-finite)."""
    ordered = sorted((n for n in calls if n in half), key=lambda n: calls[n]["order"])
    for name in ordered:
        entry = calls[name]
        if _nonfinite(entry["output"]) and not _nonfinite(entry["input"]):
            return name
    for name in reversed(ordered):
        if calls[name]["nonfinite_backward"]:
            return name
    return None


def _origin(reports: list[ModuleReport], leaves: set[str]) -> tuple[str, str] | None:
    """Where inf/NaN first appeared: the first leaf (forward order) whose output is
    non-finite from finite inputs; failing that, the first gradient to go non-finite in
    backward order (the leaf run last whose output gradient is non-finite)."""
    ordered = sorted((r for r in reports if r.name in leaves), key=lambda r: r.order)
    for r in ordered:
        if r.nonfinite_output and not r.nonfinite_input:
            return r.name, "forward"
    for r in reversed(ordered):
        if r.nonfinite_grad:
            return r.name, "backward"
    return None


def _score(
    rep: ModuleReport, compute: torch.dtype, limit: float, origin: tuple[str, str] | None
) -> None:
    """Risk: where an overflow starts first, then values beyond the range, then gradient
    underflow, then large errors. Non-finite values inherited from upstream are symptoms,
    not causes, and are not flagged."""
    if origin is not None and origin[0] == rep.name:
        rep.risk += 1000
        what = "output" if origin[1] == "forward" else "gradient of its output"
        rep.reasons.append(f"{what} becomes inf/NaN here first ({rep.dtype})")
    if rep.float32:
        return
    peak = max(rep.max_input, rep.max_output)
    if peak > limit:
        rep.risk += 100 + peak / limit
        rep.reasons.append(f"values up to {peak:.3g} exceed {dtype_name(compute)} max {limit:.4g}")
    if rep.grad_underflow > UNDERFLOW_LIMIT:
        rep.risk += 2 + rep.grad_underflow
        rep.reasons.append(f"{100 * rep.grad_underflow:.0f}% of gradients flush to zero")
    for what, error, limits in (
        ("output", rep.output_rel_error, OUTPUT_ERROR_LIMIT),
        ("gradient", rep.grad_rel_error, GRAD_ERROR_LIMIT),
    ):
        if not rep.reasons and math.isfinite(error) and error > limits[compute]:
            rep.risk += 1 + min(error, 10.0)
            rep.reasons.append(f"{what} error vs float32 {error:.2g} > {limits[compute]}")


def _loss_scale(
    reports: list[ModuleReport], compute: torch.dtype
) -> tuple[float | None, tuple[float, float] | None]:
    """The range of loss scales that lifts small gradients above the smallest normal
    number without pushing the largest past the maximum, and a power of two inside it."""
    if compute != torch.float16:
        return None, None
    info = torch.finfo(compute)
    # Large: every gradient the 16-bit backward holds (of outputs, inputs, parameters).
    small = [r.min_grad for r in reports if r.min_grad > 0 and not r.float32]
    large = [r.max_backward for r in reports if r.max_backward > 0 and not r.float32]
    if not small or not large:
        return None, None
    low = info.tiny / min(small)
    high = info.max / max(large)
    # Aim for the middle in log space, then round down to a power of two.
    middle = math.sqrt(max(low, 1e-30) * high) if low < high else high
    scale = 2.0 ** math.floor(math.log2(max(middle, 2.0**-24)))
    return scale, (low, high)


def _advice(report: Report, compute: torch.dtype, left: set[str]) -> list[str]:
    """``left``: the leaves still computing in 16 bits with the recommendation applied."""
    advice = []
    if report.recommended_keep_float32:
        advice.append(
            "keep in float32: auto_mixed_precision(..., keep_float32="
            f"{report.recommended_keep_float32!r})"
        )
        if not left:
            advice.append(
                "that keeps every module in float32: no float16 keep list fixes this model "
                "(the gradients before the overflowing layers are as large as their gain)"
                + ("" if report.bfloat16_would_help else "; train it in float32")
            )
    if report.bfloat16_would_help:
        advice.append(
            "every value fits bfloat16's range: policy 'mixed_bfloat16' avoids the overflow "
            "without keeping layers in float32"
        )
    reached = report.loss_scale_reached
    if report.backoff_steps and reached is not None and left:
        top = max((m for m in report.modules if m.name in left), key=lambda m: m.max_backward)
        advice.append(
            f"{'with that, ' if report.recommended_keep_float32 else ''}the float16 backward "
            f"holds gradients up to {top.max_backward:.3g} (in {top.name!r}): a "
            f"DynamicLossScaler starting at {report.loss_scale:g} skips the first "
            f"{report.backoff_steps} steps backing off to {reached:g}; start it there: "
            f"LossScaleOptimizer(..., loss_scaler=DynamicLossScaler(init_scale={reached:g}))"
        )
    if compute == torch.float16 and report.loss_scale_range is not None:
        low, high = report.loss_scale_range
        scale = report.suggested_loss_scale or 1.0
        # DynamicLossScaler's default max_scale is 2**24: raise it when more is needed.
        ceiling = ""
        if scale > 2.0**24:
            ceiling = f", max_scale={2.0 ** math.floor(math.log2(max(high, scale))):g}"
        if any(m.grad_underflow > UNDERFLOW_LIMIT for m in report.modules):
            advice.append(
                f"gradients underflow float16 at loss scale {report.loss_scale:g}: use a "
                f"loss scale in [{low:.3g}, "
                f"{high:.3g}], e.g. StaticLossScaler({scale:g}) or "
                f"DynamicLossScaler(init_scale={scale:g}{ceiling})"
            )
        if low > high:
            advice.append(
                "no single float16 loss scale fits both the smallest and the largest "
                "gradients: use bfloat16, or keep the layers with the largest gradients in "
                "float32"
            )
    return advice
