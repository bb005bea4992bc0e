"""A resumed ``fit`` goes on as if never stopped: the batch order of a shuffling loader, the
callbacks' state (schedulers, EMA, best values, CSV rows, TensorBoard steps), the epoch's
end when the checkpoint came on its last batch. And the Trainer's smaller promises: the
validation data it was given, empty batches, shapes, arguments."""

from __future__ import annotations

import csv
import math
import warnings

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, IterableDataset, TensorDataset

import mixprec as mp
from tests.conftest import Interrupt


class EpochEnds(mp.Callback):
    def __init__(self) -> None:
        self.epochs: list[int] = []

    def on_epoch_end(self, epoch, logs):
        self.epochs.append(epoch)


def data(n: int = 64):
    g = torch.Generator().manual_seed(1)
    return torch.randn(n, 8, generator=g), torch.randint(0, 4, (n,), generator=g)


def trainer(policy: str = "float32", lr: float = 0.1) -> mp.Trainer:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Dropout(0.1), nn.Linear(16, 4))
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    return mp.Trainer(model, "cross_entropy", opt, policy=policy, device="cpu", metrics=())


def weights(t: mp.Trainer) -> torch.Tensor:
    return torch.cat([p.detach().float().flatten() for p in t.model.parameters()])


def interrupted_then_resumed(tmp_path, make_callbacks, fit_args, after: int):
    """(uninterrupted trainer and callbacks, resumed trainer and callbacks): the same run
    twice, the second stopped after step ``after`` (checkpointed there) and resumed.
    ``make_callbacks(trainer)`` gives a run's callbacks; ``fit_args()`` its data."""

    def run(resume=None, extra=()):
        t = trainer()
        cbs = make_callbacks(t)
        t.fit(*fit_args(), callbacks=[*cbs, *extra], verbose=0, resume_from=resume)
        return t, cbs

    torch.manual_seed(123)
    full = run()
    torch.manual_seed(123)
    saver = mp.ModelCheckpoint(tmp_path, every_n_epochs=None, every_n_steps=after)
    with pytest.raises(KeyboardInterrupt):
        run(extra=[saver, Interrupt(after)])
    torch.manual_seed(999)  # a fresh process would not share the RNG: the checkpoint sets it
    resumed = run(resume=tmp_path / f"step-{after:08d}.safetensors", extra=[saver])
    return full, resumed


def test_a_shuffling_dataloader_resumes_in_the_same_order(tmp_path):
    x, y = data()

    def fit_args():
        return DataLoader(TensorDataset(x, y), batch_size=8, shuffle=True), None, 32, 2

    (full, _), (resumed, _) = interrupted_then_resumed(tmp_path, lambda t: [], fit_args, 5)
    assert torch.equal(weights(full), weights(resumed))


def test_scheduler_and_ema_resume_exactly(tmp_path):
    x, y = data()

    def callbacks(t):
        sched = torch.optim.lr_scheduler.StepLR(t.optimizer.optimizer, 2, 0.5)
        return [mp.LearningRateScheduler(sched), mp.EMA(0.9)]

    (full, full_cbs), (resumed, resumed_cbs) = interrupted_then_resumed(
        tmp_path, callbacks, lambda: (x, y, 8, 2), 5
    )
    assert torch.equal(weights(full), weights(resumed))
    assert full.optimizer.param_groups[0]["lr"] == resumed.optimizer.param_groups[0]["lr"]
    assert full_cbs[0].scheduler.last_epoch == resumed_cbs[0].scheduler.last_epoch == 16
    assert all(
        torch.equal(a, b) for a, b in zip(full_cbs[1].shadow, resumed_cbs[1].shadow, strict=True)
    )
    assert full_cbs[1].updates == resumed_cbs[1].updates == 16


def test_the_resumed_epochs_loss_covers_the_batches_before_the_checkpoint(tmp_path):
    x, y = data()
    torch.manual_seed(123)
    full = trainer().fit(x, y, batch_size=8, epochs=1, verbose=0)
    torch.manual_seed(123)
    saver = mp.ModelCheckpoint(tmp_path, every_n_epochs=None, every_n_steps=3)
    with pytest.raises(KeyboardInterrupt):
        trainer().fit(x, y, batch_size=8, epochs=1, verbose=0, callbacks=[saver, Interrupt(3)])
    resumed = trainer().fit(x, y, batch_size=8, epochs=1, verbose=0,
                            resume_from=tmp_path / "step-00000003.safetensors")  # fmt: skip
    assert resumed.history["loss"][0] == pytest.approx(full.history["loss"][0], rel=1e-6)


