"""Where a resumed ``fit`` starts, and what it restores besides the weights, the optimizer
and the RNG: the epoch's batch order, the epoch's sums so far (``EpochMeter``) and the
callbacks' state (``Callback.state_dict``). Under torchrun, each rank's own RNG state
(``RankRng``), where the ranks' states differ.

A checkpoint says whether its epoch had ended (``epoch_done``): one saved on an epoch's
last batch, before the epoch's end ran, resumes into that end (validation, ``on_epoch_end``)
rather than past it, also for a loader whose length is unknown.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from mixprec import distributed
from mixprec.checkpoint import CheckpointError, load_checkpoint, rng_state
from mixprec.train.callbacks import Callback
from mixprec.train.warn import warn

__all__ = [
    "RankRng",
    "ResumePoint",
    "callback_states",
    "check_ranks_resumed_alike",
    "data_shape",
    "keyed",
    "read",
    "replay_epoch",
    "restore_callbacks",
]


@dataclass
class ResumePoint:
    """Where to go on: ``epoch``, the batches of it already done (``skip``), the RNG state
    its order was drawn from (``replay``; ``None``: start ``epoch`` afresh), its sums so far
    (``meter``) and the callbacks' states by key (``keyed``)."""

    global_step: int
    epoch: int
    skip: int = 0
    replay: torch.Tensor | None = None
    meter: dict[str, Any] | None = None
    callbacks: dict[str, Any] = field(default_factory=dict)
    ahead: torch.Tensor | None = None  # the RNG state from before the batch read ahead


def data_shape(x: Any, y: Any, batch_size: int, shuffle: bool, steps: int) -> dict[str, Any]:
    """What a checkpoint's ``step_in_epoch`` counts: batches per epoch (``steps``, 0 where a
    loader has no length) and, for tensors or arrays, the samples, the batch size and
    whether they are shuffled (a loader's own are not known)."""
    if y is None:
        return {"batches": steps}
    return {"batches": steps, "samples": len(x), "batch_size": batch_size, "shuffle": shuffle}


def check_ranks_resumed_alike(point: ResumePoint, model: nn.Module) -> None:
    """Under torchrun, after every rank loaded its checkpoint: the same position and the
    same weights on each (one collective). Ranks given different checkpoints hung in DDP's
    all-reduce, or, at one position, trained on from different weights without a word (DDP
    broadcast the weights when it wrapped the model, before this load)."""
    if distributed.world_size() == 1:
        return
    with torch.no_grad():
        total = sum(float(p.detach().sum(dtype=torch.float64)) for p in model.parameters())
    distributed.check_same_on_every_rank(
        "the checkpoints resumed",
        {
            "global_step": point.global_step,
            "epoch": point.epoch,
            "batches_done": point.skip,
            "weights_checksum": distributed.float_key(total),
        },
        "every rank must resume from the same checkpoint file (ModelCheckpoint writes one, "
        "from rank 0)",
    )


def read(
    path: str | os.PathLike[str],
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    data: dict[str, Any],
) -> ResumePoint:
    """Load a checkpoint into ``model`` and ``optimizer`` (RNG states too) and say where its
    run stood; ``data``: this fit's ``data_shape``, which a mid-epoch resume must match."""
    # The generators the ranks draw differently from now, before the load sets them: on
    # rank 0, which alone warns (None elsewhere and outside torchrun).
    size = distributed.world_size()
    now = distributed.gather_object(rng_state())  # [mine] outside torchrun: nothing differs
    state = load_checkpoint(
        path, model, optimizer, restore_rng=True, check=lambda s: _check_resumable(path, s, data)
    ).trainer_state
    ranks = state.get("rank_rng")
    own = isinstance(ranks, list) and len(ranks) == size > 1
    differ = _differing(now) if now else []
    if differ and not own:
        held = f"{len(ranks)} ranks' states" if isinstance(ranks, list) else "one state"
        masks = " (dropout masks)" if {"torch", "cuda"} & set(differ) else ""
        warn(
            f"resume: the ranks' {', '.join(differ)} random states differ, and {path} holds "
            f"{held} for {size} ranks now: every rank takes rank 0's, so they draw the same "
            f"random numbers{masks} from here. ModelCheckpoint's checkpoints hold every rank's"
        )
    global_step = int(state.get("global_step", 0))
    epoch, skip, replay, done = _stood(state, data["batches"])
    callbacks = dict(state.get("callbacks") or {})
    ahead = state.get("ahead_rng")
    if own and distributed.rank() > 0:  # this rank's own (a loader shuffling per rank)
        replay = ranks[distributed.rank()].get("epoch_order", replay)  # type: ignore[index]
        ahead = ranks[distributed.rank()].get("ahead_rng", ahead)  # type: ignore[index]
    if done:
        return ResumePoint(global_step, epoch + 1, callbacks=callbacks)
    if replay is None:
        return ResumePoint(global_step, epoch + (skip > 0), callbacks=callbacks)
    return ResumePoint(global_step, epoch, skip, replay, state.get("meter"), callbacks, ahead)


