"""Callbacks: the order and content of the logs, and each callback's output."""

from __future__ import annotations

import csv
import io
import math

import pytest
import torch
from torch import nn

import mixprec as mp
from tests.conftest import classification_data, make_mlp


def trainer(policy="mixed_bfloat16"):
    model = make_mlp()
    return mp.Trainer(
        model, "cross_entropy", torch.optim.Adam(model.parameters(), lr=3e-3), policy=policy,
        device="cpu",
    )  # fmt: skip


class Recorder(mp.Callback):
    def __init__(self) -> None:
        self.events: list[tuple] = []

    def on_train_begin(self, logs):
        self.events.append(("train_begin", dict(logs)))

    def on_epoch_begin(self, epoch, logs):
        self.events.append(("epoch_begin", epoch))

    def on_train_batch_end(self, step, logs):
        self.events.append(("batch_end", step, dict(logs)))

    def on_epoch_end(self, epoch, logs):
        self.events.append(("epoch_end", epoch, dict(logs)))

    def on_train_end(self, logs):
        self.events.append(("train_end",))


def test_order_and_content_of_logs():
    x, y = classification_data(n=96)
    rec = Recorder()
    trainer().fit(x, y, batch_size=32, epochs=2, validation_split=1 / 3, callbacks=[rec],
                  verbose=0)  # fmt: skip
    kinds = [e[0] for e in rec.events]
    assert kinds == ["train_begin"] + ["epoch_begin", "batch_end", "batch_end", "epoch_end"] * 2 + [
        "train_end"
    ]
    assert rec.events[0][1] == {"epochs": 2, "steps": 2, "initial_epoch": 0}
    batch = rec.events[2][2]
    assert set(batch) == {"epoch", "loss", "applied", "found_inf", "loss_scale", "step_ms",
                          "size", "global_step", "overflow"}  # fmt: skip
    assert batch["applied"] and batch["global_step"] == 1 and batch["size"] == 32
    epoch_logs = rec.events[4][2]
    assert list(epoch_logs) == [
        "loss", "accuracy", "ms_per_step", "samples_per_s", "loss_scale", "skipped_steps",
        "val_loss", "val_accuracy",
    ]  # fmt: skip
    assert rec.events[-2][2]["loss"] == pytest.approx(
        sum(e[2]["loss"] for e in rec.events[6:8]) / 2
    )


def test_csv_logger(tmp_path):
    x, y = classification_data(n=64)
    path = tmp_path / "logs" / "train.csv"
    trainer().fit(x, y, epochs=3, callbacks=[mp.CSVLogger(path)], verbose=0)
    rows = list(csv.reader(path.open()))
    assert rows[0][:3] == ["epoch", "loss", "accuracy"]
    assert [r[0] for r in rows[1:]] == ["0", "1", "2"]
    assert float(rows[3][1]) < float(rows[1][1])


