"""Metrics and losses by name: what each name gives, the error for a name that is none, and
each value against a computation by hand on small tensors."""

from __future__ import annotations

import copy
import functools
import math
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import mixprec as mp
from mixprec.train import batches, metrics
from mixprec.train import trainer as trainer_module
from mixprec.train.metrics import get_loss, get_metric

LOSS_NAMES = (
    "cross_entropy, sparse_categorical_crossentropy, mse, mean_squared_error, mae, "
    "binary_crossentropy"
)


# -- names ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("name", "reported", "function"),
    [
        ("accuracy", "accuracy", metrics.accuracy),
        ("acc", "accuracy", metrics.accuracy),  # the Keras short name, logged as "accuracy"
        ("mae", "mae", metrics.mae),
        ("mse", "mse", metrics.mse),
    ],
)
def test_get_metric_by_name(name, reported, function):
    assert get_metric(name) == (reported, function)


def test_get_metric_takes_a_callable_under_its_name():
    def f1(output, target):
        return output.sum()

    class TopTwo:
        def __call__(self, output, target):
            return output.sum()

    assert get_metric(f1) == ("f1", f1)
    top = TopTwo()
    assert get_metric(top) == ("TopTwo", top)  # no __name__: the type's


@pytest.mark.parametrize(
    ("name", "function"),
    [
        ("cross_entropy", F.cross_entropy),
        ("sparse_categorical_crossentropy", F.cross_entropy),  # the Keras name
        ("mse", F.mse_loss),
        ("mean_squared_error", F.mse_loss),
        ("mae", F.l1_loss),
    ],
)
def test_get_loss_by_name(name, function):
    """Cross-entropy is torch's own; the regression losses torch's on outputs and targets
    of one shape (a trailing 1 squeezed first: test_resume_state)."""
    loss = get_loss(name)
    if function is F.cross_entropy:
        assert loss is function
        return
    out, target = torch.randn(6, 3), torch.randn(6, 3)
    assert torch.equal(loss(out, target), function(out, target))
    assert torch.equal(loss(out[:, :1], target[:, 0]), function(out[:, 0], target[:, 0]))


def test_get_loss_returns_a_callable_as_it_is():
    module = nn.CrossEntropyLoss(label_smoothing=0.1)
    assert get_loss(module) is module

    def custom(output, target):
        return output.mean()

    assert get_loss(custom) is custom


@pytest.mark.parametrize(
    ("metric", "message"),
    [
        (
            "acuracy",
            "metrics entry 'acuracy' is not a known metric; valid: accuracy, acc, mae, mse or "
            "a callable (output, target) -> scalar (closest: 'accuracy')",
        ),
        (
            "f1",
            "metrics entry 'f1' is not a known metric; valid: accuracy, acc, mae, mse or a "
            "callable (output, target) -> scalar",
        ),
        (
            3,
            "metrics entry 3 is not a known metric; valid: accuracy, acc, mae, mse or a "
            "callable (output, target) -> scalar",
        ),
    ],
)
def test_a_bad_metric_names_the_entry_and_the_valid_ones(metric, message):
    with pytest.raises(mp.ArgumentError) as caught:
        get_metric(metric)
    assert str(caught.value) == message
    # One class for every bad argument: caught as ValueError or as TypeError alike.
    assert isinstance(caught.value, ValueError) and isinstance(caught.value, TypeError)


@pytest.mark.parametrize(
    ("loss", "message"),
    [
        (
            "crossentropy",
            f"loss='crossentropy' is not a known loss; valid: {LOSS_NAMES} or a callable "
            "(output, target) -> scalar (closest: 'cross_entropy')",
        ),
        (
            "hinge",
            f"loss='hinge' is not a known loss; valid: {LOSS_NAMES} or a callable "
            "(output, target) -> scalar",
        ),
        (
            None,
            f"loss=None is not a known loss; valid: {LOSS_NAMES} or a callable "
            "(output, target) -> scalar",
        ),
    ],
)
def test_a_bad_loss_names_the_argument_and_the_valid_ones(loss, message):
    with pytest.raises(mp.ArgumentError) as caught:
        get_loss(loss)
    assert str(caught.value) == message
    assert isinstance(caught.value, ValueError) and isinstance(caught.value, TypeError)


