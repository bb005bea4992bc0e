"""The Trainer's data: tensors checked before any step, a loader's batches checked as they
come (empty batches, labels out of range), and the data sizes every rank must agree on."""

from __future__ import annotations

from typing import ClassVar

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import mixprec as mp
from tests.conftest import classification_data, make_mlp


def trainer(policy="mixed_bfloat16", lr=3e-3, **kwargs):
    model = make_mlp()
    opt = torch.optim.Adam(model.parameters(), lr=lr)
    return mp.Trainer(model, "cross_entropy", opt, policy=policy, device="cpu", **kwargs)


@pytest.mark.parametrize(
    ("x", "y", "match"),
    [
        (torch.randn(0, 32), torch.zeros(0, dtype=torch.long), "data is empty"),
        (torch.randn(8, 32), torch.full((8,), 12), r"label.*12.*\[0, 10\)|12"),
        (torch.full((8, 32), float("nan")), torch.zeros(8, dtype=torch.long), "NaN"),
        (torch.randn(8, 32), torch.zeros(7, dtype=torch.long), "8.*7|7.*8"),
    ],
)
def test_bad_data_fails_before_training(x, y, match):
    t = trainer()
    before = [p.detach().clone() for p in t.model.parameters()]
    with pytest.raises(ValueError, match=match):
        t.fit(x, y, epochs=1, verbose=0)
    assert all(torch.equal(a, b) for a, b in zip(before, t.model.parameters(), strict=True))


# -- batches a loader gets wrong ----------------------------------------------------------


def _small_trainer(device: str = "auto") -> mp.Trainer:
    torch.manual_seed(0)
    model = nn.Linear(8, 3)
    opt = torch.optim.SGD(model.parameters(), 0.1)
    return mp.Trainer(model, "cross_entropy", opt, device=device)


def test_an_empty_batch_is_skipped_with_a_warning_not_a_step() -> None:
    x, y = torch.randn(16, 8), torch.randint(0, 3, (16,))
    batches = [(x[:8], y[:8]), (x[:0], y[:0]), (x[8:], y[8:])]
    trainer = _small_trainer()
    with pytest.warns(UserWarning, match=r"epoch 1, batch 2 is empty: skipped \(not a step\)"):
        history = trainer.fit(batches, epochs=1, verbose=0)
    assert trainer.global_step == 2
    loss = history.history["loss"][0]
    assert loss == loss and history.history["accuracy"][0] == history.history["accuracy"][0]
    # Same as training on the two non-empty batches alone.
    plain = _small_trainer()
    expected = plain.fit([batches[0], batches[2]], epochs=1, verbose=0).history["loss"][0]
    assert loss == pytest.approx(expected, rel=1e-6)


def test_out_of_range_labels_from_a_loader_are_a_value_error() -> None:
    x, y = torch.randn(40, 8), torch.randint(0, 3, (40,))
    y[25] = 7
    # On the CPU: on CUDA the loss's bounds check is a device-side assert, which ends the
    # process's CUDA context (torch's behaviour; the loss reads no labels on the host).
    trainer = _small_trainer("cpu")
    loader = DataLoader(TensorDataset(x, y), batch_size=8)
    with pytest.raises(ValueError, match=r"epoch 1, batch 4: Target 7 is out of bounds"):
        trainer.fit(loader, epochs=1, verbose=0)
    # mp.cross_entropy's own bounds check, named as F.cross_entropy's is.
    torch.manual_seed(0)
    model = nn.Linear(8, 3)
    chunked = mp.Trainer(model, mp.cross_entropy, torch.optim.SGD(model.parameters(), 0.1),
                         device="cpu")  # fmt: skip
    with pytest.raises(ValueError, match=r"epoch 1, batch 4: cross_entropy: target 7 is out of "
                       r"bounds.*\(class labels must be in \[0, number of classes\)"):  # fmt: skip
        chunked.fit(loader, epochs=1, verbose=0)


