"""build_train_step and TrainStep: MindSpore's build_train_network in a custom loop."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
from torch import nn

import mixprec as mp
from mixprec.levels import applied
from tests.conftest import classification_data, make_mlp


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
    with pytest.raises(
        mp.ArgumentError,
        match=r"^build_train_step\(policy='mixed_bfloat16', level='auto'\): the model was "
        r"already prepared with policy mixed_float16, level O2; a model is prepared once",
    ):
        mp.build_train_step(model, torch.optim.SGD(model.parameters(), 0.1), "cross_entropy",
                            policy="mixed_bfloat16")  # fmt: skip
    again = mp.build_train_step(model, step.optimizer, "cross_entropy")  # reuse: fine
    assert again.optimizer is step.optimizer


# -- a partial accumulation group, applied with flush=True ---------------------------------


def sgd_by_hand(model: nn.Module, groups, lr: float) -> nn.Module:
    """The float32 control: a copy of ``model`` after one SGD step per group of batches,
    each with the mean of its batches' cross-entropy gradients."""
    control = copy.deepcopy(model).float()
    for group in groups:
        total = [torch.zeros_like(p) for p in control.parameters()]
        for xb, yb in group:
            control.zero_grad()
            nn.functional.cross_entropy(control(xb), yb).backward()
            for t, p in zip(total, control.parameters(), strict=True):
                t += p.grad
        with torch.no_grad():
            for p, t in zip(control.parameters(), total, strict=True):
                p -= lr * t / len(group)
    return control


def test_flush_applies_a_partial_group_as_its_mean():
    torch.manual_seed(0)
    model = nn.Linear(8, 3)
    x, y = torch.randn(24, 8), torch.randint(0, 3, (24,))
    batches = [(x[i : i + 8], y[i : i + 8]) for i in (0, 8, 16)]
    control = sgd_by_hand(model, [batches], lr=0.5)
    step = mp.build_train_step(model, torch.optim.SGD(model.parameters(), lr=0.5),
                               "cross_entropy", "float32", accumulation_steps=4)  # fmt: skip
    results = [step(*batches[0])[1], step(*batches[1])[1], step(*batches[2], flush=True)[1]]
    assert [r.accumulating for r in results] == [True, True, False] and results[-1].applied
    assert step.optimizer.state_dict()["micro_steps"] == 0  # nothing carries on
    # float32 rounding only: the 4/3 rescale and another summation order (1e-6 relative).
    for p, c in zip(model.parameters(), control.parameters(), strict=True):
        torch.testing.assert_close(p, c, rtol=1e-6, atol=1e-7)
    # flush=True on a full group, or without accumulation, is the ordinary step.
    full = mp.build_train_step(nn.Linear(8, 3), "sgd", "cross_entropy", accumulation_steps=2)
    assert full(*batches[0])[1].accumulating
    assert full(*batches[1], flush=True)[1].applied
    single = mp.build_train_step(nn.Linear(8, 3), "sgd", "cross_entropy")
    assert single(*batches[0], flush=True)[1].applied


def test_a_partial_groups_rescale_is_checked_before_it_reaches_a_weight():
    """The 4/1 rescale ran after the inf/NaN check: an O3 float16 gradient of 20000 became
    80000, past float16's 65504, and an inf update was applied and reported finite."""
    from mixprec.optim.partial_group import apply_partial_group

    model = mp.auto_mixed_precision(nn.Linear(1, 1, bias=False), "float16", "O3")
    opt = mp.LossScaleOptimizer(
        torch.optim.SGD(model.parameters(), lr=1e-6),
        loss_scaler=mp.StaticLossScaler(1.0),
        accumulation_steps=4,
    )
    with torch.no_grad():
        model.weight.fill_(1.0)
    x = torch.full((2, 1), 40000.0, dtype=torch.float16)
    opt.backward(model(x).float().sum())  # d/dw = 80000 / 4 per micro-step: 20000 stored
    assert model.weight.grad.item() == 20000.0
    result = apply_partial_group(opt)
    assert not result.applied and result.found_inf
    assert model.weight.item() == 1.0