def test_a_bad_name_fails_when_the_trainer_is_built():
    model = nn.Linear(4, 3)
    optimizer = torch.optim.SGD(model.parameters(), 0.1)
    with pytest.raises(mp.ArgumentError, match=r"^loss='hinge' is not a known loss"):
        mp.Trainer(model, "hinge", optimizer, device="cpu")
    with pytest.raises(mp.ArgumentError, match=r"^metrics entry 'f1' is not a known metric"):
        mp.Trainer(model, "cross_entropy", optimizer, metrics=["f1"], device="cpu")


# -- values, against a hand computation -------------------------------------------------------


def test_accuracy_of_class_scores_is_the_share_of_argmax_hits():
    output = torch.tensor([[2.0, 1.0, 0.0], [0.0, 3.0, 1.0], [1.0, 0.0, 5.0], [4.0, 0.0, 1.0]])
    target = torch.tensor([0, 1, 1, 2])  # argmax: 0, 1, 2, 0 -> two hits in four
    value = get_metric("accuracy")[1](output, target)
    assert value.dtype == torch.float32
    assert value.item() == 0.5


def test_accuracy_of_one_logit_counts_logit_above_zero_as_class_one():
    output = torch.tensor([2.5, -1.0, 0.0, 0.3, -0.2])  # predicted: 1, 0, 0, 1, 0
    assert get_metric("acc")[1](output, torch.tensor([1, 0, 1, 1, 1])).item() == pytest.approx(0.6)
    floats = torch.tensor([1.0, 0.0, 1.0, 0.0, 0.0])  # float targets: the 1st, 2nd, 5th hit
    assert get_metric("accuracy")[1](output, floats).item() == pytest.approx(0.6)


def test_mae_and_mse_by_hand():
    output = torch.tensor([1.0, -2.0, 0.5, 3.0])
    target = torch.tensor([0, 0, 1, 1])  # integer targets are compared as float
    # |1| + |-2| + |-0.5| + |2| = 5.5 over 4; 1 + 4 + 0.25 + 4 = 9.25 over 4
    assert get_metric("mae")[1](output, target).item() == 5.5 / 4
    assert get_metric("mse")[1](output, target).item() == 9.25 / 4
    # A 16-bit output is measured in float32.
    half = get_metric("mse")[1](output.to(torch.bfloat16), target)
    assert half.dtype == torch.float32 and half.item() == 9.25 / 4


def test_losses_by_hand():
    logits = torch.tensor([[1.0, 2.0, 0.0], [0.5, 0.5, 3.0]])
    labels = torch.tensor([1, 0])

    def nll(row: list[float], label: int) -> float:
        return -(row[label] - math.log(sum(math.exp(v) for v in row)))

    expected = (nll([1.0, 2.0, 0.0], 1) + nll([0.5, 0.5, 3.0], 0)) / 2
    for name in ("cross_entropy", "sparse_categorical_crossentropy"):
        assert get_loss(name)(logits, labels).item() == pytest.approx(expected, rel=1e-6)

    output, target = torch.tensor([1.0, -2.0, 0.5]), torch.tensor([0.0, 0.0, 1.0])
    assert get_loss("mse")(output, target).item() == pytest.approx((1 + 4 + 0.25) / 3)
    assert get_loss("mean_squared_error")(output, target).item() == pytest.approx(5.25 / 3)
    assert get_loss("mae")(output, target).item() == pytest.approx((1 + 2 + 0.5) / 3)


def test_binary_crossentropy_takes_logits_and_integer_targets():
    logits = torch.tensor([2.0, -1.0, 0.0])
    targets = torch.tensor([1, 0, 1])  # cast to the logits' dtype

    def sigmoid(z: float) -> float:
        return 1 / (1 + math.exp(-z))

    expected = -(math.log(sigmoid(2.0)) + math.log(1 - sigmoid(-1.0)) + math.log(sigmoid(0.0))) / 3
    loss = get_loss("binary_crossentropy")(logits, targets)
    assert loss.dtype == torch.float32
    assert loss.item() == pytest.approx(expected, rel=1e-6)