def test_rank_agreement_reads_loaders_without_a_length(monkeypatch):
    # A loader over an IterableDataset has __len__ but raises TypeError from it; the rank
    # check reads -1 for it, and accepts a validation loader as fit() does.
    from mixprec import distributed
    from mixprec.train import batches

    class Stream(torch.utils.data.IterableDataset):
        def __iter__(self):
            x, y = classification_data(n=32)
            return iter(zip(x.split(8), y.split(8), strict=True))

    seen = []
    monkeypatch.setattr(distributed, "world_size", lambda: 2)
    monkeypatch.setattr(distributed, "check_same_on_every_rank",
                        lambda what, values, remedy: seen.append(values))  # fmt: skip
    loader = torch.utils.data.DataLoader(Stream(), batch_size=None)
    listed = [(x, y) for x, y in loader]
    batches.check_ranks_agree(loader, None, 32, 2, (listed, None))
    assert seen == [{"samples_or_batches": -1, "batch_size": -1, "epochs": 2,
                     "validation_samples": 4, "resume_from": 0}]  # fmt: skip


# -- float targets are checked as features are ---------------------------------------------


def _regressor() -> mp.Trainer:
    torch.manual_seed(0)
    model = nn.Linear(4, 1)
    return mp.Trainer(model, "mse", torch.optim.SGD(model.parameters(), 0.1), metrics=(),
                      device="cpu")  # fmt: skip


@pytest.mark.parametrize(
    ("arg", "index", "match"),
    [
        ("y", 3, r"data: y has 1 non-finite value\(s\) \(NaN or inf\); the first is in sample 3"),
        ("x", 5, r"data: x has 1 non-finite value\(s\) \(NaN or inf\); the first is in sample 5"),
    ],
)
def test_non_finite_float_targets_fail_before_training(arg, index, match):
    x, y = torch.randn(8, 4), torch.randn(8, 1)
    (y if arg == "y" else x)[index, 0] = float("inf")
    t = _regressor()
    before = [p.detach().clone() for p in t.model.parameters()]
    with pytest.raises(ValueError, match=match):
        t.fit(x, y, epochs=1, verbose=0)
    with pytest.raises(ValueError, match=match):  # validation data too
        t.fit(torch.randn(8, 4), torch.randn(8, 1), validation_data=(x, y), verbose=0)
    assert all(torch.equal(a, b) for a, b in zip(before, t.model.parameters(), strict=True))
    with pytest.raises(ValueError, match=r"data: x has 8 samples but y has 7 targets"):
        t.fit(torch.randn(8, 4), torch.randn(7, 1), verbose=0)


def test_mark_last_reads_one_batch_ahead_and_past_empty_ones():
    from mixprec.train.batches import is_empty
    from mixprec.train.read_ahead import ReadAhead

    def mark_last(data):
        return ReadAhead(data, is_empty)

    full, empty = (torch.ones(2), torch.ones(2)), (torch.ones(0), torch.ones(0))
    marked = list(mark_last([empty, full, empty, full, empty, empty]))
    assert [(b[1].numel(), last) for b, last in marked] == [
        (0, False), (2, False), (0, False), (2, True), (0, False), (0, False)
    ]  # fmt: skip
    assert list(mark_last([])) == []
    assert [last for _, last in mark_last([empty])] == [False]


def test_an_empty_last_batch_does_not_keep_the_group_from_being_applied():
    x, y = torch.randn(24, 8), torch.randint(0, 3, (24,))
    torch.manual_seed(0)
    model = nn.Linear(8, 3)
    t = mp.Trainer(model, "cross_entropy", torch.optim.SGD(model.parameters(), 0.1),
                   accumulation_steps=4)  # fmt: skip
    batches = [(x[:8], y[:8]), (x[8:], y[8:]), (x[:0], y[:0])]
    with pytest.warns(UserWarning, match=r"batch 3 is empty"):
        t.fit(batches, epochs=1, verbose=0)
    assert t.global_step == 1


def test_cross_entropy_labels_may_be_its_ignore_index():
    """F.cross_entropy leaves labels of -100 out (padding); other labels out of range are
    still refused, with -100 named among the valid ones."""
    x, y = torch.randn(16, 8), torch.randint(0, 3, (16,))
    y[5] = -100
    torch.manual_seed(0)
    model = nn.Linear(8, 3)
    t = mp.Trainer(model, "cross_entropy", torch.optim.SGD(model.parameters(), 0.1))
    history = t.fit(x, y, batch_size=8, epochs=1, verbose=0)
    assert torch.isfinite(torch.tensor(history.history["loss"])).all()
    y[6] = 7
    with pytest.raises(ValueError, match=r"label 7 at sample 6 is out of range; valid labels are "
                       r"0\.\.2, or -100 \(ignored by the loss\)"):  # fmt: skip
        t.fit(x, y, batch_size=8, epochs=1, verbose=0)


