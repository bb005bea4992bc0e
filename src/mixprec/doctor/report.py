"""What the 16-bit doctor reports: ``ModuleReport`` (one module's figures) and ``Report``
(all of them, the recommendation and the advice), as text, a dict, JSON or a plot."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

from mixprec.doctor._common import to_json
from mixprec.doctor.headroom import HEADROOM, headroom_text, percent

if TYPE_CHECKING:
    from matplotlib.figure import Figure

__all__ = ["ModuleReport", "PlanCheck", "Report"]


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
    # ||mixed - float32|| / ||float32|| (``relative_error``): inf where the mixed run has
    # inf/NaN, or where the float32 run's tensor is all zero and the mixed run's is not.
    output_rel_error: float
    grad_rel_error: float
    float32: bool  # computes in float32 under the policy (an island)
    min_grad: float = 0.0  # smallest non-zero |gradient| in float32
    max_input_grad: float = 0.0  # max |gradient of its input| (float32 run)
    max_param_grad: float = 0.0  # max |gradient of its own parameters| (float32 run)
    # The dtype its backward takes its output gradient in under the policy: its output's,
    # or the compute dtype of a leaf whose own region upcasts a 16-bit result. Underflow
    # (``grad_*``, ``small_grad_fraction``) is measured in it: a float32 one loses nothing.
    # "" (a report built by hand): the compute dtype.
    grad_dtype: str = ""
    risk: float = 0.0
    reasons: list[str] = field(default_factory=list)
    # How close each tensor came to a limit of the 16-bit dtype, as a fraction of the range
    # (``doctor.headroom``; above 1: beyond it, above ``Report.headroom``: at the edge).
    input_fraction: float = 0.0  # max |input| / max
    output_fraction: float = 0.0  # max |output| / max
    grad_fraction: float = 0.0  # max |gradient| x the lowest loss scale reached / max
    small_grad_fraction: float = 0.0  # smallest subnormal / (small |gradient| x loss scale)
    #: Some call of it (in the 16-bit run) made a non-finite output from a finite input.
    overflow_origin: bool = False

    @property
    def max_backward(self) -> float:
        """The largest |gradient| its backward receives or produces (float32 run, unscaled):
        of its output, of its input, of its parameters. Times the loss scale, this is what
        the 16-bit backward must hold."""
        return max(self.max_grad, self.max_input_grad, self.max_param_grad)

    @property
    def range_used(self) -> float:
        """How close its closest tensor came to a limit: the largest of the four fractions."""
        return max(
            self.input_fraction, self.output_fraction, self.grad_fraction,
            self.small_grad_fraction,
        )  # fmt: skip


@dataclass
class PlanCheck:
    """The doctor's check of its own plan: ``steps`` optimizer steps on the batch, on a copy
    prepared with the recommended keep list and a ``DynamicLossScaler`` started at the
    recommended scale, then one more forward; revised (a leaf kept, the start lowered) and
    run again until a round applies every step, for at most ``rounds`` rounds."""

    optimizer: str  # the optimizer it stepped, e.g. "Adam(lr=0.001)"
    steps: int  # optimizer steps per round
    applied: int  # steps applied in the last round
    rounds: int  # rounds run
    finite: bool  # the last round's forward after its last step was finite
    scale: float  # the loss scale the last round started at
    added: list[str] = field(default_factory=list)  # leaves it kept besides step 0's list
    findings: list[str] = field(default_factory=list)  # what each failed round found

    @property
    def passed(self) -> bool:
        """The last round applied every step and its final forward was finite."""
        return self.applied == self.steps and self.finite


@dataclass
class Report:
    """What ``diagnose`` found. ``culprits()``, ``recommended_keep_float32``,
    ``suggested_loss_scale``, ``bfloat16_would_help``, ``to_json()``, ``plot(path)``.

    ``loss_scale_reached``: float16 only: the scale a ``DynamicLossScaler`` starting at
    ``loss_scale`` backs off to on this batch with the recommendation applied, after
    ``backoff_steps`` skipped steps (checked by running the 16-bit backward there, and over
    the optimizer steps of ``check``, which lowers it where those steps back off further).

    Each module's ``*_fraction`` figures say how close its tensors came to the 16-bit
    limits; ``headroom`` is the margin inside which a tensor counts as at risk (kept in
    float32, or named in ``at_edge``)."""

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
    headroom: float = HEADROOM  # the margin to a limit below which a tensor is at risk
    at_edge: list[str] = field(default_factory=list)  # 16-bit leaves left at the edge
    check: PlanCheck | None = None  # float16: the plan checked over optimizer steps
    #: Inputs the cast at the model's boundary (O2, O3) makes inf: (where, max |value|).
    #: No keep list helps then, so none is recommended.
    inputs_overflow: list[tuple[str, float]] = field(default_factory=list)
    #: Where the model's own forward code (not a module) made the first inf/NaN: the
    #: modules around that code, (finished just before it, first handed inf/NaN), either
    #: ``None`` at an end; ``None`` where a module made it.
    own_code: tuple[str | None, str | None] | None = None

    def culprits(self) -> list[ModuleReport]:
        """Flagged modules, most dangerous first (ties: execution order)."""
        flagged = [m for m in self.modules if m.risk > 0]
        return sorted(flagged, key=lambda m: (-m.risk, m.order))

    @property
    def healthy(self) -> bool:
        """No module is at risk in the compute dtype."""
        return not self.culprits()

    def __str__(self) -> str:
        lines = [
            f"policy {self.policy}, level {self.level}, loss scale {self.loss_scale:g}: "
            f"loss {self.loss_mixed:.6g} (float32 {self.loss_float32:.6g})",
        ]
        header = (
            f"{'module':<28} {'type':<14} {'dtype':<9} {'max |out|':>10} {'max |grad|':>10} "
            f"{'grad 0%':>7} {'out err':>8} {'grad err':>8} {'range':>7}  flags"
        )
        lines += [header, "-" * len(header)]
        for m in sorted(self.modules, key=lambda m: m.order):
            lines.append(
                f"{m.name[:28]:<28} {m.kind[:14]:<14} {m.dtype:<9} {m.max_output:>10.3g} "
                f"{m.max_grad:>10.3g} {100 * m.grad_underflow:>6.1f}% "
                f"{m.output_rel_error:>8.2g} {m.grad_rel_error:>8.2g} "
                f"{percent(m.range_used):>7}  {'; '.join(m.reasons)}"
            )
        lines.append(
            f"range: how close the module's tensors came to a {self.compute_dtype} limit, as a "
            f"share of it (max |value| / max; flush point / small |gradient|); above "
            f"{percent(self.headroom)} (headroom {headroom_text(self.headroom)}) is at risk"
        )
        if self.check is not None:
            lines.append(_check_text(self.check))
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
        """Every field, modules as dicts (with their ``range_used``), the check as a dict
        (with ``passed``), and the culprits' names (most dangerous first)."""
        data = asdict(self)
        for entry, module in zip(data["modules"], self.modules, strict=True):
            entry["range_used"] = module.range_used
        if self.check is not None:
            data["check"]["passed"] = self.check.passed
        data["culprits"] = [m.name for m in self.culprits()]
        return data

    def to_json(self, **kwargs: Any) -> str:
        """``to_dict()`` as JSON (inf and NaN as strings); ``kwargs`` go to ``json.dumps``."""
        return to_json(self.to_dict(), **kwargs)

    def plot(self, path: str) -> Figure:
        """Two panels sharing the x axis, whose ticks name each module and its type. The
        top one: per-module max |output| in the float32 run, on a log scale, against the
        16-bit dtype's largest and smallest normal values, with a line for the headroom below
        the max and each module's ``range_used`` along the top (red where a 16-bit module is
        within the headroom). The bottom one: max |grad| (the table's column, the gradient of
        the module's output) and the small |gradient|, against those limits divided by the
        loss scale (the backward holds the gradient times the scale). Modules recommended for
        float32 are shaded in both. A zero (an all-zero output; an all-zero or absent
        gradient) has no place on a log axis: it is a gap in its line and a mark in a grey
        lane below the axis. Saves a PNG to ``path`` and returns the figure (a
        ``matplotlib.figure.Figure`` of its own: the matplotlib backend and pyplot's figures
        are left as they are)."""
        from mixprec.doctor.plot import plot_report

        return plot_report(self, path)


def _check_text(check: PlanCheck) -> str:
    """One line on the plan's check: what it ran and found."""
    done = (
        f"checked over {check.steps} {check.optimizer} steps with the plan applied, loss "
        f"scale from {check.scale:g}: {check.applied} of {check.steps} applied, forward "
        f"{'finite' if check.finite else 'NOT finite'} after them"
    )
    if check.findings:
        done += f" (after {check.rounds} rounds: {'; '.join(check.findings)})"
    return done