def test_accuracy_of_one_logit_column_against_flat_targets_thresholds_it():
    # (N, 1) against (N,): the argmax over one column was always 0, so "accuracy" was the
    # share of label 0.
    output = torch.tensor([[2.5], [-1.0], [0.0], [0.3], [-0.2]])  # predicted: 1, 0, 0, 1, 0
    target = torch.tensor([1.0, 0.0, 0.0, 1.0, 1.0])  # four hits in five; label 0: 2 in 5
    assert get_metric("accuracy")[1](output, target).item() == pytest.approx(0.8)


def test_accuracy_leaves_out_labels_of_minus_100_as_cross_entropy_does():
    output = torch.tensor([[2.0, 0.0], [0.0, 3.0], [1.0, 0.0], [0.0, 1.0]])  # argmax 0, 1, 0, 1
    target = torch.tensor([0, 1, -100, 0])  # two hits in the three real labels
    assert get_metric("accuracy")[1](output, target).item() == pytest.approx(2 / 3)
    padding = torch.full((4,), -100)
    assert get_metric("accuracy")[1](output, padding).item() == 0.0


def test_metric_names_that_would_overwrite_each_other_are_refused():
    get_metrics = metrics.get_metrics
    with pytest.raises(mp.ArgumentError, match="two metrics are named '<lambda>'"):
        get_metrics([lambda o, t: o.mean(), lambda o, t: t.float().mean()])
    with pytest.raises(mp.ArgumentError, match="a metric named 'loss' would overwrite"):
        get_metrics({"loss": "mae"})
    with pytest.raises(mp.ArgumentError, match="named 'val_top5' would overwrite"):
        get_metrics({"val_top5": "mae"})
    with pytest.raises(mp.ArgumentError, match="two metrics are named 'accuracy'"):
        get_metrics(["acc", "accuracy"])
    assert list(get_metrics("mae")) == ["mae"]  # one name, not its letters
    named = get_metrics({"mean_out": lambda o, t: o.mean(), "mean_target": "mse"})
    assert list(named) == ["mean_out", "mean_target"] and named["mean_target"] is metrics.mse


@pytest.mark.parametrize(
    "loss",
    [nn.CrossEntropyLoss(), mp.cross_entropy, F.cross_entropy, "cross_entropy"],
    ids=["module", "mixprec", "functional", "name"],
)
def test_padding_labels_pass_the_check_for_each_cross_entropy(loss):
    # Only F.cross_entropy was known: nn.CrossEntropyLoss's -100 was refused as out of range.
    torch.manual_seed(0)
    model = nn.Linear(4, 3)
    trainer = mp.Trainer(model, loss, torch.optim.SGD(model.parameters(), 0.1), device="cpu")
    x, y = torch.randn(16, 4), torch.randint(0, 3, (16,))
    y[::4] = -100
    history = trainer.fit(x, y, epochs=1, batch_size=8, verbose=0)
    assert math.isfinite(history.history["loss"][0])
    bad = y.clone()
    bad[1] = 3
    with pytest.raises(ValueError, match="valid labels"):
        trainer.fit(x, bad, epochs=1, batch_size=8, verbose=0)
    assert metrics.ignore_index_of(nn.CrossEntropyLoss(ignore_index=0)) == 0
    assert metrics.ignore_index_of(nn.MSELoss()) is None


# -- habits from Keras and from other losses --------------------------------------------------