def test_build_train_step_refuses_settings_a_given_loss_scale_optimizer_would_ignore():
    model = make_mlp()
    opt = mp.LossScaleOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    settings = [
        ("max_grad_norm", 1e-3),
        ("accumulation_steps", 4),
        ("loss_scaler", mp.StaticLossScaler(128.0)),
        ("trace_overflow", True),
    ]
    for name, value in settings:
        said = rf"^{name}=.* configures the LossScaleOptimizer built around the optimizer, but"
        with pytest.raises(mp.ArgumentError, match=said):
            mp.build_train_step(model, opt, "cross_entropy", **{name: value})
    step = mp.build_train_step(model, opt, "cross_entropy", accumulation_steps=1)
    assert step.optimizer is opt


# -- an optimizer over another model's parameters ------------------------------------------


def test_an_optimizer_over_another_model_is_refused_before_the_model_changes():
    model, other = make_mlp(), make_mlp(seed=1)
    with pytest.raises(mp.ArgumentError, match=r"optimizer holds none of the model's 8 trainable"):
        mp.build_train_step(model, torch.optim.SGD(other.parameters(), lr=0.1), "cross_entropy",
                            policy="mixed_float16")  # fmt: skip
    assert applied(model) is None
    with pytest.raises(mp.ArgumentError, match=r"optimizer holds none"):
        mp.Trainer(model, "cross_entropy", torch.optim.Adam(other.parameters()), device="cpu")
    prepared = mp.auto_mixed_precision(make_mlp(seed=2), "mixed_float16", "O2")
    with pytest.raises(mp.ArgumentError, match=r"optimizer holds none"):
        mp.build_train_step(model, mp.LossScaleOptimizer(torch.optim.SGD(prepared.parameters(),
                            lr=0.1)), "cross_entropy")  # fmt: skip


@pytest.mark.parametrize(
    ("bad", "said"),
    [
        ({"loss_fn": "bogus"}, r"loss='bogus' is not a known loss"),
        ({"max_grad_norm": -1}, r"max_grad_norm=-1 is invalid"),
        ({"accumulation_steps": 0}, r"accumulation_steps=0 is invalid"),
        ({"loss_scaler": "dynamic"}, r"loss_scaler must be a NoOpLossScaler"),
        ({"trace_overflow": "yes"}, r"trace_overflow='yes' is invalid"),
    ],
)
@pytest.mark.parametrize("via", ["build_train_step", "Trainer"])
def test_a_bad_option_is_refused_before_the_model_or_the_optimizer_changes(bad, said, via):
    """The loss and the LossScaleOptimizer options were checked after the model was
    prepared and the optimizer wrapped: the retry with the value fixed was refused as
    "prepared already with policy ..." or "holds none of the model's parameters"."""
    model = make_mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    given = {"loss_fn": "cross_entropy", **bad}
    with pytest.raises(mp.ArgumentError, match=said):
        if via == "Trainer":
            loss = given.pop("loss_fn")
            mp.Trainer(model, loss, opt, "mixed_float16", "O2", device="cpu", **given)
        else:
            mp.build_train_step(model, opt, policy="mixed_float16", level="O2", **given)
    assert applied(model) is None and all(p.dtype == torch.float32 for p in model.parameters())
    assert all(a is b for a, b in zip(model.parameters(), opt.param_groups[0]["params"],
                                      strict=True))  # fmt: skip
    step = mp.build_train_step(model, opt, "cross_entropy", "mixed_bfloat16", "O2")
    x, y = classification_data(n=16)
    assert step(x, y)[1].applied


def test_an_optimizer_over_some_parameters_warns_naming_the_rest():
    model = make_mlp()
    opt = torch.optim.SGD(model[0].parameters(), lr=0.1)
    with pytest.warns(
        UserWarning,
        match=r"holds 2 of the model's 8 trainable parameters; these "
        r"will not train: 2.weight, 2.bias, 3.weight, 3.bias, 5.weight and 1 more",
    ):
        mp.build_train_step(model, opt, "cross_entropy", policy="mixed_float16")


