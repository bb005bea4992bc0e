"""Steps decided on the device (``optim.deferred``): at a fixed scale with a fused optimizer
the kernels skip on the device, nothing is read on the host to apply a step, and what each
step did is read later in batches. On CPU that path is taken under ``torch.compile(opt.step)``
or with ``deferred.ON_HOST``, which these tests set: it must train and skip bit for bit as
the host step does, and keep the scaler's counters and health as an eager run would."""

from __future__ import annotations

import copy
import pickle
import warnings

import pytest
import torch
from torch._dynamo.testing import CompileCounter

import mixprec as mp
from mixprec.optim import deferred
from mixprec.optim.step_result import DeviceFlag
from mixprec.scaling import finite
from tests.conftest import classification_data, make_mlp
from tests.optim._helpers import loss_of, same_state

_CASES = {
    "bf16-O2-adamw": ("mixed_bfloat16", "O2", lambda ps: torch.optim.AdamW(ps, lr=1e-2), None),
    "bf16-O2-sgd-momentum": (
        "mixed_bfloat16",
        "O2",
        lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9),
        None,
    ),
    "fp32-O0-adam": ("float32", "O0", lambda ps: torch.optim.Adam(ps, lr=1e-2), None),
    "fp16-O1-static-scale": (
        "mixed_float16",
        "O1",
        lambda ps: torch.optim.AdamW(ps, lr=1e-2),
        lambda: mp.StaticLossScaler(128.0),
    ),
}


def _train(case, steps=6, nan_at=(3,), step_fn=None):
    policy, level, factory, scaler = _CASES[case]
    torch.manual_seed(0)
    model = mp.auto_mixed_precision(make_mlp(), policy, level)
    opt = mp.LossScaleOptimizer(factory(model.parameters()), scaler() if scaler else None)
    step = step_fn(opt) if step_fn else opt.step
    results = []
    for i in range(steps):
        opt.zero_grad()
        opt.backward(loss_of(model))
        if i in nan_at:
            next(model.parameters()).grad.view(-1)[0] = float("nan")
        results.append(step())
    state = (
        [p.detach().clone() for p in model.parameters()],
        [p.detach().clone() for p in opt.master_params()],
        [o.state_dict() for o in opt.optimizers],
    )
    return opt, results, state


@pytest.mark.parametrize("case", list(_CASES))
def test_steps_decided_on_the_device_train_and_skip_bit_for_bit_as_the_host_step(case, monkeypatch):
    host_opt, host_results, host_state = _train(case)
    monkeypatch.setattr(deferred, "ON_HOST", True)
    opt, results, state = _train(case)
    # The first step is torch's own (it builds the optimizer state); then the device's.
    assert [type(r.found_inf) for r in results] == [bool] + [DeviceFlag] * 5
    assert [bool(r.applied) for r in results] == [True, True, True, False, True, True]
    assert [bool(r.applied) for r in host_results] == [True, True, True, False, True, True]
    assert results[3].skipped and results[3].found_inf == True  # noqa: E712
    assert same_state(state, host_state)  # tolerance 0: a NaN reached nothing
    assert opt.loss_scaler.state == host_opt.loss_scaler.state
    assert opt.loss_scaler.state.skipped_steps == 1
    assert opt.loss_scaler.state.last_overflow_step == 3


def _count_host_reads(monkeypatch) -> list[str]:
    """Every read of a tensor's value into Python (what synchronises with a GPU)."""
    reads: list[str] = []
    for name in ("item", "tolist", "__bool__", "__float__", "__int__"):
        real = getattr(torch.Tensor, name)

        def counted(self, *args, _real=real, _name=name):
            reads.append(_name)
            return _real(self, *args)

        monkeypatch.setattr(torch.Tensor, name, counted)
    return reads