def _tagger_data(pad: int):
    """Sequences of 12 with the first 7 positions padding (label ``pad``): (x, y)."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 12, 8, generator=g)
    y = torch.randint(1, 4, (64, 12), generator=g)
    y[:, :7] = pad
    return x, y


def test_accuracy_leaves_out_the_labels_the_loss_leaves_out():
    """ignore_index=0 on the loss: accuracy scored the padded positions too (0.128 logged
    where the labels the loss uses gave 0.376)."""
    x, y = _tagger_data(pad=0)
    model = nn.Linear(8, 4)
    loss = functools.partial(mp.cross_entropy, ignore_index=0)
    trainer = mp.Trainer(model, loss, torch.optim.SGD(model.parameters(), lr=0.1),
                         policy="float32", device="cpu", metrics=["accuracy"])  # fmt: skip
    with torch.no_grad():
        out = model(x)
    kept = y != 0
    expected = ((out.argmax(-1) == y) & kept).sum() / kept.sum()
    got = trainer.evaluate(x, y, batch_size=64)["accuracy"]
    assert got == pytest.approx(expected.item(), abs=1e-6)


@pytest.mark.parametrize("batch_size", [4, 8])
def test_padded_batches_are_weighted_by_the_labels_they_keep(batch_size):
    """Each batch's mean is over its kept labels, and the epoch's and an evaluation's means
    weighted batches by rows: 0.083 at batch 4 and 0.143 at batch 8 for the same model,
    fit's history too. Now both give the token-level figures computed by hand."""
    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, 8, (8, 6), generator=g)
    y = (x + 1) % 8
    y[:4, 1:] = -100  # the first 4 rows: one real label each
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(8, 16), nn.Linear(16, 8))
    trainer = mp.Trainer(model, mp.cross_entropy, torch.optim.SGD(model.parameters(), lr=0.0),
                         policy="float32", device="cpu", metrics=["accuracy"])  # fmt: skip
    with torch.no_grad():
        out = model(x)
    kept = y != -100
    hits = ((out.argmax(-1) == y) & kept).sum() / kept.sum()
    loss = F.cross_entropy(out.reshape(-1, 8), y.reshape(-1))
    got = trainer.evaluate(x, y, batch_size=batch_size)
    assert got["accuracy"] == pytest.approx(hits.item(), abs=1e-6)
    assert got["loss"] == pytest.approx(loss.item(), abs=1e-5)
    history = trainer.fit(x, y, batch_size=batch_size, epochs=1, shuffle=False, verbose=0)
    assert history.history["accuracy"][0] == pytest.approx(hits.item(), abs=1e-6)


def test_accuracy_under_torchs_cross_entropy_reads_classes_on_dim_1():
    """A Conv1d tagger's (N, C, L) outputs under F.cross_entropy: the argmax over the last
    dim compared positions with labels (0.19 for 0.15 where C = L, unsaid; a raw shape
    error where C != L)."""
    g = torch.Generator().manual_seed(2)
    for classes, length in ((6, 6), (5, 7)):
        x = torch.randn(16, 3, length, generator=g)
        y = torch.randint(0, classes, (16, length), generator=g)
        model = nn.Conv1d(3, classes, 1)
        trainer = mp.Trainer(model, "cross_entropy", torch.optim.SGD(model.parameters()),
                             policy="float32", device="cpu", metrics=["accuracy"])  # fmt: skip
        with torch.no_grad():
            expected = (model(x).argmax(1) == y).float().mean().item()
        assert trainer.evaluate(x, y, batch_size=16)["accuracy"] == pytest.approx(expected)


def test_accuracy_of_probability_targets_under_cross_entropy_compares_argmaxes():
    """One-hot (or mixup) targets with cross-entropy: accuracy compared them class by
    class as a one-logit output (0.491 for an untrained model whose true accuracy was
    0.164)."""
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(128, 8, generator=g), torch.randint(0, 6, (128,), generator=g)
    model = nn.Linear(8, 6)
    trainer = mp.Trainer(model, "cross_entropy", torch.optim.SGD(model.parameters(), lr=0.1),
                         policy="float32", device="cpu", metrics=["accuracy"])  # fmt: skip
    with torch.no_grad():
        expected = (model(x).argmax(-1) == y).float().mean().item()
    onehot = DataLoader(TensorDataset(x, F.one_hot(y, 6).float()), batch_size=128)
    assert trainer.evaluate(onehot)["accuracy"] == pytest.approx(expected)
    # Multi-label targets under a binary loss are still scored element by element.
    multi = (torch.rand(8, 6, generator=g) > 0.5).float()
    logits = torch.randn(8, 6, generator=g)
    assert metrics.accuracy(logits, multi) == ((logits > 0).float() == multi).float().mean()


def test_a_metric_returned_in_16_bits_is_summed_in_float32():
    """A custom metric returning bfloat16 was summed over the epoch in bfloat16 (0.926
    logged for 0.821)."""
    g = torch.Generator().manual_seed(2)
    x, y = torch.randn(8192, 8, generator=g), torch.randint(0, 4, (8192,), generator=g)
    model = nn.Linear(8, 4)

    def acc16(o, t):
        return (o.argmax(-1) == t).to(torch.bfloat16).mean()

    trainer = mp.Trainer(model, "cross_entropy", torch.optim.SGD(model.parameters(), lr=0.0),
                         policy="float32", device="cpu", metrics={"acc16": acc16})  # fmt: skip
    history = trainer.fit(x, y, batch_size=32, epochs=1, verbose=0, shuffle=False)
    with torch.no_grad():
        expected = (model(x).argmax(-1) == y).float().mean().item()
    assert history.history["acc16"][0] == pytest.approx(expected, abs=1e-5)