def test_best_values_and_csv_rows_survive_a_resume(tmp_path):
    x, y = data()
    xv, yv = data(16)

    def run(epochs, resume=None, interrupt=None):
        t = trainer(lr=0.5)
        ckpt = mp.ModelCheckpoint(tmp_path / "ckpt", monitor="val_loss")
        stop = mp.EarlyStopping("val_loss", patience=2)
        log = mp.CSVLogger(tmp_path / "log.csv")
        cbs = [ckpt, stop, log] + ([interrupt] if interrupt else [])
        t.fit(x, y, batch_size=16, epochs=epochs, validation_data=(xv, yv), callbacks=cbs,
              verbose=0, resume_from=resume)  # fmt: skip
        return ckpt, stop

    torch.manual_seed(123)
    ckpt, stop = run(3)
    best, wait = ckpt.best, stop._wait
    assert best is not None
    best_file = (tmp_path / "ckpt" / "best.safetensors").read_bytes()
    torch.manual_seed(123)
    resumed_ckpt, resumed_stop = run(3, resume=tmp_path / "ckpt" / "epoch-0003.safetensors")
    # Epoch 3 is done: nothing more runs, and nothing is forgotten.
    assert resumed_ckpt.best == best and resumed_stop._wait == wait
    assert (tmp_path / "ckpt" / "best.safetensors").read_bytes() == best_file
    rows = list(csv.reader((tmp_path / "log.csv").open()))
    assert [r[0] for r in rows[1:]] == ["0", "1", "2"]
    run(4, resume=tmp_path / "ckpt" / "epoch-0003.safetensors")
    rows = list(csv.reader((tmp_path / "log.csv").open()))
    assert [r[0] for r in rows[1:]] == ["0", "1", "2", "3"] and rows[0][0] == "epoch"


def test_a_checkpoint_on_an_epochs_last_batch_resumes_into_that_epochs_end(tmp_path):
    x, y = data(32)
    saver = mp.ModelCheckpoint(tmp_path, every_n_epochs=None, every_n_steps=4)
    with pytest.raises(KeyboardInterrupt):
        trainer().fit(x, y, batch_size=8, epochs=2, verbose=0, callbacks=[saver, Interrupt(4)])
    ends = EpochEnds()
    history = trainer().fit(x, y, batch_size=8, epochs=2, verbose=0, callbacks=[ends],
                            resume_from=tmp_path / "step-00000004.safetensors")  # fmt: skip
    assert ends.epochs == [0, 1] and len(history.history["loss"]) == 2


class Stream(IterableDataset):
    """Batches with no length, as a streaming loader gives them."""

    def __iter__(self):
        x, y = data(32)
        return iter(zip(x.split(8), y.split(8), strict=True))


def test_a_loader_without_length_resumes_after_a_finished_epoch(tmp_path):
    trainer().fit(Stream(), epochs=1, verbose=0, callbacks=[mp.ModelCheckpoint(tmp_path)])
    ends = EpochEnds()
    trainer().fit(Stream(), epochs=3, verbose=0, callbacks=[ends],
                  resume_from=tmp_path / "epoch-0001.safetensors")  # fmt: skip
    assert ends.epochs == [1, 2]


