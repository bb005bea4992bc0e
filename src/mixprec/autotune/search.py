"""The search: from the fastest uniform plan, layers whose own error is over the budget, or
whose values come within float16's headroom, go to float32; then single-layer flips that the
per-layer times promise to be faster are tried, and kept only when a whole step is measured
faster; a plan that still times slower than float32 (twice) is float32.

Whole steps decide, per-layer times only order the tries: the casts at dtype boundaries and
what fuses change the sum (a float32 layer between two bfloat16 ones adds two casts).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from torch import nn

from mixprec.autotune.measure import LayerData
from mixprec.autotune.steps import OptimizerFactory, make_step
from mixprec.autotune.units import Timer, float8_ready
from mixprec.doctor.headroom import HEADROOM, headroom_text, percent

__all__ = ["Search", "inadmissible"]

#: A flip is kept only when the whole step gets this much faster: the noise of the best of
#: a few steps on a shared machine.
NOISE = 0.03

#: Levels tried for each candidate's uniform plan: float16 has no O3 (pure float16 training
#: without float32 master weights loses small updates); float8 layers keep float32 weights
#: at O1 and O2 alike, so O2 alone.
LEVELS_OF = {"bfloat16": ("O1", "O2", "O3"), "float16": ("O1", "O2"), "float8": ("O2",)}


def inadmissible(data: LayerData, dtype: str, budget: float) -> str | None:
    """Why ``dtype`` breaks the budget for this layer, or ``None`` when it does not."""
    if dtype == "float32":
        return None
    if dtype == "float8" and not float8_ready(data.module):
        return "float8 needs an nn.Linear with in/out features multiples of 16"
    if dtype == "float16" and data.headroom > HEADROOM:
        return (
            f"float16 range: values reach {percent(data.headroom)} of its max, inside the "
            f"headroom ({headroom_text(HEADROOM)})"
        )
    err = data.errors.get(dtype)
    if err is None:
        return f"{dtype} not measured within the time budget"
    if err > budget:
        return f"{dtype} error {err:.1e} > budget {budget:g}"
    return None


@dataclass
class Search:
    """One search's inputs and what it decides (``dtypes``, ``level``, ``why``,
    ``step_times``)."""

    model: nn.Module
    batch: tuple[Any, Any]
    loss_fn: Callable[[Any, Any], Any]
    optimizer: OptimizerFactory
    compile_options: dict[str, Any] | None
    timer: Timer
    deadline: float
    layers: dict[str, LayerData]
    kept: list[str]
    budget: float
    progress: Callable[[str], None] = lambda text: None
    dtypes: dict[str, str] = field(default_factory=dict)
    level: str = "O2"
    why: dict[str, str] = field(default_factory=dict)
    step_times: dict[str, float] = field(default_factory=dict)

    def left(self) -> bool:
        return time.monotonic() < self.deadline

    def time_step(self, dtypes: dict[str, str], level: str, label: str) -> float:
        self.progress(f"timing {label}")
        step = make_step(
            self.model, dtypes, level, self.batch, self.loss_fn, self.optimizer,
            self.compile_options,
        )  # fmt: skip
        seconds = self.timer.step(dtypes, level, step)
        return seconds

    def uniform(self, dtype: str) -> dict[str, str]:
        """Every layer in ``dtype``; float8 where a layer can take it, else bfloat16 (or
        float32 without it), as ``mixed_float8`` converts."""
        if dtype != "float8":
            return dict.fromkeys(self.layers, dtype)
        rest = "bfloat16" if "bfloat16" in self.kept else "float32"
        return {n: "float8" if "float8" in d.errors else rest for n, d in self.layers.items()}

    def run(self) -> None:
        """The search (see the module docstring); ends by the deadline."""
        self.dtypes = self.uniform("float32")
        if self.budget == 0:
            self.why = dict.fromkeys(self.layers, "error budget 0: float32 only")
            self.step_times["plan"] = self.time_step(self.dtypes, "O0", "float32")
            return
        times = {("float32", "O0"): self.time_step(self.dtypes, "O0", "float32")}
        self.step_times["float32"] = times["float32", "O0"]
        for dtype in self.kept[1:]:
            for level in LEVELS_OF[dtype]:
                if self.left():
                    label = f"{dtype} {level}"
                    times[dtype, level] = self.time_step(self.uniform(dtype), level, label)
                    self.step_times[label] = times[dtype, level]
        (best, level), fastest = min(times.items(), key=lambda kv: kv[1])
        self.level = "O2" if best == "float32" else level
        self.dtypes = self.uniform(best)
        label = "float32" if best == "float32" else f"{best} {level}"
        self.why = {
            n: f"fastest uniform plan ({label})"
            if d.errors
            else "not measured within the time budget"
            for n, d in self.layers.items()
        }
        self._fix_violations()
        changed = self.dtypes != self.uniform(best)  # then the plan needs a timing of its own
        current = self.time_step(self.dtypes, self.level, "the plan") if changed else fastest
        current = self._flips(current)
        self._fix_violations()
        self.step_times["plan"] = self._no_slower_than_float32(current)

    def _no_slower_than_float32(self, current: float) -> float:
        """The plan, or float32 where the plan timed slower than float32 twice (a plan
        with layers sent to float32 adds casts that a uniform plan does not have)."""
        base = self.step_times["float32"]
        if all(d == "float32" for d in self.dtypes.values()) or current <= base * (1 + NOISE):
            return current
        again = self.time_step(self.dtypes, self.level, "the plan, again")
        base = self.time_step(self.uniform("float32"), "O0", "float32, again")
        if again <= base * (1 + NOISE):
            return again
        why = (
            f"the plan timed slower than float32 ({again * 1e3:.3g} ms against {base * 1e3:.3g} ms)"
        )
        self.dtypes, self.why = self.uniform("float32"), dict.fromkeys(self.layers, why)
        return base

    def _fix_violations(self) -> None:
        """Layers whose own error or range breaks the budget go to float32."""
        for name, data in self.layers.items():
            reason = inadmissible(data, self.dtypes[name], self.budget)
            if reason is not None:
                self.dtypes[name], self.why[name] = "float32", reason

    def _flips(self, current: float) -> float:
        """Try single-layer flips in the order of the per-layer time they promise to save;
        keep those that make the whole step faster by more than ``NOISE``."""
        tries = []
        for name, data in self.layers.items():
            now = data.times.get(self.dtypes[name])
            for alt in self.kept:
                if alt == self.dtypes[name] or alt not in data.times or now is None:
                    continue
                if inadmissible(data, alt, self.budget) is None and data.times[alt] < now:
                    tries.append((now - data.times[alt], name, alt))
        for _, name, alt in sorted(tries, reverse=True):
            if not self.left():
                break
            was = self.dtypes[name]
            if was == alt:
                continue
            self.dtypes[name] = alt
            seconds = self.time_step(self.dtypes, self.level, f"{name} in {alt}")
            if seconds < current * (1 - NOISE):
                gain = 100 * (1 - seconds / current)
                self.why[name] = f"{alt}: step {gain:.0f}% faster than with {was} (measured)"
                current = seconds
            else:
                self.dtypes[name] = was
        return current
