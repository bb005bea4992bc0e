"""The training check: the plan trains beside float32 from the same initial weights on the same
batch (with the same random draws), and passes when its loss at the end (the mean of the
last quarter of the steps) is within the error budget of float32's, relatively. When it is
not, a plan at O3 goes to O2 first (float32 master weights), then the 16-bit layer with the
largest error of its own goes to float32, and the plan trains again, until it passes (the
all-float32 plan is float32 itself)."""

from __future__ import annotations

import math
import time

import torch

from mixprec.autotune.plan import TrainingCheck
from mixprec.autotune.search import Search
from mixprec.autotune.steps import make_step

__all__ = ["MIN_STEPS", "curve", "difference", "training_check"]

#: The fewest steps a check trains: the second's loss is the first after an update.
MIN_STEPS = 2


def curve(search: Search, dtypes: dict[str, str], level: str, steps: int) -> list[float]:
    """The losses of ``steps`` training steps under a plan, from the model's weights, with
    the random draws every curve gets (seed 0, the caller's generators restored)."""
    step = make_step(
        search.model, dtypes, level, search.batch, search.loss_fn, search.optimizer,
        search.compile_options,
    )  # fmt: skip
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return [step() for _ in range(steps)]


def difference(losses: list[float], reference: list[float]) -> float:
    """How far a loss curve ends from the reference: the relative difference of their mean
    over the last quarter of the steps (at least one); inf where a loss is not finite. The
    end, not each step: a float16 plan's loss scaler skips its first steps while it finds
    its scale, a lag of a few steps that the curves make up."""
    if not all(math.isfinite(v) for v in losses):
        return math.inf
    tail = max(1, len(losses) // 4)
    got, ref = sum(losses[-tail:]) / tail, sum(reference[-tail:]) / tail
    return abs(got - ref) / max(abs(ref), 1e-12)


def training_check(search: Search, steps: int, deadline: float) -> TrainingCheck:
    """Run the check (see the module docstring) on ``search``'s plan, changing its
    ``dtypes`` and ``why`` for the layers it sends to float32. Fewer than ``steps`` steps
    (``MIN_STEPS`` at least) run when a float32 step times the steps over ``deadline``;
    the check says how many."""
    start = time.monotonic()
    curve(search, search.uniform("float32"), "O0", 1)  # a step's time, compiled or not
    per_step = max(time.monotonic() - start, 1e-6)
    # Two curves of n steps each, at least one more try: what the deadline leaves. Two
    # steps at least, past an overrun deadline too: one step's loss comes before any
    # update, so a check of one could not fail for training's sake.
    room = (deadline - time.monotonic()) / (3 * per_step)
    n = max(MIN_STEPS, min(steps, int(room)))
    reference = curve(search, search.uniform("float32"), "O0", n)
    moved: list[str] = []
    level_from = None
    while True:
        half = [name for name, d in search.dtypes.items() if d != "float32"]
        if not half:  # the float32 plan is the reference: trained once, not twice
            return TrainingCheck(n, search.budget, 0.0, True, tuple(moved), level_from)
        search.progress(f"training check: {n} steps")
        losses = curve(search, search.dtypes, search.level, n)
        diff = difference(losses, reference)
        if diff <= search.budget:
            return TrainingCheck(n, search.budget, diff, True, tuple(moved), level_from)
        if time.monotonic() > deadline:
            return TrainingCheck(n, search.budget, diff, False, tuple(moved), level_from)
        if search.level == "O3":
            # O3 trains without float32 master weights: small updates round away in 16-bit
            # weights whatever the layer, so O2 (masters) is tried before any layer moves.
            level_from, search.level = "O3", "O2"
            continue
        name = max(half, key=lambda h: search.layers[h].errors.get(search.dtypes[h], 0.0))
        was = search.dtypes[name]
        search.dtypes[name] = "float32"
        search.why[name] = (
            f"{was} failed the training check: loss {diff:.1e} from float32's > budget "
            f"{search.budget:g} (the largest error of its own)"
        )
        moved.append(name)