@pytest.mark.parametrize("order", ["writer first", "raiser first"])
def test_a_checkpoint_holds_callback_state_after_the_step_whatever_the_order(tmp_path, order):
    """ModelCheckpoint listed first still saves the scheduler as it is after the step, and
    a callback that raises before it still gets the step's checkpoint written. Listed
    first, the raiser kept the scheduler after it from stepping: the checkpoint held it a
    step behind, and its resume ended at twice the uninterrupted run's learning rate."""
    x, y = data(32)
    t = trainer()
    sched = torch.optim.lr_scheduler.StepLR(t.optimizer.optimizer, 1, 0.5)
    saver = mp.ModelCheckpoint(tmp_path, every_n_epochs=None, every_n_steps=2)
    scheduler = mp.LearningRateScheduler(sched)
    callbacks = [saver, scheduler, Interrupt(2)]
    if order == "raiser first":
        callbacks = [Interrupt(2), scheduler, saver]
    with pytest.raises(KeyboardInterrupt):
        t.fit(x, y, batch_size=8, epochs=1, verbose=0, callbacks=callbacks)
    loaded = mp.load_checkpoint(tmp_path / "step-00000002.safetensors", trainer().model)
    assert loaded.trainer_state["epoch_done"] is False
    saved = loaded.trainer_state["callbacks"]["LearningRateScheduler"]["scheduler"]
    assert saved["last_epoch"] == 2 and sched.last_epoch == 2


def test_a_state_without_its_callback_and_a_callback_without_its_state_are_said(tmp_path):
    x, y = data(32)
    t = trainer()
    sched = torch.optim.lr_scheduler.StepLR(t.optimizer.optimizer, 1, 0.5)
    t.fit(x, y, batch_size=8, epochs=1, verbose=0,
          callbacks=[mp.LearningRateScheduler(sched), mp.ModelCheckpoint(tmp_path)])  # fmt: skip
    with pytest.warns(UserWarning, match=r"state of a LearningRateScheduler callback, and "
                      r"this fit\(\) has none"):  # fmt: skip
        trainer().fit(x, y, batch_size=8, epochs=2, verbose=0,
                      resume_from=tmp_path / "epoch-0001.safetensors")  # fmt: skip
    with pytest.warns(UserWarning, match="holds no state for the EMA callback"):
        trainer().fit(x, y, batch_size=8, epochs=2, verbose=0, callbacks=[mp.EMA()],
                      resume_from=tmp_path / "epoch-0001.safetensors")  # fmt: skip


def test_validation_data_overrides_validation_split_and_says_so():
    x, y = data(40)
    xv, yv = data(8)
    seen = []

    class Sizes(mp.Callback):
        def on_train_batch_end(self, step, logs):
            seen.append(logs["size"])

    t = trainer()
    with pytest.warns(UserWarning, match=r"validation_split=0.25 is ignored: validation_data"):
        h = t.fit(x, y, batch_size=10, validation_split=0.25, validation_data=(xv, yv),
                  callbacks=[Sizes()], verbose=0)  # fmt: skip
    assert sum(seen) == 40
    assert h.history["val_loss"][0] == pytest.approx(t.evaluate(xv, yv)["loss"], rel=1e-6)


def test_evaluate_leaves_out_empty_batches():
    x, y = data(16)
    t = trainer()
    with_empty = [(x[:8], y[:8]), (x[:0], y[:0]), (x[8:], y[8:])]
    assert t.evaluate(with_empty) == pytest.approx(t.evaluate(x, y, batch_size=8))


def test_regression_targets_without_the_trailing_dimension_train_as_with_it():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(64, 4, generator=g)
    y = x @ torch.tensor([1.0, -2.0, 0.5, 3.0])
    results = []
    for target in (y, y[:, None]):
        torch.manual_seed(0)
        model = nn.Linear(4, 1)
        t = mp.Trainer(model, "mse", torch.optim.SGD(model.parameters(), lr=0.05),
                       policy="float32", device="cpu", metrics=["mae"])  # fmt: skip
        results.append(t.fit(x, target, batch_size=16, epochs=3, verbose=0).history)
    assert results[0]["loss"] == results[1]["loss"] and results[0]["mae"] == results[1]["mae"]
    torch.manual_seed(0)
    model = nn.Linear(4, 3)
    t = mp.Trainer(model, "mse", torch.optim.SGD(model.parameters(), lr=0.05), device="cpu")
    with pytest.raises(ValueError, match=r"loss 'mse': the model's output has shape \(16, 3\) "
                       r"and the targets \(16,\)"):  # fmt: skip
        t.fit(x, y, batch_size=16, epochs=1, verbose=0)


class _WriteOnly:
    """A stream with write alone: LossMonitor's flush failed mid-fit."""

    def write(self, text: str) -> int:
        return len(text)


