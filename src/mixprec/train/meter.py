"""``EpochMeter``: the sums behind an epoch's logs (loss, metrics, samples, skipped steps,
step times), kept across a resume so that a resumed epoch's logs cover all of it."""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

from mixprec import distributed
from mixprec.optim import StepResult
from mixprec.train.callbacks import Logs
from mixprec.train.metrics import Metric
from mixprec.train.warn import warn

_SUM_DTYPE, F32 = torch.float64, torch.float32

__all__ = ["EpochMeter"]


def _first_tensor(targets: Any) -> Any:
    """``(y, w)`` or ``(y, w, mask)`` targets (sample weights a loss reads) as ``y``,
    counted by its rows, not 2 a batch: two or three tensors of one length of at least 2
    that is not their count. Anything else as it is: a list of one item per sample
    (detection dicts, CTC sequences, one tensor each) counts its items."""
    if isinstance(targets, (list, tuple)) and len(targets) in (2, 3):
        rows = {len(t) for t in targets if isinstance(t, torch.Tensor) and t.dim() > 0}
        if len(rows) == 1 and all(isinstance(t, torch.Tensor) for t in targets):
            (n,) = rows
            if n >= 2 and n != len(targets):
                return targets[0]
    return targets


class EpochMeter:
    """The sums behind an epoch's logs: loss, metrics, samples, skipped steps, step times."""

    def __init__(
        self, metrics: dict[str, Metric], weigh: Callable[[torch.Tensor], int] = len
    ) -> None:
        self.metrics = metrics
        # A step's weight in the means: its samples, or its kept labels (metrics.counted).
        self.weigh = weigh
        self.loss_sum, self.samples, self.skipped = 0.0, 0, 0
        self.counted = 0  # samples in the means: those of steps with a finite loss
        # Metric sums stay device tensors: reading them per batch would add host syncs to
        # the step; they are read once, at the end of the epoch (or at a checkpoint).
        self.metric_sums: dict[str, torch.Tensor | float] = dict.fromkeys(metrics, 0.0)
        self.times: list[float] = []
        self.group_time = 0.0  # the accumulation micro-steps' so far
        self.start = time.perf_counter()
        # Under torchrun, every rank's sums as of the last step: what a checkpoint holds.
        self.synced: dict[str, Any] | None = None

    def add(
        self,
        result: StepResult,
        loss: float,
        elapsed: float,
        output: torch.Tensor | None,
        targets: torch.Tensor,
    ) -> None:
        """Count one step: its loss and metrics weighted by its samples (``weigh``), and
        its time (with accumulation, an optimizer step's is the time of its group's
        micro-steps)."""
        self.synced = None
        labels = _first_tensor(targets)
        self.samples += len(labels)
        self.group_time += elapsed  # a step's time is its group's micro-steps' together
        if not result.accumulating:
            self.times.append(self.group_time)
            self.group_time = 0.0
        self.skipped += int(result.found_inf)
        if not math.isfinite(loss):
            # A forward that overflowed in 16 bits: its step was skipped (skipped_steps),
            # and its NaN would make the epoch's loss (and what monitors it) NaN.
            return
        size = self.weigh(labels)
        self.loss_sum += loss * size
        self.counted += size
        if output is not None:
            with torch.no_grad():
                for name, fn in self.metrics.items():
                    # In float64 (float32 on MPS, which has none): a metric returned in
                    # 16 bits and summed over an epoch in 16 bits drifted (0.926 logged for
                    # 0.821), and float32 sums drift over long epochs. No host read.
                    value = fn(output.float(), targets)
                    if isinstance(value, torch.Tensor):
                        value = value.to(_SUM_DTYPE if value.device.type != "mps" else F32)
                    self.metric_sums[name] = self.metric_sums[name] + value * size

    def snapshot(self) -> tuple[Any, ...]:
        """The sums as they are now, for ``restore`` (no host read: the metric sums are
        replaced, not written, by ``add``)."""
        return (self.loss_sum, self.samples, self.counted, self.skipped,
                dict(self.metric_sums), len(self.times), self.group_time)  # fmt: skip

    def restore(self, snapshot: tuple[Any, ...]) -> None:
        """Back to ``snapshot``: an accumulation group dropped whole (``interrupts``)."""
        self.loss_sum, self.samples, self.counted, self.skipped, sums, times, group = snapshot
        self.metric_sums, self.group_time, self.synced = dict(sums), group, None
        del self.times[times:]

    def sync(self) -> None:
        """Sum the loss, sample and metric sums over every rank, for a checkpoint taken
        after this step (a collective: every rank calls it at the same step). Rank 0
        writes it; without it, a resume gave every rank rank 0's share of the epoch so far.
        Skipped steps and times are every rank's alike and stay as they are."""
        state = self.state_dict()
        loss_sum, samples, counted, metric_sums = self._global_sums()
        state.update(loss_sum=loss_sum, samples=samples, counted=counted)
        state["metric_sums"], state["ranks"] = metric_sums, distributed.world_size()
        self.synced = state

    def _global_sums(self) -> tuple[float, int, int, dict[str, float]]:
        """Loss, samples, counted samples and metric sums over every rank (one collective)."""
        sums = distributed.all_reduce_sum(
            [self.loss_sum, self.samples, self.counted, *map(float, self.metric_sums.values())]
        )
        metric_sums = dict(zip(self.metric_sums, sums[3:], strict=True))
        return sums[0], int(sums[1]), int(sums[2]), metric_sums

    def state_dict(self) -> dict[str, Any]:
        """The sums so far (for a checkpoint taken mid-epoch), as Python numbers: every
        rank's (``ranks``) where ``sync`` ran after the last step, else this rank's."""
        if self.synced is not None:
            return dict(self.synced)
        return {
            "loss_sum": self.loss_sum,
            "samples": self.samples,
            "skipped": self.skipped,
            "metric_sums": {name: float(v) for name, v in self.metric_sums.items()},
            "seconds": time.perf_counter() - self.start,
            "counted": self.counted,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Go on from a checkpoint's sums; metrics it did not have start at 0. Sums of every
        rank (``ranks``) go to rank 0 alone, as the epoch's logs add the ranks' up."""
        self.skipped = int(state["skipped"])
        self.start = time.perf_counter() - float(state["seconds"])
        if state.get("ranks", 1) > 1 and distributed.rank() != 0:
            return
        if state.get("ranks", 1) == 1 and distributed.world_size() > 1:
            warn(
                "resumed mid-epoch under torchrun from a checkpoint with one rank's sums "
                "(saved outside ModelCheckpoint(every_n_steps=...)): this epoch's loss and "
                "metrics count rank 0's share of its first batches for every rank"
            )
        self.loss_sum, self.samples = float(state["loss_sum"]), int(state["samples"])
        self.counted = int(state.get("counted", self.samples))
        for name, value in state["metric_sums"].items():
            if name in self.metric_sums:
                self.metric_sums[name] = float(value)

    def logs(self, loss_scale: float) -> Logs:
        """The epoch's means over every rank's samples."""
        loss_sum, samples, counted_sum, metric_sums = self._global_sums()
        # Over every rank: after a resume from the epoch's last step, rank 0 alone holds
        # the epoch's sums, and the other ranks none.
        if samples == 0:
            raise ValueError("the training data produced no batches")
        counted = counted_sum or math.nan  # nan: every step's loss was non-finite
        total = time.perf_counter() - self.start
        return {
            "loss": loss_sum / counted,
            **{name: value / counted for name, value in metric_sums.items()},
            "ms_per_step": 1000 * statistics.median(self.times) if self.times else float("nan"),
            "samples_per_s": samples / total,
            "loss_scale": loss_scale,
            "skipped_steps": self.skipped,
        }