def test_batches_with_a_third_element_say_it_is_not_used():
    """(x, y, sample_weight) batches: the weights were dropped without a word."""
    batches._SAID_EXTRA.clear()
    g = torch.Generator().manual_seed(3)
    x, y = torch.randn(32, 8, generator=g), torch.randint(0, 4, (32,), generator=g)
    loader = DataLoader(TensorDataset(x, y, torch.rand(32, generator=g)), batch_size=8)
    model = nn.Linear(8, 4)
    trainer = mp.Trainer(model, "cross_entropy", torch.optim.SGD(model.parameters(), lr=0.1),
                         policy="float32", device="cpu", metrics=())  # fmt: skip
    with pytest.warns(UserWarning, match=r"a batch has 3 elements: .*sample weights.* have "
                      r"the loader yield \(x, \(y, w\)\), .* and metrics=\(\)"):  # fmt: skip
        trainer.fit(loader, epochs=1, verbose=0)


def test_weighted_targets_as_the_warning_says_train_and_count_their_rows():
    """Followed as written, (x, (y, w)) with a loss reading both and metrics=() trains as
    weighted float32 does; the epoch counted 2 samples a batch (the pair), so the last,
    shorter batch weighed as much as a full one and samples_per_s was 1/4 of the truth."""
    g = torch.Generator().manual_seed(3)
    x, y = torch.randn(36, 8, generator=g), torch.randint(0, 4, (36,), generator=g)
    w = torch.rand(36, generator=g)

    def weighted(out, targets):
        labels, weights = targets
        return (F.cross_entropy(out, labels, reduction="none") * weights).sum() / weights.sum()

    pairs = [(x[i], (y[i], w[i])) for i in range(36)]
    torch.manual_seed(0)
    model = nn.Linear(8, 4)
    control = copy.deepcopy(model)
    trainer = mp.Trainer(model, weighted, torch.optim.SGD(model.parameters(), lr=0.1),
                         policy="float32", device="cpu", metrics=())  # fmt: skip
    history = trainer.fit(DataLoader(pairs, batch_size=8), epochs=1, verbose=0)
    opt, losses = torch.optim.SGD(control.parameters(), lr=0.1), []
    for xb, (yb, wb) in DataLoader(pairs, batch_size=8):
        opt.zero_grad()
        loss = weighted(control(xb), (yb, wb))
        loss.backward()
        opt.step()
        losses.append((loss.item(), len(yb)))
    for a, b in zip(model.parameters(), control.parameters(), strict=True):
        assert torch.allclose(a, b, atol=1e-6)
    mean = sum(v * n for v, n in losses) / 36  # rows weigh each batch: 8, 8, 8, 8 and 4
    assert history.history["loss"][0] == pytest.approx(mean, rel=1e-6)
    # A list of one target per sample (a custom collate) still counts its items: batches
    # of 8 and 2 weigh 8 and 2 (a first version counted the first item's 1 row).
    seen = []

    def per_sample(out, targets):
        loss = ((out - torch.stack(list(targets))) ** 2).mean()
        seen.append((len(targets), loss.item()))
        return loss

    listed = [(torch.randn(n, 4), [torch.randn(1) for _ in range(n)]) for n in (8, 2)]
    torch.manual_seed(0)
    model = nn.Linear(4, 1)
    trainer = mp.Trainer(model, per_sample, torch.optim.SGD(model.parameters(), lr=0.1),
                         policy="float32", device="cpu", metrics=())  # fmt: skip
    history = trainer.fit(listed, epochs=1, verbose=0)
    mean = sum(n * v for n, v in seen) / 10
    assert history.history["loss"][0] == pytest.approx(mean, rel=1e-6)