@pytest.mark.parametrize(
    "setup",
    ["O0", "O2 float32 optimizer", "O2 prepared first", "amp_level O3", "frozen layer"],
)
def test_optimizers_built_the_usual_ways_pass(setup):
    model = make_mlp()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        if setup == "O0":
            opt = torch.optim.SGD(model.parameters(), lr=0.1)
            step = mp.build_train_step(model, opt, "cross_entropy", "float32")
        elif setup == "O2 float32 optimizer":  # the 16-bit weights get masters when wrapped
            opt = torch.optim.Adam(model.parameters())
            step = mp.build_train_step(model, opt, "cross_entropy", "mixed_float16", "O2")
        elif setup == "O2 prepared first":  # the optimizer holds float32 masters only
            mp.auto_mixed_precision(model, "mixed_float16", "O2")
            lso = mp.LossScaleOptimizer(torch.optim.Adam(model.parameters()))
            assert not any(p is h for p in lso.master_params() for h, _ in lso.master_weights())
            step = mp.build_train_step(model, lso, "cross_entropy")
        elif setup == "amp_level O3":
            opt = torch.optim.SGD(model.parameters(), lr=0.1)
            step = mp.build_train_step(model, opt, "cross_entropy", amp_level="O3")
        else:
            model[0].requires_grad_(False)
            opt = torch.optim.SGD(model[2:].parameters(), lr=0.1)
            step = mp.build_train_step(model, opt, "cross_entropy", "mixed_bfloat16")
        x, y = classification_data(n=16)
        assert step(x, y)[1].applied


# -- MindSpore's amp_level, and optimizers by name -----------------------------------------


def test_amp_level_is_accepted_as_auto_mixed_precision_takes_it():
    model = make_mlp()
    mp.build_train_step(model, "sgd", "cross_entropy", amp_level=" o2")
    done = applied(model)
    assert done.level == "O2" and done.policy.name == "mixed_float16"  # MindSpore's default
    mp.build_train_step(model, "sgd", "cross_entropy", amp_level="O2")  # the same: fine
    with pytest.raises(
        ValueError,
        match=r"^build_train_step\(policy=None, amp_level='O3'\): the model was already "
        r"prepared with policy mixed_float16, level O2; a model is prepared once: pass "
        r"policy='mixed_float16', level='O2' to use it as it is, or build the model again$",
    ):
        mp.build_train_step(model, "sgd", "cross_entropy", amp_level="O3")
    with pytest.raises(ValueError, match=r"amp_level='O7' is invalid; valid: O0, O1, O2, O3"):
        mp.build_train_step(make_mlp(), "sgd", "cross_entropy", amp_level="O7")
    with pytest.raises(ValueError, match=r"takes level= \(mixprec's\) or amp_level="):
        mp.build_train_step(make_mlp(), "sgd", "cross_entropy", level="O1", amp_level="O2")


# -- model outputs other than a tensor, and losses that are not a floating scalar -----------


class _Wrapped(nn.Module):
    """``make_mlp`` whose forward returns its logits inside a tuple, list or mapping."""

    def __init__(self, wrap) -> None:
        super().__init__()
        self.inner = make_mlp()
        self.wrap = wrap

    def forward(self, x):
        return self.wrap(self.inner(x))


@pytest.mark.parametrize(
    "wrap",
    [
        lambda t: (t, t.detach().sum()),
        lambda t: [t],
        lambda t: {"loss": t.sum(), "logits": t},
    ],
    ids=["tuple", "list", "mapping"],
)
def test_a_tuple_list_or_mapping_output_trains_on_its_tensor(wrap):
    model = _Wrapped(wrap)
    step = mp.build_train_step(model, torch.optim.SGD(model.parameters(), lr=0.1), "cross_entropy")
    x, y = classification_data(n=64)
    losses = [step(x, y)[0].item() for _ in range(10)]
    assert losses[-1] < losses[0]
    assert step.last_output is not None and step.last_output.shape == (64, 10)


def test_the_trainer_fits_a_model_returning_a_tuple():
    model = _Wrapped(lambda t: (t.sum(dim=1, keepdim=True), t))
    trainer = mp.Trainer(model, nn.MSELoss(), "sgd", metrics=())
    x, _ = classification_data(n=32)
    history = trainer.fit(x, torch.randn(32, 1), epochs=2, batch_size=16, verbose=0)
    assert len(history.history["loss"]) == 2


@pytest.mark.parametrize(
    ("wrap", "message"),
    [
        (lambda t: {"loss": t.sum()}, "a dict with keys ['loss'] and no 'logits' tensor"),
        (lambda t: ("text", t), "a tuple whose first item is a str"),
        (lambda t: (), "an empty tuple"),
        (lambda t: t.tolist(), "a list whose first item is a list"),
        (lambda t: 3.0, "a float"),
    ],
)
def test_an_output_without_a_tensor_to_take_says_what_is_needed(wrap, message):
    model = _Wrapped(wrap)
    step = mp.build_train_step(model, torch.optim.SGD(model.parameters(), lr=0.1), "mse")
    x, _ = classification_data(n=8)
    with pytest.raises(mp.ArgumentError) as info:
        step(x, torch.zeros(8, 10))
    assert str(info.value) == (
        f"model output is {message}; valid: a tensor, a tuple or list whose first item is a "
        "tensor, or a mapping with a 'logits' tensor"
    )