def _file(folder):
    (folder / "f").write_text("")
    return folder / "f"


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda d: mp.ModelCheckpoint(d, every_n_epochs=0), "every_n_epochs=0 is invalid"),
        (lambda d: mp.ModelCheckpoint(d, every_n_epochs=1.5), "every_n_epochs=1.5 is invalid"),
        (lambda d: mp.ModelCheckpoint(d, every_n_steps=-2), "every_n_steps=-2 is invalid"),
        (lambda d: mp.ModelCheckpoint(d, every_n_epochs=None), "would never save"),
        (lambda d: mp.EarlyStopping(patience=-3), "patience=-3 is invalid"),
        (lambda d: mp.EarlyStopping(patience="2"), "patience='2' is invalid"),
        # NaN or inf made no epoch an improvement: every run stopped after `patience`.
        (
            lambda d: mp.EarlyStopping(min_delta=float("nan")),
            "min_delta=nan is invalid; it must be a finite number",
        ),
        (lambda d: mp.EarlyStopping(min_delta=float("inf")), "min_delta=inf is invalid"),
        (lambda d: mp.LearningRateScheduler(None), "scheduler=NoneType is invalid"),
        # Each accepted, then failing mid-fit (or writing into ./None), before.
        (lambda d: mp.ModelCheckpoint(d, monitor=5), "monitor=5 is invalid"),
        (lambda d: mp.ModelCheckpoint(_file(d)), r"ModelCheckpoint\(dirpath='.*f'\) is a file"),
        (lambda d: mp.CSVLogger(d), r"CSVLogger\(filename='.*'\) is a folder; valid: a file"),
        (lambda d: mp.CSVLogger(d / "l.csv", separator=""), r"CSVLogger\(separator=''\) is "),
        (lambda d: mp.ProgressBar(stream="x"), r"ProgressBar\(stream='x'\) is invalid"),
        (lambda d: mp.LossMonitor(stream=5), r"LossMonitor\(stream=5\) is invalid"),
        (lambda d: mp.ProgressBar(stream=_WriteOnly()), r"a text stream \(with write and flush"),
        (lambda d: mp.TensorBoard(None), r"TensorBoard\(log_dir=None\) is invalid"),
    ],
)
def test_callback_arguments_are_checked(tmp_path, make, message):
    with pytest.raises(ValueError, match=message):
        make(tmp_path)


def test_a_misspelt_monitor_is_an_error_naming_the_logs(tmp_path):
    x, y = data(32)
    with pytest.raises(KeyError, match="ModelCheckpoint monitor='val_los' is not in the epoch "
                       "logs; available: loss"):  # fmt: skip
        trainer().fit(x, y, batch_size=8, epochs=1, verbose=0, validation_data=(x, y),
                      callbacks=[mp.ModelCheckpoint(tmp_path, monitor="val_los",
                                                    mode="min")])  # fmt: skip
    with pytest.raises(mp.ArgumentError, match="or check the name's spelling"):  # mode="auto"
        mp.ModelCheckpoint(tmp_path, monitor="val_los")


def test_predict_refuses_a_batch_size_below_one():
    with pytest.raises(ValueError, match="batch_size=0 is invalid; it must be an int >= 1"):
        trainer().predict(torch.randn(4, 8), batch_size=0)


def test_a_step_whose_forward_overflowed_is_left_out_of_the_epochs_loss():
    """Its loss is NaN and its step skipped: counted in skipped_steps, not averaged into a
    NaN that EarlyStopping or ModelCheckpoint watching "loss" could never improve on."""
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(160, 32, generator=g), torch.randint(0, 10, (160,), generator=g)
    x[7] = 1e6  # overflows float16 in the first layer: the batch holding it is skipped
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 10))
    t = mp.Trainer(model, "cross_entropy", torch.optim.Adam(model.parameters(), 1e-2),
                   policy="mixed_float16", level="O2", device="cpu")  # fmt: skip
    history = t.fit(x, y, batch_size=16, epochs=2, verbose=0, shuffle=False).history
    assert history["skipped_steps"] == [1, 1]
    assert all(math.isfinite(v) for v in history["loss"] + history["accuracy"])


