"""What an interrupted batch leaves for a resume: a batch is done once its step has
returned *and* its bookkeeping ran, or not at all.

Two windows let a state saved after Ctrl-C (``save_checkpoint(...,
trainer_state=trainer.resume_state())``) disagree with the weights:
- between a step's return and the end of its ``on_train_batch_end`` (where a GPU run waits
  in ``loss.item()``, so where Ctrl-C usually lands): the batch counted as done, its applied
  step not counted in ``global_step`` and its scheduler step not taken (a resumed run 1 step
  behind, its learning rate and weights off). ``HeldInterrupt`` holds SIGINT over that
  window and raises it after, as a second Ctrl-C at once does;
- a micro-batch that raised in an accumulation group: ``LossScaleOptimizer.backward`` drops
  the whole group, but the batches before it counted as done, so a resume skipped them.
  ``GroupStart`` notes where each group begins and rewinds to it.
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Callable
from types import FrameType
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from mixprec.optim import LossScaleOptimizer
    from mixprec.train.meter import EpochMeter

__all__ = ["GroupStart", "HeldInterrupt"]


class HeldInterrupt:
    """SIGINT held while ``holding`` (the main thread's default handler only: one of the
    user's own, or a thread other than the main one, is left alone)."""

    def __init__(self) -> None:
        self.holding = False
        self.pending = False
        self._previous: Any = None  # the handler replaced, while installed

    def install(self) -> None:
        if (
            threading.current_thread() is threading.main_thread()
            and signal.getsignal(signal.SIGINT) is signal.default_int_handler
        ):
            self._previous = signal.signal(signal.SIGINT, self._handler)

    def uninstall(self) -> None:
        """Put the handler back (unless one of the user's replaced it since: theirs stays);
        a Ctrl-C held when an error ended the window is dropped (the error goes on)."""
        self.holding = self.pending = False
        if self._previous is not None:
            if signal.getsignal(signal.SIGINT) == self._handler:
                signal.signal(signal.SIGINT, self._previous)
            self._previous = None

    def _handler(self, signum: int, frame: FrameType | None) -> None:
        if self.holding and not self.pending:
            self.pending = True  # raised once the batch's bookkeeping is done
            return
        signal.default_int_handler(signum, frame)  # a second Ctrl-C does not wait

    def hold(self) -> None:
        self.holding = True

    def release(self, before_raising: Callable[..., None] | None = None, *args: Any) -> None:
        """End the window; a Ctrl-C that came during it is raised now, after
        ``before_raising(*args)`` (an accumulation group left half taken is rewound)."""
        self.holding = False
        if self.pending:
            self.pending = False
            if before_raising is not None:
                before_raising(*args)
            raise KeyboardInterrupt


class GroupStart:
    """Where the current accumulation group began: its first batch's index in the epoch
    and the epoch's sums before it (``EpochMeter.snapshot``)."""

    def __init__(self, optimizer: LossScaleOptimizer) -> None:
        self.optimizer = optimizer
        self.step = 0
        self.sums: Any = None

    def note(self, step: int, meter: EpochMeter) -> None:
        """Before a batch's step: a new group starts here where none is pending (nothing
        to note without accumulation)."""
        if self.optimizer.accumulation_steps > 1 and self.optimizer.pending_micro_steps == 0:
            self.step, self.sums = step, meter.snapshot()

    def rewind_pending(self, trainer: Any, step: int, meter: EpochMeter) -> None:
        """Ctrl-C held over batch ``step``'s bookkeeping, raised after it: a group that
        batch left half taken goes whole, and ``trainer`` resumes at its first batch (else
        the state could not be saved: a group half taken)."""
        if self.optimizer.pending_micro_steps:
            trainer._step_in_epoch = self.rewind(step + 1, meter)

    def rewind(self, step: int, meter: EpochMeter) -> int:
        """After the batch ``step`` raised: the group is dropped whole, and the batch to go
        on from (``step_in_epoch``) is its first, the epoch's sums as they were before it."""
        if self.optimizer.accumulation_steps == 1:
            return step  # the batch alone: its backward dropped what it added
        self.optimizer.drop_gradients()
        if self.step < step and self.sums is not None:
            meter.restore(self.sums)
            return self.step
        return step