def _stood(state: dict[str, Any], steps: int) -> tuple[int, int, torch.Tensor | None, bool]:
    """Where a checkpoint's run stood: epoch, batches done in it, the RNG state its order
    was drawn from (``None``: none), and whether the epoch had ended."""
    epoch, skip = int(state["epoch"]), int(state.get("step_in_epoch", 0))
    replay = state.get("epoch_rng")
    done = state.get("epoch_done")
    if done is None:  # written before checkpoints said so: inferred from the counts
        done = replay is not None and bool(steps) and skip >= steps
    return epoch, skip, replay, bool(done)


def _check_resumable(
    path: str | os.PathLike[str], state: dict[str, Any], data: dict[str, Any]
) -> None:
    """Before the load changes anything: a training position to resume from, and for one
    mid-epoch, the epoch's shape it was counted in."""
    if "epoch" not in state:
        raise CheckpointError(
            f"fit(resume_from={os.fspath(path)!r}): the checkpoint holds no training position "
            f"(its trainer_state has {sorted(state) or 'nothing'}, no epoch): resumed, the run "
            "would start again at epoch 0. Resume from ModelCheckpoint's checkpoints or "
            "save_checkpoint(path, model, opt, trainer_state=trainer.resume_state()); to train "
            "on from these weights as a new run, load_checkpoint(path, model, opt) and call "
            "fit without resume_from (nothing was loaded)"
        )
    _, skip, replay, done = _stood(state, data["batches"])
    if not done and replay is not None:
        _check_same_epochs(path, state.get("data"), data, skip)


def _check_same_epochs(
    path: str | os.PathLike[str], saved: dict[str, Any] | None, now: dict[str, Any], skip: int
) -> None:
    """A mid-epoch resume skips the ``skip`` batches done: of another batch size, sample
    count or order, those are other samples, and some would train twice or never."""
    if not saved:  # written before checkpoints said so
        return
    differ = [f"{k} {saved[k]!r} then, {now.get(k)!r} now" for k in saved if saved[k] != now.get(k)]
    if differ:
        raise ValueError(
            f"fit(resume_from={os.fspath(path)!r}): the checkpoint stopped {skip} batches into "
            f"an epoch of other batches ({'; '.join(differ)}); skipping {skip} of these would "
            "train some samples twice and others never this epoch. Resume with the data, "
            "batch_size and shuffle it was written with"
        )


class RankRng:
    """Every rank's RNG states, and the state its epoch's order was drawn from, where rank 0
    may write a checkpoint next (an epoch's end, a step checkpoint's step, after the
    callbacks that write nothing ran), for ``resume_state``: a resume gives each rank its
    own back (``load_checkpoint``, ``read``). Held on rank 0 only where they differ (ranks
    seeded per rank; Python's and NumPy's generators, unless seeded, differ per process)."""

    def __init__(self) -> None:
        self._at: tuple[int, ...] | None = None
        self._states: list[dict[str, Any]] | None = None

    def gather(
        self, at: tuple[int, ...], epoch_order: torch.Tensor, ahead: torch.Tensor | None = None
    ) -> None:
        """At position ``at``: one collective on every rank, to rank 0; nothing outside
        torchrun. ``ahead``: the rank's state from before its batch read ahead."""
        if distributed.world_size() == 1:
            return
        mine = {**rng_state(), "epoch_order": epoch_order, "ahead_rng": ahead}
        states = distributed.gather_object(mine)
        self._at, self._states = at, None if not states or not _differing(states) else states

    def at(self, at: tuple[int, ...]) -> list[dict[str, Any]] | None:
        """The states gathered at ``at``; ``None`` where none were, or all are equal."""
        return self._states if self._at == at else None


def _differing(states: list[dict[str, Any]]) -> list[str]:
    """The generators (keys) whose states are not the same in every one of ``states``."""
    first = states[0]
    return [k for k in first if not all(_same(s.get(k), first[k]) for s in states[1:])]


def _same(a: Any, b: Any) -> bool:
    """Equal generator states (nested dicts, lists and tuples of tensors and numbers)."""
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return isinstance(b, (list, tuple)) and len(a) == len(b) and all(map(_same, a, b))
    return bool(a == b)


def _step_cadences(callbacks: dict[str, Callback]) -> list[int]:
    """The ``every_n_steps`` of the callbacks that write checkpoints by steps
    (``ModelCheckpoint``; read by attribute, so that this module need not import it)."""
    return sorted(
        n
        for cb in callbacks.values()
        if isinstance(n := getattr(cb, "every_n_steps", None), int) and n
    )