# -- what the data gives each rank and each split ---------------------------------------------


@pytest.mark.parametrize("shuffle", [False, True])
def test_every_rank_gets_as_many_steps_as_it_was_told(monkeypatch, shuffle):
    """Unshuffled, 11 samples over 2 ranks gave rank 1 five steps and rank 0 six: rank 0
    then waited in DDP's all-reduce for good. Both are padded, as DistributedSampler does."""
    from mixprec import distributed
    from mixprec.train.batches import epoch_batches

    monkeypatch.setattr(distributed, "world_size", lambda: 2)
    monkeypatch.setattr(distributed, "check_batch", lambda b: b // 2)
    monkeypatch.setattr(distributed, "broadcast_", lambda t: t)
    x, y = torch.arange(11.0).reshape(11, 1), torch.arange(11)
    seen = []
    for rank in (0, 1):
        monkeypatch.setattr(distributed, "rank", lambda rank=rank: rank)
        epoch, steps, _ = epoch_batches(x, y, batch_size=2, shuffle=shuffle)
        torch.manual_seed(0)  # rank 0's order on both: broadcast_ is stubbed out here
        batches = list(epoch())
        assert len(batches) == steps == 6, rank
        seen += [int(v) for _, yb in batches for v in yb]
    assert sorted(set(seen)) == list(range(11)) and len(seen) == 12  # one sample repeated


@pytest.mark.parametrize(("n", "split", "held"), [(100, 0.29, 29), (100, 0.57, 57), (100, 0.005, 1),
                                                  (10, 0.25, 3), (400, 0.2, 80)])  # fmt: skip
def test_validation_split_holds_out_what_keras_does(n, split, held):
    """Keras trains on the first floor(n * (1 - split)) samples; int(n * split) held out
    one fewer where n * split is not exact in binary (100 * 0.29 = 28.999...)."""
    from mixprec.train.validation import split_validation

    x, y = torch.randn(n, 3), torch.arange(n)
    xt, yt, (xv, yv) = split_validation(x, y, split)
    assert len(xv) == len(yv) == held and len(xt) == len(yt) == n - held
    assert torch.equal(torch.cat([yt, yv]), y)  # the last samples, in order


def test_a_split_that_leaves_one_side_empty_and_mismatched_data_are_named():
    from mixprec.train.validation import split_validation

    empty = r"validation_split=0.5 of 1 samples holds out 1 and trains on 0; each needs at"
    with pytest.raises(mp.ArgumentError, match=empty):
        split_validation(torch.randn(1, 3), torch.zeros(1), 0.5)
    with pytest.raises(mp.ArgumentError, match=r"x has 100 samples but y has 90"):
        split_validation(torch.randn(100, 3), torch.zeros(90), 0.2)


def test_fit_on_an_array_without_y_says_y_is_missing():
    np = pytest.importorskip("numpy")
    with pytest.raises(mp.ArgumentError, match=r"y is missing for x, a ndarray of samples"):
        trainer().fit(np.zeros((8, 32), dtype=np.float32), epochs=1, verbose=0)


def test_predict_takes_nested_lists_as_fit_does():
    t = trainer()
    rows = torch.randn(5, 32)
    got = t.predict(rows.tolist(), batch_size=2)
    assert torch.allclose(got, t.predict(rows, batch_size=2), rtol=0, atol=0)
    batches = [rows[:2], rows[2:]]  # a list of batches stays one
    assert torch.equal(t.predict(batches), t.predict(rows))


def test_only_large_cpu_batches_for_a_gpu_go_through_pinned_memory():
    # Measured on an H200 host: pinned staging was 2.2x faster at 3.2 MB batches and 6%
    # slower at 200 KB ones. Deciding needs no GPU: devices are only named here.
    from mixprec.train.batches import STAGED_BYTES, _Staging

    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    x, y = torch.zeros(10, 784), torch.zeros(10, dtype=torch.long)
    rows = -(-STAGED_BYTES // (784 * 4 + 8))  # the fewest rows that reach the threshold
    assert _Staging.applies(x, y, cuda, rows)
    assert not _Staging.applies(x, y, cuda, rows - 1)
    assert not _Staging.applies(x, y, cpu, rows)  # nothing to copy
    assert not _Staging.applies(x.to("meta"), y, cuda, rows)  # inputs not on the CPU
    images = torch.zeros(10, 3, 32, 32).to(memory_format=torch.channels_last)
    assert not _Staging.applies(images, y, cuda, rows)  # the buffers would drop its layout
    assert _Staging.applies(images.contiguous(), y, cuda, rows)
    assert not _Staging.applies(x.requires_grad_(), y, cuda, rows)  # out= would refuse it


def test_a_distributed_sampler_is_told_each_epoch():
    """fit never called set_epoch: a DistributedSampler then gave every epoch epoch 0's
    order (under torchrun, on every rank), unsaid. Lightning tells it; so does fit (a
    resumed epoch too: the same call precedes its replay)."""
    from torch.utils.data.distributed import DistributedSampler

    x, y = classification_data(n=32, seed=3)

    class Recording(DistributedSampler):
        orders: ClassVar[list[list[int]]] = []

        def __iter__(self):
            order = list(super().__iter__())
            self.orders.append(order)
            return iter(order)

    # Rank 0 of 2, given by hand: no process group needed to deal its half.
    sampler = Recording(TensorDataset(x, y), num_replicas=2, rank=0, shuffle=True, seed=1)
    loader = DataLoader(TensorDataset(x, y), batch_size=8, sampler=sampler)
    trainer().fit(loader, epochs=3, verbose=0)
    assert sampler.epoch == 2
    assert len(sampler.orders) == 3
    assert all(len(order) == 16 for order in sampler.orders)  # rank 0's half each epoch
    assert sampler.orders[0] != sampler.orders[1] != sampler.orders[2]


def test_an_index_error_of_the_model_itself_is_not_blamed_on_the_labels() -> None:
    """A model whose position table is too short for a batch: every "out of bounds" became
    a ValueError about class labels, all of them valid. It goes on as torch raised it; a
    gather in a loss of one's own over a bad label still names the batch."""

    class Positions(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.table = nn.Parameter(torch.randn(8, 4))
            self.head = nn.Linear(4, 3)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            row = self.head(self.table[torch.arange(x.shape[1])].mean(0))
            return row.expand(len(x), len(row))

    model = Positions()
    trainer = mp.Trainer(model, "cross_entropy", torch.optim.SGD(model.parameters(), 0.1),
                         device="cpu", metrics=())  # fmt: skip
    labels = torch.tensor([0, 1, 2, 0])
    with pytest.raises(IndexError, match=r"^index 8 is out of bounds for dimension 0"):
        trainer.fit([(torch.zeros(4, 8), labels), (torch.zeros(4, 12), labels)], verbose=0)
    # A valid label equal to the table's bad index (10 classes, label 8): still the model's.
    model = Positions()
    model.head = nn.Linear(4, 10)
    trainer = mp.Trainer(model, "cross_entropy", torch.optim.SGD(model.parameters(), 0.1),
                         device="cpu", metrics=())  # fmt: skip
    labels = torch.tensor([0, 8, 2, 9])
    with pytest.raises(IndexError, match=r"^index 8 is out of bounds for dimension 0"):
        trainer.fit([(torch.zeros(4, 8), labels), (torch.zeros(4, 12), labels)], verbose=0)

    def gathered(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        picked = output.log_softmax(-1).gather(1, target[:, None])
        return -picked.mean()

    model = nn.Linear(8, 3)
    trainer = mp.Trainer(model, gathered, torch.optim.SGD(model.parameters(), 0.1),
                         device="cpu", metrics=())  # fmt: skip
    with pytest.raises(ValueError, match=r"epoch 1, batch 1: .*index 5 is out of bounds.*"
                       r"class labels must be in"):  # fmt: skip
        trainer.fit([(torch.randn(4, 8), torch.tensor([0, 5, 1, 2]))], verbose=0)