def test_a_step_on_the_device_reads_nothing_on_the_host(monkeypatch):
    # As on a GPU: the finiteness check runs its kernel instead of reading its answer at
    # once (which on CPU is free, so there it reads).
    monkeypatch.setattr(finite, "checks_on_host", lambda tensors: False)
    for on_host in (True, False):
        monkeypatch.setattr(deferred, "ON_HOST", on_host)
        torch.manual_seed(0)
        model = mp.auto_mixed_precision(make_mlp(), "mixed_bfloat16", "O2")
        opt = mp.LossScaleOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-2))
        opt._book.host_path = False  # the control takes the general path, not host_step
        for _ in range(2):  # the optimizer's own first step builds its state
            opt.zero_grad()
            opt.backward(loss_of(model))
            opt.step()
        opt.zero_grad()
        opt.backward(loss_of(model))
        with monkeypatch.context() as m:
            reads = _count_host_reads(m)
            result = opt.step()
        if on_host:  # the device path: the kernel skips on the device, nothing is read
            assert reads == []
            assert result.applied and opt._book.deferred.pending == []  # read when asked
        else:  # the control: the general path reads the flag once to decide
            assert reads == ["tolist"]


def test_what_steps_did_is_read_in_batches_and_when_asked(monkeypatch):
    monkeypatch.setattr(deferred, "ON_HOST", True)
    monkeypatch.setattr(deferred, "EVERY", 4)
    opt, results, _ = _train("bf16-O2-adamw", steps=3, nan_at=(1,))
    assert len(opt._book.deferred.pending) == 2  # steps 2 and 3 (step 1 was torch's)
    assert opt._loss_scaler.state.steps == 1  # not yet counted
    assert not results[1].applied  # one read: both pending steps
    assert opt._book.deferred.pending == []
    assert opt._loss_scaler.state.steps == 3 and opt._loss_scaler.state.skipped_steps == 1

    # Step 1 is torch's (counted at once); steps 2-5 are read together at the fourth.
    opt, _, _ = _train("bf16-O2-adamw", steps=5, nan_at=())
    assert opt._book.deferred.pending == []
    assert opt._loss_scaler.state.steps == 5


def test_a_result_pickles_and_copies_as_plain_bools(monkeypatch):
    monkeypatch.setattr(deferred, "ON_HOST", True)
    _, results, _ = _train("bf16-O2-adamw", steps=5, nan_at=(3,))
    for copied in (pickle.loads(pickle.dumps(results[3])), copy.deepcopy(results[3])):
        assert copied.applied is False and copied.found_inf is True
        assert copied == results[3]


def test_state_dict_and_load_count_the_unread_steps_first(monkeypatch):
    monkeypatch.setattr(deferred, "ON_HOST", True)
    opt, _, _ = _train("bf16-O2-adamw", steps=4, nan_at=(2,))
    saved = opt.state_dict()
    assert saved["loss_scaler"]["steps"] == 4 and saved["loss_scaler"]["skipped_steps"] == 1
    other, _, _ = _train("bf16-O2-adamw", steps=3, nan_at=())
    assert other._book.deferred.pending  # unread steps of its own...
    other.load_state_dict(saved)
    assert other._loss_scaler.state.steps == 4  # ...counted before the load, not after it
    assert other._book.deferred.pending == []


def test_the_health_hears_steps_decided_on_the_device(monkeypatch):
    monkeypatch.setattr(deferred, "ON_HOST", True)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _, results, _ = _train("bf16-O2-adamw", steps=12, nan_at=range(1, 12))
        assert not any("in a row were skipped" in str(w.message) for w in caught)
        assert results[-1].skipped  # the read that tells the health
    assert any("in a row were skipped" in str(w.message) for w in caught)


def test_plain_sgd_cannot_skip_on_the_device_and_reads_on_the_host(monkeypatch):
    monkeypatch.setattr(deferred, "ON_HOST", True)
    _CASES["bf16-O2-sgd"] = ("mixed_bfloat16", "O2", lambda ps: torch.optim.SGD(ps, lr=0.05), None)
    try:
        _, results, _ = _train("bf16-O2-sgd")
    finally:
        del _CASES["bf16-O2-sgd"]
    assert [type(r.found_inf) for r in results] == [bool] * 6
    assert [r.applied for r in results] == [True, True, True, False, True, True]


