"""``Plan``: the dtype ``autotune`` chose for each layer, with what it measured to choose it.

A plan is applied with ``mp.auto_mixed_precision(model, plan=plan)`` (see
``mixprec._plan_apply`` for what that does), printed as a table, and saved and loaded as JSON
(``plan_json``). ``Plan.from_dtypes`` makes one by hand.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from pathlib import Path

from mixprec._atomic import write_text_atomically
from mixprec._errors import ArgumentError
from mixprec._plan_apply import PLAN_DTYPES
from mixprec.doctor.headroom import percent
from mixprec.levels import LEVELS

__all__ = ["LayerChoice", "Plan", "TrainingCheck"]

#: Short column names of the dtypes in a plan's table.
SHORT = {"float32": "f32", "bfloat16": "bf16", "float16": "f16", "float8": "f8"}


@dataclass(frozen=True)
class LayerChoice:
    """One layer of a plan: its dtype, and per candidate dtype what ``autotune`` measured.

    ``times``: seconds of the layer's forward and backward alone on its recorded input, by
    candidate (a guide for the search; whole steps decide). ``errors``: the layer's relative
    error in that dtype against float32 (the larger of its output's and its input
    gradient's). ``headroom``: its largest |input| or |output| as a fraction of float16's
    max (``None`` where not measured). ``why``: the reason for ``dtype``."""

    name: str
    kind: str
    dtype: str
    times: dict[str, float] = field(default_factory=dict)
    errors: dict[str, float] = field(default_factory=dict)
    headroom: float | None = None
    why: str = ""


@dataclass(frozen=True)
class TrainingCheck:
    """The plan trained ``steps`` steps beside float32 from the same weights on the same
    batch: the largest relative difference of their losses, and whether it stayed within
    ``budget``. ``sent_to_float32``: the layers moved to float32 because it did not;
    ``level_from``: the level the plan had before the check moved it to O2 (``"O3"``), or
    ``None``."""

    steps: int
    budget: float
    max_difference: float
    passed: bool
    sent_to_float32: tuple[str, ...] = ()
    level_from: str | None = None

    def gap(self) -> str:
        """The losses' difference against the budget, as the warnings about a failed check
        say it: "loss 0.87 from float32's, budget 0.05"."""
        return f"loss {self.max_difference:.2g} from float32's, budget {self.budget:g}"


@dataclass(frozen=True)
class Plan:
    """The dtype of each layer (``dtypes``), the level the rest of the model gets
    (``level``), and the evidence: per-layer measurements (``layers``), the candidate dtypes
    left out and why (``left_out``), whole-step seconds of the plans timed (``step_times``,
    by label), the training check, the error budget and the machine.

    >>> plan = Plan.from_dtypes({"0": "bfloat16", "2": "float32"}, level="O2")
    >>> plan.dtypes
    {'0': 'bfloat16', '2': 'float32'}
    """

    layers: tuple[LayerChoice, ...]
    level: str = "O2"
    left_out: dict[str, str] = field(default_factory=dict)
    step_times: dict[str, float] = field(default_factory=dict)
    error_budget: float | None = None
    check: TrainingCheck | None = None
    machine: str = ""

    def __post_init__(self) -> None:
        if self.level not in LEVELS:
            raise ArgumentError(f"Plan level={self.level!r} is invalid; valid: {', '.join(LEVELS)}")
        seen: set[str] = set()
        for layer in self.layers:
            if layer.dtype not in PLAN_DTYPES:
                raise ArgumentError(
                    f"Plan layer {layer.name!r} has dtype {layer.dtype!r}; valid: "
                    f"{', '.join(PLAN_DTYPES)}"
                )
            if layer.name in seen:
                raise ArgumentError(f"Plan names layer {layer.name!r} twice")
            seen.add(layer.name)

    @classmethod
    def from_dtypes(cls, dtypes: dict[str, str], level: str = "O2") -> Plan:
        """A plan from ``{module name: dtype}``, measured by nobody (``why`` says so)."""
        if not isinstance(dtypes, dict):
            raise ArgumentError(
                f"Plan.from_dtypes(dtypes=...) needs a dict of module name -> dtype, got "
                f"{type(dtypes).__name__}"
            )
        layers = tuple(LayerChoice(str(n), "", str(d), why="given") for n, d in dtypes.items())
        return cls(layers, level=level)

    @property
    def dtypes(self) -> dict[str, str]:
        """``{module name: dtype}``, in the model's order."""
        return {layer.name: layer.dtype for layer in self.layers}

    @property
    def step_time(self) -> float | None:
        """Seconds of one training step under this plan, as timed (``None``: not timed)."""
        return self.step_times.get("plan")

    def to_json(self, indent: int | None = 2) -> str:
        """The plan as JSON (``Plan.from_json`` reads it back)."""
        from mixprec.autotune.plan_json import plan_to_json

        return plan_to_json(self, indent)

    @classmethod
    def from_json(cls, text: str) -> Plan:
        """A plan from ``to_json``'s text; every field is checked (``ArgumentError``)."""
        from mixprec.autotune.plan_json import plan_from_json

        return plan_from_json(text)

    def save(self, path: str | os.PathLike[str]) -> Path:
        """Write ``to_json()`` to ``path`` (atomically: a failed write leaves the previous
        plan); returns the path."""
        return write_text_atomically(path, self.to_json() + "\n")

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> Plan:
        """The plan saved at ``path``."""
        from mixprec.autotune.plan_json import plan_from_json

        return plan_from_json(Path(path).read_text(encoding="utf-8"), where=str(path))

    def __str__(self) -> str:
        return table(self)


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1e3:.3g}"