@pytest.mark.parametrize(
    ("change", "said"),
    [
        ({"batch_size": 16}, "batches 8 then, 4 now; batch_size 8 then, 16 now"),
        ({"shuffle": False}, "shuffle True then, False now"),
        ({"n": 48}, "batches 8 then, 6 now; samples 64 then, 48 now"),
    ],
)
def test_a_mid_epoch_resume_over_other_batches_is_refused(tmp_path, change, said):
    # step_in_epoch counts batches: of another size or order, skipping them skipped other
    # samples (64 of 160 never seen at twice the batch size).
    x, y = data()
    saver = mp.ModelCheckpoint(tmp_path, every_n_epochs=None, every_n_steps=3)
    with pytest.raises(KeyboardInterrupt):
        trainer().fit(x, y, batch_size=8, epochs=2, verbose=0, callbacks=[saver, Interrupt(3)])
    n = change.get("n", 64)
    args = {"batch_size": change.get("batch_size", 8), "shuffle": change.get("shuffle", True)}
    path = tmp_path / "step-00000003.safetensors"
    refused = trainer()
    before = weights(refused).clone()
    with pytest.raises(ValueError, match=rf"stopped 3 batches into an epoch .*\({said}\)"):
        refused.fit(x[:n], y[:n], epochs=2, verbose=0, resume_from=path, **args)
    assert torch.equal(weights(refused), before)  # nothing loaded
    resumed = trainer().fit(x, y, batch_size=8, epochs=2, verbose=0, resume_from=path)
    assert len(resumed.epoch) == 2  # the rest of epoch 0, then epoch 1


def test_resuming_from_a_checkpoint_without_a_position_is_refused(tmp_path):
    # Its weights loaded, it ran every epoch again from epoch 0 and global_step 0.
    x, y = data()
    t = trainer()
    t.fit(x, y, batch_size=16, epochs=2, verbose=0)
    path = mp.save_checkpoint(tmp_path / "c.safetensors", t.model, t.optimizer,
                              trainer_state={"step": t.global_step})  # fmt: skip
    fresh = trainer()
    before = weights(fresh).clone()
    with pytest.raises(mp.CheckpointError, match=r"holds no training position \(its "
                       r"trainer_state has \['step'\], no epoch\)"):  # fmt: skip
        fresh.fit(x, y, batch_size=16, epochs=3, verbose=0, resume_from=path)
    assert torch.equal(weights(fresh), before)  # refused before anything was loaded


class RaiseInLoss:
    """A loss that raises KeyboardInterrupt at its ``at``-th call (Ctrl-C in a forward)."""

    def __init__(self, at: int) -> None:
        self.at, self.calls = at, 0

    def __call__(self, out, y):
        self.calls += 1
        if self.calls == self.at:
            raise KeyboardInterrupt
        return nn.functional.cross_entropy(out, y)


def _hand_saved_resume(tmp_path, interrupt: str):
    """The same 3-epoch run whole, and stopped (``interrupt``: in a step's forward, or in
    an epoch's validation), saved by hand with resume_state() and resumed."""
    x, y = data(48)
    val = data(16)

    def build(loss):
        torch.manual_seed(0)
        # No dropout: the interrupted forward drew its masks before it raised, so a state
        # saved after it holds the random numbers past them (docs/trainer.md says so).
        model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        t = mp.Trainer(model, loss, opt, policy="float32", device="cpu", metrics=())
        sched = torch.optim.lr_scheduler.StepLR(t.optimizer.optimizer, 1, 0.5)
        return t, [EpochEnds(), mp.LearningRateScheduler(sched, interval="epoch")]

    def run(loss, resume=None):
        t, callbacks = build(loss)
        t.fit(x, y, batch_size=8, epochs=3, verbose=0, validation_data=val,
              callbacks=callbacks, resume_from=resume)  # fmt: skip
        return t, callbacks[0]

    full, full_ends = run(RaiseInLoss(0))
    # 6 batches an epoch, then 2 validation batches: loss call 9 is epoch 1's 1st batch
    # (calls 7-8 validate epoch 0), call 7 is epoch 0's validation.
    t, callbacks = build(RaiseInLoss(9 if interrupt == "step" else 7))
    with pytest.raises(KeyboardInterrupt):
        t.fit(x, y, batch_size=8, epochs=3, verbose=0, validation_data=val,
              callbacks=callbacks)  # fmt: skip
    state = t.resume_state()
    path = mp.save_checkpoint(tmp_path / "hand.safetensors", t.model, t.optimizer,
                              trainer_state=state)  # fmt: skip
    torch.manual_seed(999)  # a fresh process would not share the RNG: the checkpoint sets it
    with warnings.catch_warnings():
        # Resumed into the epoch's end, the scheduler steps before this process's first
        # optimizer step: torch warned of skipping a schedule value, though none was.
        warnings.filterwarnings("error", message=r"Detected call of `lr_scheduler.step\(\)`")
        resumed, resumed_ends = run(RaiseInLoss(0), resume=path)
    return full, full_ends, resumed, resumed_ends, callbacks[0], state