@pytest.mark.parametrize(
    ("loss_fn", "got"),
    [
        (nn.CrossEntropyLoss(reduction="none"), "a tensor of shape (8,) and dtype torch.float32"),
        (lambda out, y: (out.argmax(1) != y).sum(), "a tensor of shape () and dtype torch.int64"),
        (lambda out, y: out.detach().sum().item(), "a float"),
    ],
    ids=["reduction-none", "integer", "python-float"],
)
def test_a_loss_that_is_not_a_floating_scalar_is_refused(loss_fn, got):
    model = make_mlp()
    step = mp.build_train_step(model, torch.optim.SGD(model.parameters(), lr=0.1), loss_fn)
    x, y = classification_data(n=8)
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(mp.ArgumentError) as info:
        step(x, y)
    assert str(info.value) == (
        f"loss_fn returned {got}; valid: a floating-point scalar tensor "
        "(a loss with reduction='mean' or 'sum')"
    )
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))


def test_a_trainer_fits_evaluates_and_predicts_a_model_returning_a_dict():
    """HF-style outputs everywhere the Trainer calls the model: fit (cross-entropy reads the
    class count from the output), evaluate and predict take the ``logits``."""

    class DictOut(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.net = torch.nn.Linear(4, 3)

        def forward(self, x):
            return {"logits": self.net(x), "hidden": x}

    torch.manual_seed(0)
    x, y = torch.randn(32, 4), torch.randint(0, 3, (32,))
    trainer = mp.Trainer(DictOut(), "cross_entropy", "adam", policy="float32")
    trainer.fit(x, y, batch_size=8, epochs=1, verbose=0)
    assert set(trainer.evaluate(x, y)) >= {"loss", "accuracy"}
    assert trainer.predict(x).shape == (32, 3)


@pytest.mark.parametrize("compiled_ms", [0.0, 60.0], ids=["faster", "slower"])
def test_a_compiled_step_slower_than_eager_is_said_once(compiled_ms):
    # Issue 30: Trainer(compile=True) / build_train_step(compile=...) time steps 4-6 compiled
    # and 7-9 eagerly, once, and say when compiling made the step slower. The compiled
    # forward here is eager code made slower by a sleep (the eager backend compiles nothing).
    import time as _time

    x, y = classification_data(n=16)
    model = make_mlp()
    step = mp.build_train_step(
        model, torch.optim.SGD(model.parameters(), lr=0.1), "cross_entropy",
        compile={"backend": "eager"},
    )  # fmt: skip
    eager = step._forward_and_loss

    def slowed(xb, yb):
        _time.sleep(compiled_ms / 1000)
        return eager(xb, yb)

    def slowed_eager(xb, yb):  # 60 ms: more than a loaded machine's noise in one step
        _time.sleep(0.06)
        return eager(xb, yb)

    step._forward_loss = slowed
    if not compiled_ms:  # compiled faster: the eager steps sleep instead
        step._forward_and_loss = slowed_eager  # type: ignore[method-assign]
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        for _ in range(12):
            step(x, y)
    said = [w for w in record if "compiled training step took" in str(w.message)]
    if compiled_ms:
        assert len(said) == 1 and said[0].filename == __file__
        assert "compile=False trains faster here" in str(said[0].message)
        assert "(medians of 3 steps each, steps 4-9)" in str(said[0].message)
    else:
        assert said == []


def test_a_pure_policys_loss_by_name_is_computed_in_float32():
    """Trainer/build_train_step with policy="bfloat16" and the loss named: F.cross_entropy
    took the 16-bit output, and the first backward said "the loss is bfloat16: compute it
    in float32", which a loss given by name cannot do."""
    import warnings

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    step = mp.build_train_step(model, mp.CompensatedAdamW(model.parameters()), "cross_entropy",
                               "bfloat16", "O3")  # fmt: skip
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        loss, _ = step(torch.randn(8, 8), torch.randint(0, 4, (8,)))
    assert loss.dtype == torch.float32