@pytest.mark.parametrize(
    ("last", "loss"),
    [(nn.Softmax(-1), "sparse_categorical_crossentropy"), (nn.Softmax(-1), nn.CrossEntropyLoss()),
     (nn.Sigmoid(), "binary_crossentropy")],
)  # fmt: skip
def test_a_probability_output_under_a_logits_loss_is_said(last, loss):
    """Keras' habit (probability outputs, losses with from_logits=False): the softmax or
    sigmoid was applied twice, and accuracy of sigmoid outputs read 0.465 (every
    probability > 0) where the model was 0.785 right."""
    model = nn.Sequential(nn.Linear(8, 4 if isinstance(last, nn.Softmax) else 1), last)
    with pytest.warns(
        UserWarning, match=r"the model ends in nn\.(Softmax|Sigmoid) .*applied twice"
    ):
        mp.Trainer(model, loss, torch.optim.SGD(model.parameters(), lr=0.1),
                   policy="float32", device="cpu")  # fmt: skip
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        plain = nn.Sequential(nn.Linear(8, 4))
        mp.Trainer(plain, loss, torch.optim.SGD(plain.parameters(), lr=0.1),
                   policy="float32", device="cpu")  # fmt: skip


def test_probability_targets_of_several_positions_compare_along_the_class_dimension():
    """(N, C, L) logits with one-hot (N, C, L) targets, torch's layout: the argmax was taken
    over the last dimension (0.4167 for a model always right)."""
    g = torch.Generator().manual_seed(4)
    labels = torch.randint(0, 3, (4, 6), generator=g)
    onehot = F.one_hot(labels, 3).permute(0, 2, 1).float()  # (N, C, L)
    logits = onehot * 5.0
    assert metrics.accuracy(logits, onehot, categorical=True) == 1.0


def test_a_batch_given_as_a_mapping_is_refused_naming_the_pairs_it_takes():
    loader = [{"x": torch.randn(4, 8), "y": torch.zeros(4, dtype=torch.long), "mask": None}]
    model = nn.Linear(8, 4)
    trainer = mp.Trainer(model, "cross_entropy", torch.optim.SGD(model.parameters(), lr=0.1),
                         policy="float32", device="cpu", metrics=())  # fmt: skip
    with pytest.raises(mp.ArgumentError, match=r"a batch is a mapping \('x', 'y', 'mask'\)"):
        trainer.fit(loader, epochs=1, verbose=0)


def test_the_batch_weights_are_chosen_once_from_the_whole_data(monkeypatch):
    """``counted`` reduced and read each training step's labels (on CUDA a synchronisation
    a step) where no label is padding, which ``fit`` knows from its data up front: the
    weights are then the label counts, and the epoch's mean is the same."""
    y = torch.randint(0, 3, (16, 5))
    assert metrics.weigh_for(F.cross_entropy, y) is torch.Tensor.numel
    assert metrics.weigh_for(F.cross_entropy, y)(y[:4]) == metrics.counted(F.cross_entropy, y[:4])
    padded = y.clone()
    padded[0, 0] = -100
    for loss_fn, targets in ((F.cross_entropy, padded), (F.cross_entropy, None),
                             (nn.MSELoss(), y.float())):  # fmt: skip
        weigh = metrics.weigh_for(loss_fn, targets)
        assert isinstance(weigh, functools.partial) and weigh.func is metrics.counted
    assert metrics.weigh_for(F.cross_entropy, padded)(padded[:4]) == 19

    def no_count(loss_fn, targets):
        raise AssertionError("counted was called for data without padding")

    monkeypatch.setattr(metrics, "counted", no_count)
    monkeypatch.setattr(trainer_module, "counted", no_count, raising=False)
    torch.manual_seed(0)
    model = nn.Linear(4, 3)
    trainer = mp.Trainer(model, "cross_entropy", torch.optim.SGD(model.parameters(), lr=0.0),
                         policy="float32", device="cpu", metrics=())  # fmt: skip
    x, labels = torch.randn(12, 4), torch.randint(0, 3, (12,))
    history = trainer.fit(x, labels, batch_size=8, epochs=1, shuffle=False, verbose=0)
    with torch.no_grad():  # batches of 8 and 4, weighted by their rows
        first = F.cross_entropy(model(x[:8]), labels[:8])
        last = F.cross_entropy(model(x[8:]), labels[8:])
    expected = (8 * first + 4 * last) / 12
    assert history.history["loss"][0] == pytest.approx(expected.item(), rel=1e-6)