def test_tensorboard_writes_events(tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    x, y = classification_data(n=64)
    trainer("mixed_float16").fit(x, y, epochs=2, callbacks=[mp.TensorBoard(tmp_path)], verbose=0)
    acc = EventAccumulator(str(tmp_path))
    acc.Reload()
    tags = set(acc.Tags()["scalars"])
    assert {"train/loss", "train/loss_scale", "train/skipped_steps", "train/step_ms"} <= tags
    assert {"epoch/loss", "epoch/accuracy"} <= tags
    assert len(acc.Scalars("train/loss")) == 4
    assert acc.Scalars("train/loss_scale")[0].value == 2.0**16


def test_tensorboard_closes_the_writer_a_fit_that_raised_left_open(tmp_path):
    """Each fit interrupted (Ctrl-C in a notebook) left its SummaryWriter and the writer's
    thread running: 1 thread more per fit."""
    pytest.importorskip("tensorboard")
    import threading

    class Raises(mp.Callback):
        def on_train_batch_end(self, step, logs):
            raise KeyboardInterrupt

    x, y = classification_data(n=64)
    board = mp.TensorBoard(tmp_path)
    before = threading.active_count()
    for _ in range(3):
        with pytest.raises(KeyboardInterrupt):
            trainer().fit(x, y, epochs=1, callbacks=[board, Raises()], verbose=0)
    assert threading.active_count() - before <= 1  # the last fit's writer alone
    trainer().fit(x, y, epochs=1, callbacks=[board], verbose=0)
    assert threading.active_count() == before


def _model_tensors(path):
    tensors, _ = mp.read_checkpoint(path)
    return {k: v for k, v in tensors.items() if k.startswith("model/")}


@pytest.mark.parametrize("stops", [True, False])
def test_early_stopping_restores_the_best_weights_alone_at_the_end(tmp_path, stops):
    # The weights alone, as Keras' get_weights: the step count, the optimizer and the
    # schedule go on; the float32 masters come back with the O2 weights; and the best
    # epoch's weights are back also when fit reaches its epochs first (as Keras 3).
    x, y = classification_data(n=128)
    t = trainer()
    schedule = mp.LearningRateScheduler(torch.optim.lr_scheduler.StepLR(t.optimizer, 1, 0.5))
    stop = mp.EarlyStopping(
        monitor="val_loss", patience=1 if stops else 10, restore_best_weights=True,
        min_delta=10.0,
    )  # fmt: skip  # no epoch improves by 10: epoch 0 stays the best, stopping after 2
    best = mp.ModelCheckpoint(tmp_path, every_n_epochs=1, keep_last=5, monitor="val_loss")
    best.best = float("inf")
    history = t.fit(
        x, y, epochs=3, validation_split=0.25, callbacks=[schedule, stop, best], verbose=0
    )
    epochs = len(history.epoch)
    assert epochs == (2 if stops else 3) and stop.stopped_epoch == (1 if stops else None)
    assert t.global_step == 3 * epochs  # 96 samples in batches of 32: the steps taken stand
    assert t.optimizer.param_groups[0]["lr"] == pytest.approx(3e-3 * 0.5 ** (3 * epochs))
    first = _model_tensors(tmp_path / "epoch-0001.safetensors")  # with the masters
    last = _model_tensors(tmp_path / f"epoch-{epochs:04d}.safetensors")
    assert any(not torch.equal(first[k], last[k]) for k in first)  # trained on after it
    saved = mp.save_checkpoint(tmp_path / "after.safetensors", t.model, t.optimizer)
    after = _model_tensors(saved)
    assert all(torch.equal(after[k], first[k]) for k in first)  # float32 digits included
    assert all(m.dtype == torch.float32 for m in t.optimizer.master_params())


def test_monitor_modes_auto_by_name_and_refused_when_the_name_says_nothing():
    assert mp.EarlyStopping("val_accuracy").mode == "max"
    assert mp.EarlyStopping("val_loss").mode == mp.EarlyStopping("mse").mode == "min"
    assert mp.ModelCheckpoint("unused", monitor="val_mae").mode == "min"
    for make in (mp.EarlyStopping, lambda m, mode: mp.ModelCheckpoint("unused", None, 1, 1, m,
                                                                      mode)):  # fmt: skip
        with pytest.raises(mp.ArgumentError, match=r"monitor='val_f1', mode='auto'.*mode='max'"):
            make("val_f1", mode="auto")
        assert make("val_f1", mode="max").mode == "max"


def test_model_checkpoint_keeps_last_and_best(tmp_path):
    x, y = classification_data(n=64)
    t = trainer()
    ckpt = mp.ModelCheckpoint(tmp_path, every_n_epochs=1, keep_last=2, monitor="loss")
    t.fit(x, y, epochs=4, callbacks=[ckpt], verbose=0)
    names = sorted(p.name for p in tmp_path.iterdir())
    assert names == ["best.safetensors", "epoch-0003.safetensors", "epoch-0004.safetensors"]
    fresh = trainer()
    report = mp.load_checkpoint(tmp_path / "epoch-0004.safetensors", fresh.model, fresh.optimizer)
    assert report.trainer_state["global_step"] == t.global_step == 8
    for a, b in zip(t.model.parameters(), fresh.model.parameters(), strict=True):
        assert torch.equal(a, b)
    steps = mp.ModelCheckpoint(tmp_path / "s", every_n_epochs=None, every_n_steps=3, keep_last=5)
    trainer().fit(x, y, epochs=2, callbacks=[steps], verbose=0)  # 4 steps
    assert sorted(p.name for p in (tmp_path / "s").iterdir()) == ["step-00000003.safetensors"]


def test_progress_bar_on_a_terminal():
    class Tty(io.StringIO):
        def isatty(self) -> bool:
            return True

    stream = Tty()
    x, y = classification_data(n=64)
    trainer().fit(x, y, epochs=1, callbacks=[mp.ProgressBar(stream)], verbose=0)
    text = stream.getvalue()
    assert "epoch 1/1" in text and "2/2" in text and "loss" in text


def test_progress_bar_of_a_resumed_epoch_counts_the_batches_done_before(tmp_path):
    """Resumed 3 batches into an epoch of 4, the bar ended at 1/4 (25%) on a terminal."""

    class Tty(io.StringIO):
        def isatty(self) -> bool:
            return True

    x, y = classification_data(n=128)  # 4 batches of 32 an epoch
    every = mp.ModelCheckpoint(tmp_path, every_n_epochs=None, every_n_steps=3)
    trainer().fit(x, y, epochs=1, callbacks=[every], verbose=0)
    stream = Tty()
    trainer().fit(x, y, epochs=1, callbacks=[mp.ProgressBar(stream)], verbose=0,
                  resume_from=tmp_path / "step-00000003.safetensors")  # fmt: skip
    last = stream.getvalue().replace("\r", "\n").strip().splitlines()[-1]
    assert "4/4" in last and "100%" in last


@pytest.mark.parametrize(("policy", "shown"), [("mixed_bfloat16", False), ("mixed_float16", True)])
def test_epoch_lines_show_the_loss_scale_only_when_scaling(policy, shown, capsys):
    x, y = classification_data(n=64)
    trainer(policy).fit(x, y, epochs=2, verbose=1)
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("epoch ")]
    assert len(lines) == 2
    assert all(("loss_scale" in line) is shown for line in lines)

    class Tty(io.StringIO):
        def isatty(self) -> bool:
            return True

    stream = Tty()
    trainer(policy).fit(x, y, epochs=1, callbacks=[mp.ProgressBar(stream)], verbose=0)
    assert ("scale=" in stream.getvalue()) is shown


