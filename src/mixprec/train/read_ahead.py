"""With accumulation, the Trainer reads one batch ahead (``ReadAhead``), to apply an epoch's
last, shorter group at its last batch. The batch read ahead may draw from torch's global
generator (a dataset adding noise in the main process) before the step in hand does; a
checkpoint taken then holds the generator after those draws. So the reader keeps the
state from before that read (``before_next``), which a checkpoint stores beside its own,
and a resumed epoch reads that batch again under it (``first_read_under``): the batch and
every draw after it are the uninterrupted run's."""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Iterator
from typing import Any

import torch

__all__ = ["ReadAhead", "first_read_under"]


class ReadAhead:
    """Each batch of ``data`` with whether it is the last non-empty one (read one batch
    ahead, and past empty ones), so that an accumulation group can be applied there.
    ``before_next``: torch's generator state from before the batch after the one given
    last was read, where it was read already (``None`` where it was not)."""

    def __init__(self, data: Iterable[Any], is_empty: Any) -> None:
        self._data, self._is_empty = data, is_empty
        self.before_next: torch.Tensor | None = None

    def __iter__(self) -> Iterator[tuple[Any, bool]]:
        # Read, not given yet: the held non-empty batch first, the empty ones after it.
        read: deque[tuple[Any, torch.Tensor]] = deque()
        it = iter(self._data)
        while True:
            before = torch.get_rng_state()
            batch: Any = next(it, _END)
            if batch is _END:
                break
            read.append((batch, before))
            if self._is_empty(batch[1]):
                if len(read) == 1:  # no non-empty batch held: given at once
                    yield from self._give(read, 1)
                continue
            # A non-empty batch: the one held before it, and the empty ones after that,
            # are not the last.
            yield from self._give(read, len(read) - 1)
        if read:
            yield from self._give(read, 1, last=True)
            yield from self._give(read, len(read))

    def _give(
        self, read: deque[tuple[Any, torch.Tensor]], count: int, last: bool = False
    ) -> Iterator[tuple[Any, bool]]:
        """The first ``count`` of ``read``, each with ``last``."""
        for _ in range(count):
            batch, _ = read.popleft()
            self.before_next = read[0][1] if read else None
            yield batch, last


_END = object()


def first_read_under(data: Iterator[Any], state: torch.Tensor | None) -> Iterator[Any]:
    """``data``, its first batch read under generator ``state`` (a checkpoint's
    ``before_next``) and the generator then put back as it was: the resumed run reads
    that batch as the run it resumes did, and draws on from the checkpoint's state."""
    if state is None:
        yield from data
        return
    now = torch.get_rng_state()
    torch.set_rng_state(state)
    try:
        first = next(data, _END)
    finally:
        torch.set_rng_state(now)
    if first is not _END:
        yield first
        yield from data