def ranks_sync_sums(callbacks: dict[str, Callback]) -> list[int]:
    """The step cadences of this fit's step checkpoints, before which the ranks sum their
    epoch sums (one collective at the start of ``fit``, on every rank); empty outside
    torchrun, and where the ranks' ``ModelCheckpoint(every_n_steps=...)`` differ (rank 0
    alone writes; the others keep it in ``callbacks``), since a sum on one rank alone would
    hang. A checkpoint passed to rank 0 alone then holds rank 0's sums, which a resume
    warns about."""
    cadences = _step_cadences(callbacks)
    if distributed.world_size() == 1:
        return []
    agreed = distributed.same_on_every_rank(cadences)
    if not agreed and distributed.is_main_process():
        warn(
            "ModelCheckpoint(every_n_steps=...) differs between ranks (pass the same callbacks "
            "on every rank; mixprec writes from rank 0 only): a resume from its mid-epoch "
            "checkpoints counts rank 0's share of that epoch for every rank"
        )
    return cadences if agreed else []


def replay_epoch(
    epoch_batches: Callable[[], Iterable[Any]],
    rng: torch.Tensor,
    skip: int,
    data: Any = None,
    epoch: int = 0,
) -> Iterator[Any]:
    """The interrupted epoch's batches after the first ``skip``, in the same order.

    The order is drawn with the RNG at ``rng``, as it was: a shuffling ``DataLoader`` draws
    its seed when its first batch is asked for, not at ``iter()``, so the batches already
    done are drawn here too, under that RNG. The RNG is then put back as the checkpoint
    left it, so that what comes next (dropout, augmentations) draws as it did. A loader
    (``data``) whose order that RNG does not decide is said, past the first ``epoch``
    (where a loader made anew draws as the first run's did)."""
    why = _order_not_replayed(data) if skip and epoch else None
    if why is not None:
        warn(
            f"resumed {skip} batches into an epoch whose order this DataLoader cannot "
            f"replay: {why}. The rest of the epoch may train some samples twice and leave "
            "out others. Resume from an epoch's end (ModelCheckpoint(every_n_epochs=1)), "
            "or give the loader an order the global RNG decides"
        )
    now = torch.get_rng_state()
    torch.set_rng_state(rng)
    try:
        batches = iter(epoch_batches())
        for _ in range(skip):
            if next(batches, _END) is _END:
                break
    finally:
        torch.set_rng_state(now)
    return batches


_END = object()


def _order_not_replayed(data: Any) -> str | None:
    """Why a shuffling ``DataLoader``'s order past its first epoch is not a function of the
    global RNG when the epoch starts, or ``None``. Either lost a resumed epoch 3 to 8
    samples of 32 (trained twice, 3 to 8 others left out), unsaid."""
    if not isinstance(data, torch.utils.data.DataLoader):
        return None
    sampler = getattr(data.batch_sampler, "sampler", data.sampler)
    if not isinstance(sampler, torch.utils.data.RandomSampler):
        return None
    if sampler.generator is not None:
        return (
            "it shuffles with a generator of its own (DataLoader(generator=...)), whose "
            "state a checkpoint does not hold; seed with torch.manual_seed instead"
        )
    if data.persistent_workers and data.num_workers > 0:
        return (
            "it keeps persistent workers, reused from the epoch before, where a new "
            "iterator first draws a seed for its workers (persistent_workers=False replays)"
        )
    return None


def keyed(callbacks: Sequence[Callback]) -> dict[str, Callback]:
    """Callbacks by key: the class name, with ``#2``, ``#3``... for later ones of a class."""
    keys: dict[str, Callback] = {}
    for cb in callbacks:
        name = type(cb).__qualname__
        key, n = name, 1
        while key in keys:
            n += 1
            key = f"{name}#{n}"
        keys[key] = cb
    return keys


def callback_states(callbacks: dict[str, Callback]) -> dict[str, Any]:
    """What each callback with state returns from ``state_dict``, by key."""
    states = {key: cb.state_dict() for key, cb in callbacks.items()}
    return {key: state for key, state in states.items() if state is not None}


def restore_callbacks(
    callbacks: dict[str, Callback], active: Sequence[Callback], saved: dict[str, Any]
) -> None:
    """Give each active callback its saved state; say which state has no callback to take
    it, and which callback with state starts afresh."""
    for key, state in saved.items():
        cb = callbacks.get(key)
        if cb is None:
            warn(
                f"resume: the checkpoint holds the state of a {key} callback, and this fit() "
                "has none: that state is not restored"
            )
        elif cb in active:
            cb.load_state_dict(state)
    for key, cb in callbacks.items():
        if key not in saved and cb in active and cb.state_dict() is not None:
            warn(
                f"resume: the checkpoint holds no state for the {key} callback (it was not "
                "given when the checkpoint was saved, or mixprec then saved none): it starts "
                "afresh"
            )
