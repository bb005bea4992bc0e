"""A learning-rate schedule that moved over a skipped step.

torch's habit is ``optimizer.step(); scheduler.step()`` every batch. Over a
``LossScaleOptimizer`` a skipped step (inf/NaN gradients: the first steps of float16
training while the scale settles from 65536) then advances the schedule all the same: a
warmup's first applied update ran at 4.0e-4, its ninth value, not 5.0e-5. torch's
GradScaler leaves its own trace (its skipped step never calls ``optimizer.step``, so
torch warns at the scheduler's first step); here nothing was said.

After a skip decided on the host, the learning rates are noted; a change seen at the next
``step()`` after each of two skipped steps in a row is said, once: a schedule stepped every
batch moves at each, while one stepped every epoch (``StepLR``, ``ReduceLROnPlateau``, the
Trainer's ``interval="epoch"``) moves at most once over such a run, when an epoch's last
step happened to skip, and is right to. Schedules that step only on applied steps (``if
opt.step(): scheduler.step()``, the Trainer's, the Hugging Face and Lightning
integrations') change nothing over a skip. Costs a flag check but after a skip.
"""

from __future__ import annotations

from typing import Any

import torch

from mixprec._warn import warn_at_caller

__all__ = ["note_rates_at_skip", "say_if_rates_moved"]


def _rates(optimizers: list[torch.optim.Optimizer]) -> list[Any] | None:
    rates = [group.get("lr") for inner in optimizers for group in inner.param_groups]
    # A tensor rate (capturable, compiled steps) is left alone: reading it is a host sync.
    return rates if all(isinstance(r, float | int) for r in rates) else None


def note_rates_at_skip(book: Any, optimizers: list[torch.optim.Optimizer]) -> None:
    if not book.said_rates:
        book.rates_at_skip = _rates(optimizers)


def say_if_rates_moved(book: Any, optimizers: list[torch.optim.Optimizer]) -> None:
    """At the ``step()`` after a skipped one: say, once, if the learning rates changed
    after this skip and the one before it."""
    if book.rates_at_skip is None:  # the last step applied: a run of skips ends
        book.rate_moved = None
        return
    before, book.rates_at_skip = book.rates_at_skip, None
    now = _rates(optimizers)
    # Groups added since (an unfreezing) make the two incomparable: nothing said.
    if before is None or now is None or len(now) != len(before) or now == before:
        book.rate_moved = None
        return
    changed = next(i for i, (a, b) in enumerate(zip(before, now, strict=True)) if a != b)
    first, book.rate_moved = book.rate_moved, (changed, before[changed], now[changed])
    if first is None or book.said_rates:  # once may be an epoch's end: a per-epoch schedule
        return
    book.said_rates = True
    group, was, became = first
    warn_at_caller(
        f"the learning rate changed after each of 2 skipped steps in a row (param group "
        f"{group}: {was:.3g} -> {became:.3g} -> {now[group]:.3g}): a scheduler stepped "
        "every batch advances over steps that applied nothing (inf/NaN gradients; the "
        "first steps of float16 training skip while the loss scale settles), so a warmup "
        "runs ahead of the updates. Step it only when the step was applied: if "
        "opt.step(): scheduler.step() (a rate you set by hand: nothing to do)"
    )