@pytest.mark.parametrize("interrupt", ["step", "validation"])
def test_a_state_saved_by_hand_after_an_interrupt_resumes_where_the_run_stood(tmp_path, interrupt):
    """A step interrupted in its forward was counted as done (the resume skipped its batch:
    masters 0.13 apart), and an interrupted validation marked its epoch ended (the resume
    ran neither that validation nor any on_epoch_end: the scheduler ended at twice its lr)."""
    full, full_ends, resumed, resumed_ends, before, state = _hand_saved_resume(tmp_path, interrupt)
    if interrupt == "step":
        assert (state["epoch"], state["step_in_epoch"], state["epoch_done"]) == (1, 0, False)
    else:
        assert (state["epoch"], state["step_in_epoch"], state["epoch_done"]) == (0, 6, False)
    assert before.epochs + resumed_ends.epochs == full_ends.epochs == [0, 1, 2]
    assert resumed.global_step == full.global_step == 18
    assert torch.equal(weights(resumed), weights(full))
    assert resumed.optimizer.param_groups[0]["lr"] == full.optimizer.param_groups[0]["lr"]


def test_a_new_run_in_a_folder_with_a_best_checkpoint_says_it_replaces_it(tmp_path):
    """The script run again in the same folder without resume_from: its first epoch's
    best.safetensors replaced the earlier run's (val_loss 0.697 by 1.466), unsaid."""
    x, y = data(32)
    val = data(16)

    def run():
        saver = mp.ModelCheckpoint(tmp_path, monitor="val_loss")
        trainer().fit(x, y, batch_size=8, epochs=1, verbose=0, validation_data=val,
                      callbacks=[saver])  # fmt: skip

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        run()  # a fresh folder: nothing to say
    with pytest.warns(UserWarning, match=r"best.safetensors holds an earlier run's best"):
        run()


def test_restoring_best_weights_from_a_checkpoint_that_kept_none_is_said(tmp_path):
    """EarlyStopping(restore_best_weights=True) resumed from a run saved with False: its
    best value came back, its weights could not, and nothing said so."""
    x, y = data(32)
    val = data(16)
    saver = mp.ModelCheckpoint(tmp_path)
    plain = mp.EarlyStopping(monitor="val_loss", patience=5)
    trainer().fit(x, y, batch_size=8, epochs=1, verbose=0, validation_data=val,
                  callbacks=[plain, saver])  # fmt: skip
    restoring = mp.EarlyStopping(monitor="val_loss", patience=5, restore_best_weights=True)
    first = tmp_path / "epoch-0001.safetensors"
    with pytest.warns(UserWarning, match=r"kept no best weights .*best val_loss [0-9.]+ cannot"):
        trainer().fit(x, y, batch_size=8, epochs=2, verbose=0, validation_data=val,
                      callbacks=[restoring], resume_from=first)  # fmt: skip


