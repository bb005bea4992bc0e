"""Trainer: Keras-style fit/evaluate/predict, MindSpore-style train, build_train_step,
schedulers/EMA/step counter on applied steps only, data validation."""

from __future__ import annotations

import re

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


def test_keras_style_fit_evaluate_predict(capsys):
    x, y = classification_data(n=400)
    t = trainer()
    history = t.fit(x, y, batch_size=32, epochs=4, validation_split=0.2, verbose=1)
    h = history.history
    assert history.epoch == [0, 1, 2, 3]
    for key in ("loss", "accuracy", "val_loss", "val_accuracy", "ms_per_step",
                "samples_per_s", "loss_scale", "skipped_steps"):  # fmt: skip
        assert len(h[key]) == 4, key
    assert h["loss"][-1] < h["loss"][0]
    assert h["val_loss"][-1] < h["val_loss"][0] and h["val_accuracy"][-1] > 0.3  # chance: 0.1
    assert t.global_step == 4 * 10  # 320 training samples / 32
    out = capsys.readouterr().out  # not a terminal: one plain line per epoch
    assert len(re.findall(r"^epoch \d/4 - loss: ", out, flags=re.M)) == 4
    metrics = t.evaluate(x[320:], y[320:])
    assert set(metrics) == {"loss", "accuracy"}
    assert metrics["accuracy"] == pytest.approx(h["val_accuracy"][-1])
    pred = t.predict(x[:10])
    assert pred.dtype == torch.float32 and pred.shape == (10, 10)
    assert t.model[0].weight.dtype == torch.bfloat16  # the policy was applied (O2)


def test_mixed_tracks_float32_through_fit():
    x, y = classification_data(n=400)
    results = {}
    for policy in ("float32", "mixed_bfloat16"):
        torch.manual_seed(0)  # same shuffling
        t = trainer(policy)
        t.fit(x, y, batch_size=32, epochs=3, verbose=0)
        results[policy] = t.evaluate(x, y)
    # bfloat16 rounding over 36 steps: a few hundredths of loss at most (measured 0.003).
    assert abs(results["float32"]["loss"] - results["mixed_bfloat16"]["loss"]) < 0.05


def test_fit_on_a_dataloader_and_mindspore_train(capsys):
    x, y = classification_data(n=256)
    loader = DataLoader(TensorDataset(x, y), batch_size=32, shuffle=True)
    t = trainer()
    history = t.train(2, loader, callbacks=[mp.LossMonitor(4)])
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 4  # 8 steps per epoch, every 4th
    assert re.fullmatch(r"epoch: 1 step: 4, loss is \d\.\d{1,8}", lines[0])  # float32 digits
    assert lines[-1].startswith("epoch: 2 step: 8, loss is ")
    assert len(history.history["loss"]) == 2


def test_build_train_step_custom_loop():
    model = make_mlp()
    step = mp.build_train_step(
        model, torch.optim.SGD(model.parameters(), lr=0.1), nn.CrossEntropyLoss(),
        policy="mixed_float16", level="O2",
    )  # fmt: skip
    assert isinstance(step.optimizer.loss_scaler, mp.DynamicLossScaler)
    x, y = classification_data(n=64)
    losses = []
    for _ in range(20):
        loss, result = step(x, y)
        assert isinstance(result, mp.StepResult) and result.applied
        losses.append(loss.item())
    assert losses[-1] < losses[0]
    with pytest.raises(ValueError, match=r"already prepared with policy mixed_float16, level O2"):
        mp.build_train_step(model, torch.optim.SGD(model.parameters(), 0.1), "cross_entropy",
                            policy="mixed_bfloat16")  # fmt: skip
    again = mp.build_train_step(model, step.optimizer, "cross_entropy")  # reuse: fine
    assert again.optimizer is step.optimizer


