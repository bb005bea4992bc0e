"""Numerics diagnostics: which layer overflows or underflows in 16 bits, and what to do.

``diagnose`` runs one batch twice, in float32 and under the policy, with hooks on every
module, and compares them. ``ScalerHealth`` watches a loss scaler during training and says,
once, what a collapsing scale or a run of skipped steps means.
"""

from __future__ import annotations

import copy
import json
import math
import warnings
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
from torch import nn

from mixprec._dtypes import dtype_name
from mixprec.casting import first_floating
from mixprec.levels import applied, auto_mixed_precision, module_dtypes
from mixprec.policy import PolicyLike, get_policy
from mixprec.scaling import ScalerState

__all__ = ["ModuleReport", "Report", "ScalerHealth", "diagnose"]

# Relative error (||mixed - float32|| / ||float32||) above which a module is flagged. Healthy
# layers measured ~4e-4 (float16) and ~3e-3 (bfloat16) on outputs; gradients are noisier
# (ReLU gates flip on rounding near zero): up to 0.05 (float16) and 0.08 (bfloat16). The
# limits sit well above that, so only real damage shows.
OUTPUT_ERROR_LIMIT = {torch.bfloat16: 0.1, torch.float16: 0.02, torch.float32: 1e-4}
GRAD_ERROR_LIMIT = {torch.bfloat16: 0.5, torch.float16: 0.25, torch.float32: 1e-4}
# Fraction of non-zero gradient values that vanish in 16 bits before flagging a module.
UNDERFLOW_LIMIT = 0.05


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
    risk: float = 0.0
    reasons: list[str] = field(default_factory=list)


class _Recorder:
    """Forward hooks on every module: input max, output and output gradient per call."""

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
                "input": None if inp is None else inp.detach(),
                "output": out.detach(),
                "grad": None,
            }
            self.calls[name] = entry
            if out.requires_grad:
                out.register_hook(lambda g: entry.__setitem__("grad", g.detach()))

        return hook

    def remove(self) -> None:
        for h in self.handles:
            h.remove()


def _max_abs(t: torch.Tensor | None) -> float:
    if t is None or t.numel() == 0:
        return 0.0
    finite = t[torch.isfinite(t)]
    return float(finite.abs().max()) if finite.numel() else 0.0


def _nonfinite(t: torch.Tensor | None) -> int:
    return 0 if t is None else int((~torch.isfinite(t)).sum())


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
    scale: float = 1.0,
) -> tuple[dict[str, dict[str, Any]], float]:
    """One forward and backward, the loss multiplied by ``scale``; the recorded gradients
    are divided by it again (in float32) so they compare with the float32 run."""
    recorder = _Recorder(model)
    try:
        model.zero_grad(set_to_none=True)
        out = model(*inputs) if isinstance(inputs, (tuple, list)) else model(inputs)
        loss = loss_fn(out, targets)
        if loss.requires_grad:
            (loss * scale).backward()
    finally:
        recorder.remove()
    if scale != 1.0:
        for entry in recorder.calls.values():
            if entry["grad"] is not None:
                entry["scaled_grad"] = entry["grad"]
                entry["grad"] = entry["grad"].float() / scale
    return recorder.calls, float(loss.detach().float())


@dataclass
class Report:
    """What ``diagnose`` found. ``culprits()``, ``recommended_keep_float32``,
    ``suggested_loss_scale``, ``bfloat16_would_help``, ``to_json()``, ``plot(path)``."""

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
        def clean(value: Any) -> Any:  # JSON has no inf/NaN
            if isinstance(value, float) and not math.isfinite(value):
                return str(value)
            if isinstance(value, dict):
                return {k: clean(v) for k, v in value.items()}
            if isinstance(value, (list, tuple)):
                return [clean(v) for v in value]
            return value

        return json.dumps(clean(self.to_dict()), **kwargs)

    def plot(self, path: str) -> None:
        """Per-module max |output| and max |gradient| (float32 run) on a log scale, against
        the 16-bit dtype's largest and smallest normal values."""
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        mods = sorted(self.modules, key=lambda m: m.order)
        dtype = getattr(torch, self.compute_dtype)
        fig, ax = plt.subplots(figsize=(max(6.0, 0.35 * len(mods)), 4.5))
        x = range(len(mods))
        ax.semilogy(x, [max(m.max_output, 1e-30) for m in mods], "o-", label="max |output|")
        ax.semilogy(x, [max(m.max_grad, 1e-30) for m in mods], "s-", label="max |gradient|")
        ax.semilogy(x, [max(m.min_grad, 1e-30) for m in mods], "v:", label="small |gradient|")
        info = torch.finfo(dtype)
        ax.axhline(info.max, color="red", ls="--", label=f"{self.compute_dtype} max")
        ax.axhline(info.tiny, color="orange", ls="--", label=f"{self.compute_dtype} min normal")
        ax.set_xticks(list(x), [m.name for m in mods], rotation=60, ha="right", fontsize=7)
        ax.set_ylabel("|value| (float32 run)")
        ax.legend(fontsize=7)
        fig.tight_layout()
        fig.savefig(path, dpi=120)
        plt.close(fig)