def test_callback_argument_errors():
    with pytest.raises(ValueError, match="per_print_times=0 is invalid"):
        mp.LossMonitor(0)
    with pytest.raises(ValueError, match="interval='batch' is invalid"):
        mp.LearningRateScheduler(None, interval="batch")
    with pytest.raises(ValueError, match="decay=1.5 is invalid"):
        mp.EMA(1.5)
    with pytest.raises(ValueError, match="decay='0.99' is invalid; it must be a number"):
        mp.EMA("0.99")  # a bare TypeError from '<' before
    with pytest.raises(ValueError, match="mode='up' is invalid"):
        mp.EarlyStopping(mode="up")
    x, y = classification_data(n=32)
    with pytest.raises(TypeError, match="must be mixprec Callback instances, got str"):
        trainer().fit(x, y, callbacks=["csv"], verbose=0)  # type: ignore[list-item]
    with pytest.raises(RuntimeError, match="EMA is not attached to a Trainer"):
        mp.EMA().on_train_begin({})


def test_model_checkpoint_across_a_restart(tmp_path):
    """keep_last counts an earlier run's checkpoints; a killed save's temp file goes."""
    x, y = classification_data(n=64)
    first = trainer()
    first.fit(x, y, epochs=3, callbacks=[mp.ModelCheckpoint(tmp_path, keep_last=2)], verbose=0)
    stale = tmp_path / ".epoch-0004.safetensors.k1ll3d.tmp"  # as _atomic_write names them
    stale.write_bytes(b"half a checkpoint")
    again = trainer()
    again.fit(
        x, y, epochs=5, callbacks=[mp.ModelCheckpoint(tmp_path, keep_last=2)], verbose=0,
        resume_from=tmp_path / "epoch-0003.safetensors",
    )  # fmt: skip
    # keep_last=2 over both runs: the first run's epoch-0002 and epoch-0003 go, and the .tmp.
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "epoch-0004.safetensors",
        "epoch-0005.safetensors",
    ]


def test_checkpoint_mode_follows_the_umask(tmp_path):
    import os

    previous = os.umask(0o022)
    try:
        path = mp.save_checkpoint(tmp_path / "c.safetensors", make_mlp())
    finally:
        os.umask(previous)
    assert path.stat().st_mode & 0o777 == 0o644  # the umask's, not a fixed 0o600


def test_model_checkpoint_never_keeps_a_nan_epoch_as_best(tmp_path):
    """A first epoch whose validation is NaN (a float16 overflow in evaluation) was kept as
    the best, and no later value compares better than NaN."""

    class NanFirstEvaluation(mp.Callback):
        def on_epoch_begin(self, epoch: int, logs: dict) -> None:
            self.attached.model.nan_eval = epoch == 0

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.net, self.nan_eval = nn.Linear(32, 10), False

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            out = self.net(x)
            return out * float("nan") if self.nan_eval and not self.training else out

    x, y = classification_data(n=64)
    torch.manual_seed(0)
    model = Net()
    t = mp.Trainer(model, "cross_entropy", torch.optim.SGD(model.parameters(), 0.1), metrics=())
    ckpt = mp.ModelCheckpoint(tmp_path, every_n_epochs=None, monitor="val_loss")
    history = t.fit(x, y, batch_size=16, epochs=3, verbose=0, validation_data=(x, y),
                    callbacks=[NanFirstEvaluation(), ckpt])  # fmt: skip
    losses = history.history["val_loss"]
    assert math.isnan(losses[0]) and ckpt.best == min(losses[1:])