def test_scheduler_ema_and_counter_skip_overflowing_steps():
    class Spiky(nn.Module):
        """Blows up the output (and so the gradients) on chosen calls."""

        def __init__(self) -> None:
            super().__init__()
            self.net = make_mlp()
            self.calls = 0

        def forward(self, x):
            self.calls += 1
            out = self.net(x)
            return out * float("inf") if self.calls in (3, 5) else out

    model = Spiky()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    t = mp.Trainer(model, "cross_entropy", opt, policy="mixed_float16", device="cpu")
    sched = torch.optim.lr_scheduler.StepLR(t.optimizer, step_size=1, gamma=0.5)
    ema = mp.EMA(decay=0.9)
    x, y = classification_data(n=32 * 6)
    # Forward call 1 is fit's validation probe (the number of classes); 3 and 5 are the
    # 2nd and 4th training steps.
    history = t.fit(x, y, batch_size=32, epochs=1, shuffle=False, verbose=0,
                    callbacks=[mp.LearningRateScheduler(sched), ema])  # fmt: skip
    assert history.history["skipped_steps"] == [2]
    assert t.global_step == 4 and ema.updates == 4
    assert t.optimizer.param_groups[0]["lr"] == pytest.approx(0.1 * 0.5**4)


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


def test_bad_arguments():
    t = trainer()
    x, y = classification_data(n=64)
    with pytest.raises(ValueError, match="epochs=-1 is invalid"):
        t.fit(x, y, epochs=-1)
    with pytest.raises(ValueError, match=r"validation_split=1.5 is invalid"):
        t.fit(x, y, validation_split=1.5)
    with pytest.raises(ValueError, match="batch_size=0 is invalid"):
        t.fit(x, y, batch_size=0)
    with pytest.raises(ValueError, match="y is missing"):
        t.fit(x)
    with pytest.raises(ValueError, match=r"loss='crossentropy' is not a known loss.*closest"):
        mp.Trainer(make_mlp(), "crossentropy", torch.optim.SGD(make_mlp().parameters(), 0.1))
    with pytest.raises(ValueError, match=r"metrics entry 'f1' is not a known metric"):
        trainer(metrics=["f1"])
    with pytest.raises(TypeError, match="needs an nn.Module, got str"):
        mp.Trainer("mlp", "mse", torch.optim.SGD(make_mlp().parameters(), 0.1))  # type: ignore[arg-type]


def test_state_dict_round_trip():
    x, y = classification_data(n=128)
    t = trainer("mixed_float16")
    t.fit(x, y, epochs=1, verbose=0)
    state = t.state_dict()
    t2 = trainer("mixed_float16")
    t2.load_state_dict(state)
    assert t2.global_step == t.global_step
    for a, b in zip(t.model.parameters(), t2.model.parameters(), strict=True):
        assert torch.equal(a, b)


def test_evaluate_and_predict_from_a_callback_leave_the_model_training():
    """Issue 15 item 8: evaluate() called from a callback left the model in eval mode (dropout
    off) for the rest of the epoch."""
    x, y = classification_data(n=64)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 32), nn.Dropout(0.5), nn.Linear(32, 10))
    trainer = mp.Trainer(model, "cross_entropy", torch.optim.SGD(model.parameters(), lr=0.1),
                         "mixed_bfloat16")  # fmt: skip
    seen = []

    class Probe(mp.Callback):
        def on_train_batch_end(self, step, logs):
            self.attached.evaluate(x[:8], y[:8])
            self.attached.predict(x[:8])
            seen.append(model.training)

    trainer.fit(x, y, batch_size=16, epochs=1, callbacks=[Probe()], verbose=0)
    assert seen == [True] * 4
    model.eval()
    trainer.evaluate(x, y)
    assert not model.training  # and a model in eval mode stays so


# -- batches a loader gets wrong (issue 15 item 8) -----------------------------------------


def _small_trainer() -> mp.Trainer:
    torch.manual_seed(0)
    model = nn.Linear(8, 3)
    return mp.Trainer(model, "cross_entropy", torch.optim.SGD(model.parameters(), 0.1))


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
    trainer = _small_trainer()
    loader = DataLoader(TensorDataset(x, y), batch_size=8)
    with pytest.raises(ValueError, match=r"epoch 1, batch 4: Target 7 is out of bounds"):
        trainer.fit(loader, epochs=1, verbose=0)


def test_rank_agreement_reads_loaders_without_a_length(monkeypatch):
    # Review: the rank check called len() on a loader over an IterableDataset (TypeError)
    # and refused a validation loader that fit() accepts.
    from mixprec import distributed
    from mixprec.train import trainer as trainer_module

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
    trainer_module.Trainer._check_ranks_agree(loader, None, 32, 2, (listed, None))
    assert seen == [{"samples_or_batches": -1, "batch_size": -1, "epochs": 2,
                     "validation_samples": 4}]  # fmt: skip