@pytest.mark.parametrize("loader", ["own generator", "global RNG"])
def test_a_mid_epoch_resume_says_when_the_loader_cannot_replay_its_order(tmp_path, loader):
    """A DataLoader shuffling with a generator of its own: its state is in no checkpoint,
    and a resume in the second epoch trained 8 samples of 32 twice and 8 never, unsaid.
    In the first epoch a loader made anew draws as the first run's did: nothing to say."""
    x, y = data(32)

    def make() -> DataLoader:
        gen = torch.Generator().manual_seed(1) if loader == "own generator" else None
        return DataLoader(TensorDataset(x, y), batch_size=4, shuffle=True, generator=gen)

    saver = mp.ModelCheckpoint(tmp_path, every_n_epochs=None, every_n_steps=3, keep_last=5)
    trainer().fit(make(), None, epochs=2, callbacks=[saver], verbose=0)  # 8 steps an epoch

    def said_at(step: int) -> list[str]:
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            trainer().fit(make(), None, epochs=2, verbose=0,
                          resume_from=tmp_path / f"step-{step:08d}.safetensors")  # fmt: skip
        return [str(w.message) for w in seen if "cannot replay" in str(w.message)]

    assert said_at(3) == []  # the first epoch
    if loader == "own generator":
        assert said_at(12) == [
            "resumed 4 batches into an epoch whose order this DataLoader cannot replay: it "
            "shuffles with a generator of its own (DataLoader(generator=...)), whose state a "
            "checkpoint does not hold; seed with torch.manual_seed instead. The rest of the "
            "epoch may train some samples twice and leave out others. Resume from an "
            "epoch's end (ModelCheckpoint(every_n_epochs=1)), or give the loader an order "
            "the global RNG decides"
        ]
    else:
        assert said_at(12) == []


def test_a_resume_from_the_epoch_early_stopping_ended_ends_there_too(tmp_path):
    """ModelCheckpoint writes the epoch EarlyStopping stopped at (after it): a resume from
    that file restored its wait and best but not the stop, and trained another epoch (the
    uninterrupted run: 8 steps; the resumed one: 12). It now ends there too, and says so."""
    x, y = data(32)
    stop = mp.EarlyStopping(monitor="loss", patience=1, min_delta=10.0)  # stops after epoch 2
    first = trainer("mixed_bfloat16")
    first.fit(x, y, batch_size=8, epochs=5, verbose=0,
              callbacks=[stop, mp.ModelCheckpoint(tmp_path, keep_last=10)])  # fmt: skip
    assert stop.stopped_epoch == 1 and first.global_step == 8
    again = trainer("mixed_bfloat16")
    resumed = mp.EarlyStopping(monitor="loss", patience=1, min_delta=10.0)
    with pytest.warns(UserWarning, match=r"EarlyStopping: the run this checkpoint is from "
                      r"stopped after epoch 2 .* so this fit ends there too"):  # fmt: skip
        history = again.fit(x, y, batch_size=8, epochs=5, verbose=0, callbacks=[resumed],
                            resume_from=tmp_path / "epoch-0002.safetensors")  # fmt: skip
    assert history.epoch == [] and again.global_step == 8 and resumed.stopped_epoch == 1
    for a, b in zip(first.model.parameters(), again.model.parameters(), strict=True):
        assert torch.equal(a, b)