def diagnose(
    model: nn.Module,
    inputs: Any,
    targets: Any,
    loss_fn: Callable[..., torch.Tensor],
    policy: PolicyLike = "mixed_float16",
    level: str = "auto",
    loss_scale: float | None = None,
) -> Report:
    """Run one batch in float32 and under ``policy``/``level`` and report, per module, the
    value ranges against the 16-bit dtype, underflow, non-finite values and the error
    against float32. ``model`` is a float32 model; it is copied, never modified.

    ``loss_scale``: the scale the mixed run's backward uses, as training would; by default
    what the policy implies (2**16, ``DynamicLossScaler``'s start, for float16; 1 otherwise).
    Underflow fractions are measured at that scale; pass 1 to see the unscaled gradients."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"diagnose(model=...) needs an nn.Module, got {type(model).__name__}")
    original = getattr(model, "_orig_mod", None)  # torch.compile's OptimizedModule
    if isinstance(original, nn.Module):
        warnings.warn(
            "diagnose runs the model eagerly (its per-module hooks do not compile): it uses "
            "the module inside torch.compile's wrapper; the figures are eager mode's",
            UserWarning,
            stacklevel=2,
        )
        model = original
    if applied(model) is not None:
        raise ValueError("diagnose needs the float32 model, before auto_mixed_precision")
    resolved = get_policy(policy)
    if loss_scale is None:
        loss_scale = 2.0**16 if resolved.loss_scaling == "dynamic" else 1.0
    if not (isinstance(loss_scale, (int, float)) and 0 < loss_scale < math.inf):
        raise ValueError(f"loss_scale={loss_scale!r} is invalid; it must be finite and > 0")
    reference = copy.deepcopy(model).float()
    ref_calls, ref_loss = _run(reference, inputs, targets, loss_fn)
    mixed = auto_mixed_precision(copy.deepcopy(model), resolved, level)
    mixed_calls, mixed_loss = _run(mixed, inputs, targets, loss_fn, float(loss_scale))
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
        )
        reports.append(rep)
    origin = _origin(reports, leaves)
    for rep in reports:
        _score(rep, compute, limit, origin)

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
    scale, scale_range = _loss_scale(reports, compute)
    bf16_max = float(torch.finfo(torch.bfloat16).max)
    overflow = any(r.max_input > limit or r.max_output > limit for r in reports)
    bf16_helps = (
        compute == torch.float16
        and overflow
        and all(r.max_output < bf16_max and r.max_grad < bf16_max for r in reports)
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
    )
    report.advice = _advice(report, compute)
    return report


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
    small = [r.min_grad for r in reports if r.min_grad > 0 and not r.float32]
    large = [r.max_grad for r in reports if r.max_grad > 0 and not r.float32]
    if not small or not large:
        return None, None
    low = info.tiny / min(small)
    high = info.max / max(large)
    # Aim for the middle in log space, then round down to a power of two.
    middle = math.sqrt(max(low, 1e-30) * high) if low < high else high
    scale = 2.0 ** math.floor(math.log2(max(middle, 2.0**-24)))
    return scale, (low, high)


def _advice(report: Report, compute: torch.dtype) -> list[str]:
    advice = []
    if report.recommended_keep_float32:
        advice.append(
            "keep in float32: auto_mixed_precision(..., keep_float32="
            f"{report.recommended_keep_float32!r})"
        )
    if report.bfloat16_would_help:
        advice.append(
            "every value fits bfloat16's range: policy 'mixed_bfloat16' avoids the overflow "
            "without keeping layers in float32"
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


# -- watching the scaler during training ----------------------------------------------------


class ScalerHealth:
    """Watches ``ScalerState`` after each step and returns a diagnosis, once per kind."""

    def __init__(
        self, max_consecutive_skips: int = 10, window: int = 100, max_skip_rate: float = 0.2
    ) -> None:
        self.max_consecutive_skips = max_consecutive_skips
        self.window = window
        self.max_skip_rate = max_skip_rate
        self._recent: list[bool] = []
        self.warned: set[str] = set()

    def observe(self, state: ScalerState, skipped: bool, culprit: str | None = None) -> str | None:
        self._recent = [*self._recent[-(self.window - 1) :], skipped]
        where = f" The first non-finite values came from {culprit}." if culprit else ""
        if state.scale < 1.0 and "scale" not in self.warned:
            self.warned.add("scale")
            return (
                f"loss scale fell to {state.scale:g} < 1: values overflow float16 even "
                f"without scaling (typical of models pretrained in bfloat16).{where} Use "
                "policy='mixed_bfloat16', or keep the layers named by mp.diagnose(...) in "
                "float32 (keep_float32=report.recommended_keep_float32)."
            )
        if state.consecutive_skips >= self.max_consecutive_skips and "streak" not in self.warned:
            self.warned.add("streak")
            return (
                f"{state.consecutive_skips} steps in a row were skipped for inf/NaN "
                f"gradients (scale now {state.scale:g}).{where} If the scale is already low, "
                "the overflow is in the forward pass: run mp.diagnose(model, x, y, loss_fn) "
                "to find the layer, then keep it in float32 or use bfloat16."
            )
        if (
            len(self._recent) == self.window
            and sum(self._recent) / self.window > self.max_skip_rate
            and "rate" not in self.warned
        ):
            self.warned.add("rate")
            return (
                f"{sum(self._recent)} of the last {self.window} steps were skipped.{where} "
                "Occasional skips are how dynamic loss scaling probes the range; this many "
                "waste training: lower growth_factor or raise growth_interval, or find the "
                "layer with mp.diagnose."
            )
        return None