def test_a_failed_best_write_leaves_the_best_value_of_the_file(tmp_path, monkeypatch):
    """The disk full while epoch 2's best.safetensors was written: the callback had noted
    epoch 2's value as its best already, so a later fit compared against a value that no
    file held, and kept a worse epoch out."""

    class Seen(mp.Callback):
        def __init__(self) -> None:
            self.val_losses: list[float] = []

        def on_epoch_end(self, epoch: int, logs: dict) -> None:
            self.val_losses.append(logs["val_loss"])

    x, y = classification_data(n=64)
    torch.manual_seed(0)
    model = nn.Linear(32, 10)
    t = mp.Trainer(model, "cross_entropy", torch.optim.SGD(model.parameters(), 0.1), metrics=())
    ckpt, seen = mp.ModelCheckpoint(tmp_path, every_n_epochs=None, monitor="val_loss"), Seen()
    real, calls = ckpt._write, []

    def write(path):
        calls.append(path)
        if len(calls) == 2:
            raise OSError(28, "No space left on device", str(path))
        real(path)

    monkeypatch.setattr(ckpt, "_write", write)
    with pytest.raises(OSError, match="No space left"):
        t.fit(x, y, batch_size=16, epochs=3, verbose=0, validation_data=(x, y),
              callbacks=[seen, ckpt])  # fmt: skip
    first, second = seen.val_losses
    assert second < first and len(calls) == 2  # epoch 2 was better: its write failed
    assert ckpt.best == first  # what best.safetensors holds


def test_ema_copied_into_an_o2_model_is_what_evaluate_and_a_save_see(tmp_path):
    """The average applied with p.data.copy_ over model.parameters(): evaluate saw it, a
    save wrote the masters instead (0.182 apart). copy_to_model() writes the masters and
    their 16-bit weights, so both hold the float32 average."""
    x, y = classification_data(n=64)
    t = trainer()
    ema = mp.EMA(decay=0.9)
    t.fit(x, y, batch_size=16, epochs=2, verbose=0, callbacks=[ema])
    ema.copy_to_model()
    masters = dict(t.optimizer.master_weights())
    averages = dict(zip([id(p) for p in t.optimizer.master_params()], ema.shadow, strict=True))
    for weight, master in masters.items():
        assert torch.equal(master, averages[id(master)])
        assert torch.equal(weight, averages[id(master)].to(weight.dtype))
    path = mp.export_weights(t.model, tmp_path / "ema.safetensors", optimizer=t.optimizer)
    tensors, _ = mp.read_checkpoint(path)
    first = t.model[0].weight
    assert torch.equal(tensors["model/0.weight"], masters[first])  # the float32 average


def test_a_checkpoint_write_that_fails_after_another_callbacks_error_is_said(tmp_path, monkeypatch):
    """A callback raised at an epoch's end and ModelCheckpoint's write of that epoch
    failed too (disk full): the OSError was only the first error's __context__, unsaid."""
    import mixprec.checkpoint._files as files

    class Flaky(mp.Callback):
        def on_epoch_end(self, epoch, logs):
            if epoch == 1:
                raise ValueError("my callback failed")

    real = files.save_file

    def full(tensors, path, metadata=None):
        if "epoch-0002" in str(path):
            raise OSError(28, "No space left on device")
        return real(tensors, path, metadata)

    monkeypatch.setattr(files, "save_file", full)
    model = make_mlp()
    t = mp.Trainer(model, "cross_entropy", torch.optim.SGD(model.parameters(), 0.1),
                   policy="mixed_bfloat16", metrics=())  # fmt: skip
    x, y = classification_data(n=32)
    said = pytest.warns(UserWarning, match=r"a later callback raised too: OSError\(28")
    with said, pytest.raises(ValueError, match="my callback failed"):
        t.fit(x, y, batch_size=16, epochs=3, verbose=0,
              callbacks=[Flaky(), mp.ModelCheckpoint(tmp_path)])  # fmt: skip


def test_learning_rate_scheduler_refuses_reduce_lr_on_plateau_at_once():
    """Accepted, it failed after a whole epoch: step() missing 'metrics'."""
    model = make_mlp()
    opt = torch.optim.SGD(model.parameters(), 0.1)
    plateau = torch.optim.lr_scheduler.ReduceLROnPlateau(opt)
    with pytest.raises(ValueError, match=r"scheduler=ReduceLROnPlateau is invalid here.*"
                       r"scheduler\.step\(logs\['val_loss'\]\)"):  # fmt: skip
        mp.LearningRateScheduler(plateau)
