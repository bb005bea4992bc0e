"""``EpochMeter``: the sums behind an epoch's logs (loss, metrics, samples, skipped steps,
step times), kept across a resume so that a resumed epoch's logs cover all of it."""

from __future__ import annotations

import math
import statistics
import time
from typing import Any

import torch

from mixprec import distributed
from mixprec.optim import StepResult
from mixprec.train.callbacks import Logs
from mixprec.train.metrics import Metric

__all__ = ["EpochMeter"]


class EpochMeter:
    """The sums behind an epoch's logs: loss, metrics, samples, skipped steps, step times."""

    def __init__(self, metrics: dict[str, Metric]) -> None:
        self.metrics = metrics
        self.loss_sum, self.samples, self.skipped = 0.0, 0, 0
        self.counted = 0  # samples in the means: those of steps with a finite loss
        # Metric sums stay device tensors: reading them per batch would add host syncs to
        # the step; they are read once, at the end of the epoch (or at a checkpoint).
        self.metric_sums: dict[str, torch.Tensor | float] = dict.fromkeys(metrics, 0.0)
        self.times: list[float] = []
        self.start = time.perf_counter()

    def add(
        self,
        result: StepResult,
        loss: float,
        elapsed: float,
        output: torch.Tensor | None,
        targets: torch.Tensor,
    ) -> None:
        """Count one step: its loss and metrics weighted by its samples, and its time
        (an accumulation micro-step's is not a step's time)."""
        size = len(targets)
        self.samples += size
        if not result.accumulating:
            self.times.append(elapsed)
        self.skipped += int(result.found_inf)
        if not math.isfinite(loss):
            # A forward that overflowed in 16 bits: its step was skipped (skipped_steps),
            # and its NaN would make the epoch's loss (and what monitors it) NaN.
            return
        self.loss_sum += loss * size
        self.counted += size
        if output is not None:
            with torch.no_grad():
                for name, fn in self.metrics.items():
                    self.metric_sums[name] = (
                        self.metric_sums[name] + fn(output.float(), targets) * size
                    )

    def state_dict(self) -> dict[str, Any]:
        """The sums so far (for a checkpoint taken mid-epoch), as Python numbers."""
        return {
            "loss_sum": self.loss_sum,
            "samples": self.samples,
            "skipped": self.skipped,
            "metric_sums": {name: float(v) for name, v in self.metric_sums.items()},
            "seconds": time.perf_counter() - self.start,
            "counted": self.counted,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Go on from a checkpoint's sums; metrics it did not have start at 0."""
        self.loss_sum, self.samples = float(state["loss_sum"]), int(state["samples"])
        self.skipped = int(state["skipped"])
        self.counted = int(state.get("counted", self.samples))
        for name, value in state["metric_sums"].items():
            if name in self.metric_sums:
                self.metric_sums[name] = float(value)
        self.start = time.perf_counter() - float(state["seconds"])

    def logs(self, loss_scale: float) -> Logs:
        """The epoch's means over every rank's samples."""
        if self.samples == 0:
            raise ValueError("the training data produced no batches")
        sums = distributed.all_reduce_sum(
            [
                self.loss_sum,
                self.samples,
                self.counted,
                *(float(v) for v in self.metric_sums.values()),
            ]
        )
        loss_sum, samples = sums[0], int(sums[1])
        counted = int(sums[2]) or math.nan  # nan: every step's loss was non-finite
        metric_sums = dict(zip(self.metric_sums, sums[3:], strict=True))
        total = time.perf_counter() - self.start
        return {
            "loss": loss_sum / counted,
            **{name: value / counted for name, value in metric_sums.items()},
            "ms_per_step": 1000 * statistics.median(self.times) if self.times else float("nan"),
            "samples_per_s": samples / total,
            "loss_scale": loss_scale,
            "skipped_steps": self.skipped,
        }