def _err(value: float | None) -> str:
    if value is None:
        return "-"
    return "inf" if math.isinf(value) else f"{value:.1e}"


def table(plan: Plan) -> str:
    """The plan as a table: layer, type, chosen dtype, time (ms) and error per candidate,
    float16 headroom, why; then the step times, the left-out candidates and the check."""
    candidates = [d for d in PLAN_DTYPES if any(d in r.times or d in r.errors for r in plan.layers)]
    header = ["layer", "type", "dtype"]
    half = [d for d in candidates if d != "float32"]  # float32's error is 0 by definition
    header += [f"ms {SHORT[d]}" for d in candidates] + [f"err {SHORT[d]}" for d in half]
    header += ["f16 range", "why"]
    rows = [header]
    for r in plan.layers:
        row = [r.name, r.kind or "-", r.dtype]
        row += [_ms(r.times.get(d)) for d in candidates]
        row += [_err(r.errors.get(d)) for d in half]
        row += ["-" if r.headroom is None else percent(r.headroom), r.why]
        rows.append(row)
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
    lines = [
        "  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip() for row in rows
    ]
    lines.insert(1, "  ".join("-" * w for w in widths))
    budget = "" if plan.error_budget is None else f", error budget {plan.error_budget:g}"
    on = f" on {plan.machine}" if plan.machine else ""
    lines.insert(0, f"plan: level {plan.level}{budget}{on}")
    if plan.step_times:
        times = ", ".join(f"{k} {_ms(v)} ms" for k, v in plan.step_times.items())
        lines.append(f"step times: {times}")
    for dtype, reason in plan.left_out.items():
        lines.append(f"left out: {dtype}: {reason}")
    if plan.check is not None:
        c = plan.check
        verdict = "passed" if c.passed else "failed"
        moved = f"; sent to float32: {', '.join(c.sent_to_float32)}" if c.sent_to_float32 else ""
        if c.level_from:
            moved = f"; level {c.level_from} -> {plan.level} (float32 master weights){moved}"
        lines.append(
            f"training check: {verdict}: {c.steps} steps beside float32, loss differs by at "
            f"most {_err(c.max_difference)} (budget {c.budget:g}){moved}"
        )
    return "\n".join(lines)
