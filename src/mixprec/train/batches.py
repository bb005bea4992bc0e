"""The data a ``Trainer`` takes, and how it becomes batches.

Tensors or arrays ``(x, y)`` are checked up front and dealt into batches (under torchrun,
each rank its share of rank 0's order); an iterable of ``(inputs, targets)`` batches, such as
a ``DataLoader``, is used as it comes (under torchrun, one without a length while every
rank has a batch). Nothing here runs the model: where a check needs the
number of classes, the caller supplies it.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

import torch

from mixprec import distributed
from mixprec._errors import ArgumentError, check_int
from mixprec.data import check_finite, validate_classification
from mixprec.train.metrics import LossFn, ignore_index_of
from mixprec.train.warn import warn

Batch = tuple[Any, torch.Tensor]


def to_device(value: Any, device: torch.device) -> Any:
    """``value`` on ``device``: a tensor, or the tensors of a tuple or list of inputs."""
    if isinstance(value, torch.Tensor):
        return value.to(device, non_blocking=True)
    if isinstance(value, (tuple, list)):
        return type(value)(to_device(v, device) for v in value)
    return value


_SAID_EXTRA: list[bool] = []  # batches with more than (inputs, targets): said once


def xy(batch: Batch, device: torch.device) -> tuple[Any, Any]:
    """A batch's inputs and targets, on ``device``. Elements past those two are not used:
    said once, for Keras takes a third as sample weights (the losses came out unweighted)."""
    if isinstance(batch, Mapping):
        raise ArgumentError(
            f"a batch is a mapping ({', '.join(map(repr, list(batch)[:4]))}): the Trainer "
            "takes (inputs, targets) pairs; have the loader yield (x, y), or a model and "
            "loss that take the rest from x"
        )
    if len(batch) > 2 and not _SAID_EXTRA:
        _SAID_EXTRA.append(True)
        warn(
            f"a batch has {len(batch)} elements: the Trainer uses the first two (inputs, "
            "targets) and ignores the rest. Keras would take a third as sample weights; "
            "here the loss is unweighted: have the loader yield (x, (y, w)), with a loss "
            "that reads both, loss(output, (y, w)), and metrics=() (accuracy reads targets "
            "as labels)"
        )
    return to_device(batch[0], device), to_device(batch[1], device)


def length(data: Any) -> int:
    """``len(data)``: a tensor's or array's samples, a loader's batches; -1 where there is
    none (an iterable dataset's loader has ``__len__`` but raises ``TypeError``)."""
    try:
        return len(data)
    except TypeError:
        return -1


def as_tensor(value: Any, name: str) -> torch.Tensor:
    """``value`` as a tensor (a numpy array or nested lists are converted; float64 values,
    numpy's default, to float32 as Keras casts to its floatx: they trained at O2, whose
    boundary casts them, and failed in float32's Linear at O0 and O1)."""
    if isinstance(value, torch.Tensor):
        return value
    try:
        tensor = torch.as_tensor(value)
    except (TypeError, ValueError, RuntimeError) as err:
        raise ArgumentError(
            f"{name} must be a tensor or an array, got {type(value).__name__}"
        ) from err
    return tensor.float() if tensor.dtype == torch.float64 else tensor


def is_array(value: Any) -> bool:
    """Whether ``value`` is an array of samples (numpy's, or anything with ``__array__``)
    rather than an iterable of batches."""
    return not isinstance(value, torch.Tensor) and hasattr(value, "__array__")


def is_empty(targets: Any) -> bool:
    """Whether a batch's targets hold no sample (its mean loss would be NaN)."""
    return isinstance(targets, torch.Tensor) and targets.dim() > 0 and targets.shape[0] == 0


def epoch_batches(
    x: Any,
    y: Any,
    batch_size: int,
    shuffle: bool,
    split: bool = True,
    device: torch.device | None = None,
) -> tuple[Callable[[], Iterable[Batch]], int, int]:
    """A function giving one epoch of batches, the number of batches and of samples.

    With ``split`` (training) under torchrun, ``batch_size`` is the global batch and
    each rank gets its share of rank 0's order. Tensors given on a GPU are gathered there
    (the order is copied to it once an epoch, not a batch's indices every step); CPU tensors
    for a CUDA ``device`` are gathered into pinned memory and copied without a stall
    (``_Staging``)."""
    if y is None:  # an iterable of (inputs, targets) batches, e.g. a DataLoader
        if isinstance(x, torch.Tensor) or is_array(x):
            raise ArgumentError(
                f"fit(x, y): y is missing for x, a {type(x).__name__} of samples; pass targets "
                "or a loader of (inputs, targets) batches"
            )
        steps = max(length(x), 0)
        if not steps and split and distributed.world_size() > 1:
            return (lambda: _while_every_rank_has_one(iter(x))), 0, 0
        # iter() now: a shuffling DataLoader draws its order from the RNG at this point.
        return (lambda: iter(x)), steps, 0
    check_int("batch_size", batch_size, 1)
    xt, yt = as_tensor(x, "x"), as_tensor(y, "y")
    n = len(xt)
    split = split and distributed.world_size() > 1
    local = distributed.check_batch(batch_size) if split else batch_size
    rows = min(local, n)  # the largest batch
    staging = _Staging(device) if device and _Staging.applies(xt, yt, device, rows) else None

    def epoch() -> Iterable[Batch]:
        # The order is drawn now, not when iteration starts, so that resuming can
        # replay it from the RNG state saved at the start of the epoch.
        order = torch.randperm(n) if shuffle else torch.arange(n)
        # Every rank uses rank 0's order and takes its share, as DistributedSampler.
        if split:
            # Without shuffling the order is arange on every rank: nothing to broadcast.
            order = distributed.broadcast_(order) if shuffle else order
            # Padded whether shuffled or not: a rank with one step fewer than the others
            # would leave them waiting in DDP's all-reduce for good.
            order = distributed.shard(order, pad=True)
        return _gather(xt, yt, order, local, staging)

    per_rank = -(-n // distributed.world_size()) if split else n
    return epoch, -(-per_rank // local), n


_NONE_LEFT = object()


def _while_every_rank_has_one(batches: Iterator[Batch]) -> Iterator[Batch]:
    """Under torchrun, a length-less loader's batches while every rank has one (one
    all-reduce a batch). A rank whose loader ran out would leave the others waiting in
    DDP's all-reduce, ending in the backend's raw mismatch error or a hang; every rank
    stops after the shortest's last batch instead, and a rank with batches left says so."""
    used = 0
    for batch in itertools.chain(batches, [_NONE_LEFT]):
        every = distributed.all_reduce_sum([float(batch is not _NONE_LEFT)])[0]
        if every == distributed.world_size():
            used += 1
            yield batch  # type: ignore[misc]
            continue
        if batch is not _NONE_LEFT:
            warn(
                f"fit: rank {distributed.rank()}'s loader has batches left after {used}, where "
                f"another rank's has ended: every rank ends this epoch after {used} batches, "
                "and this rank's others are left out of it. Give every rank as many batches "
                "(shard the data evenly, or drop the uneven last ones)"
            )
        return


def _gather(
    xt: torch.Tensor, yt: torch.Tensor, order: torch.Tensor, local: int, staging: _Staging | None
) -> Iterator[Batch]:
    if staging is not None:
        return (staging.gather(xt, yt, idx) for idx in order.split(local))
    # An index on the CPU for a tensor on a GPU is copied there at each use (a stall):
    # copied once here instead, for each device the data lives on.
    # Not waited for on CUDA, which stages a pageable copy before returning; elsewhere (MPS)
    # such a copy may read ``order`` after it is freed.
    ix = order.to(xt.device, non_blocking=xt.device.type == "cuda")
    iy = ix if yt.device == xt.device else order.to(yt.device, non_blocking=yt.is_cuda)
    return ((xt[i], yt[j]) for i, j in zip(ix.split(local), iy.split(local), strict=True))


class _Staging:
    """CPU batches for a CUDA device, gathered into pinned memory (two buffers in turn)
    and copied with ``non_blocking``. From pageable
    memory CUDA waits for the stream before each copy; from pinned memory it does not. A
    buffer is written again only once its last copy is done (an event)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.slots: list[tuple[torch.Tensor, torch.Tensor, torch.cuda.Event]] = []
        self.turn = 0

    @staticmethod
    def applies(xt: torch.Tensor, yt: torch.Tensor, device: torch.device, rows: int) -> bool:
        """Whether to stage: CPU tensors for a CUDA device (pinned memory needs CUDA), in
        batches of at least ``STAGED_BYTES``, that autograd does not follow (a gather with
        ``out=`` would refuse them), in the default memory format (the buffers are; a
        ``channels_last`` batch stays so through the plain gather)."""
        return (
            device.type == "cuda"
            and xt.device.type == "cpu"
            and yt.device.type == "cpu"
            and not (xt.requires_grad or yt.requires_grad)
            and xt.is_contiguous()
            and yt.is_contiguous()
            and rows * (_row_bytes(xt) + _row_bytes(yt)) >= STAGED_BYTES
        )

    def gather(self, xt: torch.Tensor, yt: torch.Tensor, idx: torch.Tensor) -> Batch:
        """The samples at ``idx``, on the device (the copies queued, not waited for)."""
        if not self.slots:  # sized by the first (largest) batch
            self.slots = [
                (_pinned(xt, len(idx)), _pinned(yt, len(idx)), torch.cuda.Event()) for _ in range(2)
            ]
        xbuf, ybuf, done = self.slots[self.turn]
        self.turn ^= 1
        done.synchronize()  # the copy out of this buffer two batches ago
        xs, ys = xbuf[: len(idx)], ybuf[: len(idx)]
        torch.index_select(xt, 0, idx, out=xs)
        torch.index_select(yt, 0, idx, out=ys)
        xb, yb = xs.to(self.device, non_blocking=True), ys.to(self.device, non_blocking=True)
        # On the stream the copies went to: that of the target device, not the current one.
        done.record(torch.cuda.current_stream(self.device))
        return xb, yb


#: The smallest batch (bytes of inputs and targets) gathered through pinned memory. On an
#: H200 host (2026-11-26) the data path alone, gather and copy and a read, took 118 against
#: 112 us a batch at 64 MNIST-sized rows (200 KB) and 268 against 579 us at 1024 (3.2 MB).
STAGED_BYTES = 1 << 20


def _row_bytes(t: torch.Tensor) -> int:
    return t[:1].numel() * t.element_size()


def _pinned(t: torch.Tensor, rows: int) -> torch.Tensor:
    return torch.empty((rows, *t.shape[1:]), dtype=t.dtype, pin_memory=True)


def inputs_of(x: Any, batch_size: int) -> Iterable[Any]:
    """The inputs of tensors or arrays ``x`` in batches of ``batch_size``, or of an iterable
    of batches (``(inputs, targets)`` or inputs alone), for ``predict``."""
    check_int("batch_size", batch_size, 1)
    samples = _nested_numbers(x)
    if samples is None and (
        isinstance(x, torch.Tensor) or is_array(x) or not isinstance(x, Iterable)
    ):
        samples = as_tensor(x, "x")
    if samples is not None:
        split: tuple[torch.Tensor, ...] = samples.split(batch_size)
        return split
    chunks = (b[0] if isinstance(b, (tuple, list)) else b for b in x)
    return (as_tensor(c, "x") if is_array(c) else c for c in chunks)


def _nested_numbers(x: Any) -> torch.Tensor | None:
    """``x`` as one tensor if it is samples as nested lists of numbers (``[[1, 2], [3, 4]]``,
    which ``fit`` and ``evaluate`` take as one array), else None (a list of batches)."""
    if not isinstance(x, list) or not x or not isinstance(x[0], (list, int, float)):
        return None
    try:
        return torch.as_tensor(x)
    except (TypeError, ValueError, RuntimeError):
        return None


def rank_share(x: Any, y: Any) -> tuple[Any, Any]:
    """Under torchrun, this rank's share of tensors or arrays ``(x, y)`` (for evaluation);
    a loader, or a single process's data, as it is."""
    if y is None or distributed.world_size() == 1:
        return x, y
    xt, yt = as_tensor(x, "x"), as_tensor(y, "y")
    mine = distributed.shard(torch.arange(len(xt)), pad=False)
    return xt[mine], yt[mine]


def check_ranks_agree(
    x: Any, y: Any, batch_size: int, epochs: int, validation_data: Any, resume_from: Any = None
) -> None:
    """Under torchrun every rank must pass the same data sizes, and resume or not alike:
    ranks with different numbers of steps (or one resuming alone) would run different
    collectives and die in the backend's raw "collective mismatch" abort, on one rank and
    after a timeout."""
    if distributed.world_size() == 1:
        return
    # Samples (tensors and arrays, checked by validate) or a loader's batches.
    sizes = {
        "samples_or_batches": length(x),
        "batch_size": -1 if y is None else batch_size,
        "epochs": epochs,
        "validation_samples": -1 if validation_data is None else length(validation_data[0]),
        "resume_from": int(resume_from is not None),
    }
    if y is not None:  # each rank's own shard of the same size would lose the others' half
        sizes["data_checksum"] = _checksum(x, y)
    distributed.check_same_on_every_rank(
        "fit()'s data",
        sizes,
        "every rank must pass the same global data, batch_size and epochs (the Trainer "
        "deals each rank its share), or loaders of the same length, and resume_from on "
        "every rank or none",
    )


def _checksum(x: Any, y: Any) -> int:
    """A number that differs where ranks pass different samples: sums of 8 rows spread over
    ``x`` and of ``y``, in float64 (the ranks' own shards, passed where the global data is
    meant, trained on rank 0's half alone, unsaid)."""
    xt, yt = as_tensor(x, "x"), as_tensor(y, "y")
    if len(xt) == 0:
        return 0
    rows = torch.linspace(0, len(xt) - 1, min(8, len(xt))).long().to(xt.device)
    total = xt[rows].sum(dtype=torch.float64) + yt.sum(dtype=torch.float64)
    return distributed.float_key(float(total))


def set_sampler_epoch(loader: Any, epoch: int) -> None:
    """Tell a loader's ``DistributedSampler`` (or any sampler with ``set_epoch``) the epoch
    before it is iterated, as Lightning does: it shuffles by epoch, and untold it gave every
    epoch epoch 0's order."""
    batch_sampler = getattr(loader, "batch_sampler", None)
    for sampler in (getattr(loader, "sampler", None), getattr(batch_sampler, "sampler", None)):
        set_epoch = getattr(sampler, "set_epoch", None)
        if callable(set_epoch):
            set_epoch(epoch)
            return


def validate(x: Any, y: Any, loss_fn: LossFn, count_classes: Callable[[torch.Tensor], int]) -> None:
    """Check tensors or arrays ``(x, y)`` before any step: equal lengths, finite inputs and
    float targets, class labels in range; a loader (``y=None``) is checked batch by batch as
    it trains.

    ``count_classes(inputs)``: the number of classes the model predicts for a few samples,
    asked only for a cross-entropy loss."""
    if y is None:
        return
    xt, yt = as_tensor(x, "x"), as_tensor(y, "y")
    classes = None
    # A cross-entropy leaves out labels of its ignore_index (-100 by default), as padding.
    ignore = ignore_index_of(loss_fn)
    if ignore is not None and len(xt) > 0:
        classes = count_classes(xt[:2])
    if ignore is not None or not yt.is_floating_point():
        validate_classification(xt, yt, classes, ignore_index=ignore)
        return
    # Float targets (regression, binary cross-entropy): an inf or NaN target trains the
    # model to inf as surely as an inf feature does.
    for arg, t in (("x", xt), ("y", yt)):
        if t.dim() == 0:
            raise ValueError(f"data: {arg} is a scalar; it needs a leading sample dimension")
    if len(xt) != len(yt):
        raise ValueError(f"data: x has {len(xt)} samples but y has {len(yt)} targets")
    if len(xt) == 0:
        raise ValueError("data is empty: 0 samples")
    for arg, t in (("x", xt), ("y", yt)):
        check_finite(t, arg)


def skip_empty(targets: Any, epoch: int, step: int) -> bool:
    """Whether a loader's batch holds no sample, which is then skipped with a warning: its
    mean loss is NaN and it would count as a step. Under torchrun, an error: every rank
    must step together."""
    if not is_empty(targets):
        return False
    if distributed.world_size() > 1:
        raise ValueError(
            f"epoch {epoch + 1}, batch {step + 1} is empty on rank {distributed.rank()}; "
            "every rank must get a non-empty batch at every step"
        )
    warn(f"epoch {epoch + 1}, batch {step + 1} is empty: skipped (not a step)")
    return True


def drop_unfinished_group(optimizer: Any) -> None:
    """An accumulation group a stopped ``fit`` left unfinished (Ctrl-C between its
    micro-batches): dropped, and said, so that no group spans two ``fit`` calls."""
    pending = optimizer.pending_micro_steps
    if pending:
        warn(
            f"fit: the optimizer holds the gradients of {pending} of "
            f"{optimizer.accumulation_steps} micro-batches of a group an earlier fit left "
            "unfinished; they are dropped, so that no group spans two fit calls"
        )
        optimizer.drop_gradients()