def test_a_compiled_step_decides_on_the_device_with_no_recompile():
    counter, frames = CompileCounter(), []

    def compiled(opt):
        step = torch.compile(opt.step, backend=counter)

        def run():
            result = step()
            frames.append(counter.frame_count)
            return result

        return run

    eager_opt, eager_results, eager_state = _train("bf16-O2-adamw", steps=8)
    opt, results, state = _train("bf16-O2-adamw", steps=8, step_fn=compiled)
    assert [type(r.found_inf) for r in results] == [bool] + [DeviceFlag] * 7
    assert [bool(r.applied) for r in results] == [bool(r.applied) for r in eager_results]
    assert same_state(state, eager_state)  # the NaN of step 4 reached nothing here either
    assert opt.loss_scaler.state == eager_opt.loss_scaler.state
    # Graphs for torch's first step and for the device path; none after (the skipped
    # step 4 included): the skip is decided in the kernels, not by a branch.
    assert frames[1] == frames[-1]


def test_the_trainer_logs_plain_bools_for_steps_decided_on_the_device(monkeypatch):
    """A GPU run's steps are decided on the device; the Trainer's logs (JSON, CSV) get bools."""
    monkeypatch.setattr(deferred, "ON_HOST", True)
    logs: list[dict] = []
    added = []
    real_add = deferred.Deferred.add
    monkeypatch.setattr(
        deferred.Deferred, "add", lambda self, flag: added.append(1) or real_add(self, flag)
    )

    class Keep(mp.Callback):
        def on_train_batch_end(self, step, batch_logs):
            logs.append(dict(batch_logs))

    torch.manual_seed(0)
    model = make_mlp()
    trainer = mp.Trainer(model, "cross_entropy", torch.optim.Adam(model.parameters(), lr=3e-3),
                         policy="mixed_bfloat16", device="cpu")  # fmt: skip
    x, y = classification_data(n=96)
    trainer.fit(x, y, batch_size=32, epochs=1, callbacks=[Keep()], verbose=0)
    assert [type(b["applied"]) for b in logs] == [bool] * 3
    assert [b["applied"] for b in logs] == [True] * 3 and logs[-1]["global_step"] == 3
    assert len(added) == 2  # steps 2 and 3 were decided on the device (1 built the state)
    assert trainer.optimizer._book.deferred.pending == []


def test_flags_summed_over_devices_still_skip(monkeypatch):
    """unscale_grads_ adds the flags of several devices (2.0 with two); the fused kernels
    skip only on exactly 1, so the flag is clamped before it reaches them."""
    from mixprec.optim import loss_scale_optimizer

    monkeypatch.setattr(deferred, "ON_HOST", True)
    real = loss_scale_optimizer.agree_found_inf
    monkeypatch.setattr(loss_scale_optimizer, "agree_found_inf", lambda t: real(t) * 2)
    host_opt, _, host_state = _train("bf16-O2-adamw")
    assert host_opt.loss_scaler.state.skipped_steps == 1
    monkeypatch.setattr(deferred, "ON_HOST", False)
    monkeypatch.setattr(loss_scale_optimizer, "agree_found_inf", real)
    _, _, reference = _train("bf16-O2-adamw")
    assert same_state(host_state, reference)  # the NaN of step 4 reached nothing


def test_a_step_without_gradients_counts_after_the_unread_ones(monkeypatch):
    monkeypatch.setattr(deferred, "ON_HOST", True)
    opt, _, _ = _train("bf16-O2-adamw", steps=3, nan_at=(2,))
    assert len(opt._book.deferred.pending) == 2
    opt.zero_grad()
    opt.backward(loss_of(_model_of(opt)))
    opt.zero_grad(set_to_none=True)  # no gradient left: nothing to apply
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert not opt.step().applied
    assert opt._book.deferred.pending == []
    assert opt._loss_scaler.state.last_overflow_step == 2 and opt._loss_scaler.state.steps == 3


def _model_of(opt):
    from mixprec.trace import model_of

    return model_of(opt._weights.half)


def test_a_flag_works_where_a_bool_does(monkeypatch):
    monkeypatch.setattr(deferred, "ON_HOST", True)
    _, results, _ = _train("bf16-O2-adamw", steps=5, nan_at=(3,))
    applied = [r.applied for r in results]
    assert sum(applied) == 4 and applied[3] + 1 == 1 and 1 + applied[3] == 1
    assert float(applied[3]) == 0.0 and int(results[3].found_inf) == 1
    assert torch.tensor([bool(applied[1]), bool(applied[3])]).tolist() == [True, False]
    assert [1, 2][applied[3]] == 1