def test_a_compiled_run_with_dropout_resumed_early_is_the_uninterrupted_run(tmp_path):
    """A compiled Trainer runs its 7th to 9th steps eagerly once (to say when compiling is
    slower), and eager dropout draws other masks than inductor's. A resumed Trainer counted
    from 0 again, so its eager steps fell elsewhere: resumed from step 3, the weights were
    0.01 off at step 7 and 0.056 at step 12. It now counts from the step it resumed at."""
    x, y = data(96)

    def run(resume_from=None, save_to=None):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Dropout(0.3), nn.Linear(16, 4))
        t = mp.Trainer(model, "cross_entropy", torch.optim.SGD(model.parameters(), lr=0.1),
                       "mixed_bfloat16", "O2", device="cpu", metrics=(), compile=True)  # fmt: skip
        saves = (
            [mp.ModelCheckpoint(save_to, every_n_epochs=None, every_n_steps=3, keep_last=9)]
            if save_to
            else []
        )
        t.fit(x, y, batch_size=16, epochs=2, verbose=0, resume_from=resume_from,
              callbacks=saves)  # fmt: skip
        return t

    torch._dynamo.reset()
    try:
        whole = run(save_to=tmp_path)
        resumed = run(resume_from=tmp_path / "step-00000003.safetensors")
    finally:
        torch._dynamo.reset()
    assert whole.global_step == resumed.global_step == 12
    for a, b in zip(whole.model.parameters(), resumed.model.parameters(), strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize("resume_at", [5, 10])
def test_a_resumed_compiled_step_probes_at_the_calls_the_run_it_resumes_did(
    tmp_path, monkeypatch, resume_at
):
    """The eager probe (calls 6 to 8 of a compiled step) counted from 0 again when resumed,
    then from the applied steps alone: with two skipped steps it ran at calls 10-14; resumed
    inside it (step 5) it ran at calls 6 to 10. It counts the optimizer's steps, skipped
    ones too, and a probe resumed part way ends where the uninterrupted one did."""
    from mixprec.train import step as step_module

    eager: list[bool] = []
    call = step_module.TrainStep.__call__

    def spy(self, x, y, **kwargs):
        timed = self._probe is not None and self._calls >= step_module._WARMUP
        eager.append(timed and self._calls >= step_module._WARMUP + step_module._PROBE)
        return call(self, x, y, **kwargs)

    monkeypatch.setattr(step_module.TrainStep, "__call__", spy)
    x, y = torch.randn(10, 4), torch.zeros(10, 2)
    y[2:4] = 7  # the second batch's loss is inf in epoch 1: skipped steps before the save

    def loss_fn(out, t):
        loss = ((out - t) ** 2).mean()
        return loss * float("inf") if bool((t == 7).any()) and len(eager) < 4 else loss

    def run(**fit):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(4, 8), nn.Dropout(0.5), nn.Linear(8, 2))
        t = mp.Trainer(model, loss_fn, "sgd", "float32", metrics=(), device="cpu",
                       compile={"backend": "eager"})  # fmt: skip
        t.fit(x, y, epochs=3, batch_size=2, shuffle=False, verbose=0, **fit)
        return t

    save = mp.ModelCheckpoint(tmp_path, every_n_epochs=None, every_n_steps=5, keep_last=5)
    whole = run(callbacks=[save])
    first = [i for i, e in enumerate(eager) if e]
    assert whole.optimizer.loss_scaler.state.skipped_steps == 1 and first == [6, 7, 8]
    eager.clear()
    resumed = run(resume_from=tmp_path / f"step-{resume_at:08d}.safetensors")
    done = resumed.optimizer.loss_scaler.state.steps - len(eager)  # calls before the resume
    assert [done + i for i, e in enumerate(eager) if e] == [c for c in first if c >= done]


def test_accumulation_with_a_dataset_that_draws_noise_resumes_exactly(tmp_path):
    """With accumulation the Trainer reads one batch ahead, so a dataset drawing noise from
    torch's generator in the main process had drawn the next batch's before a mid-epoch
    checkpoint stored the generator: resumed there, weights ended 0.0085 to 0.12 off the
    uninterrupted run. The checkpoint keeps the state from before that read, and the
    resumed epoch reads that batch again under it."""
    x, y = data(48)

    class Noisy(torch.utils.data.Dataset):
        def __len__(self):
            return len(x)

        def __getitem__(self, i):
            return x[i] + 0.1 * torch.randn(x.shape[1]), y[i]

    def run(**fit):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Dropout(0.3), nn.Linear(16, 4))
        t = mp.Trainer(model, "cross_entropy", torch.optim.SGD(model.parameters(), lr=0.1),
                       "mixed_bfloat16", "O2", device="cpu", metrics=(),
                       accumulation_steps=2)  # fmt: skip
        loader = DataLoader(Noisy(), batch_size=8, shuffle=True)
        t.fit(loader, epochs=2, verbose=0, **fit)
        return t

    every = mp.ModelCheckpoint(tmp_path, every_n_epochs=None, every_n_steps=1, keep_last=9)
    whole = run(callbacks=[every])
    assert whole.global_step == 6
    for step in (1, 2, 4):  # mid-epoch in both epochs (3 steps an epoch)
        torch.manual_seed(99)  # the checkpoint's generator states decide, not this one
        resumed = run(resume_from=tmp_path / f"step-{step:08d}.safetensors")
        for a, b in zip(whole.model.parameters(), resumed.model.parameters(), strict=True):
            assert torch.equal(a, b), step
