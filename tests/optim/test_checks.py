"""The set-up and step checks (``mixprec.optim.checks``): an optimizer built before the model
was prepared, a plain torch optimizer stepping a prepared model's 16-bit weights, a step with
no gradients, and the loss-scale health watch of custom loops."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

import mixprec as mp
from tests.conftest import classification_data, make_mlp
from tests.optim._helpers import loss_of

ORDER = (
    r"build the optimizer after auto_mixed_precision: model = mp.auto_mixed_precision\(model, "
    r"\.\.\.\); opt = mp.LossScaleOptimizer\(torch.optim.AdamW\(model.parameters\(\)\)\)"
)


def _weights(model: nn.Module) -> list[torch.Tensor]:
    return [p.detach().clone() for p in model.parameters()]


@pytest.mark.parametrize("policy", ["mixed_bfloat16", "mixed_float16"])
def test_optimizer_built_before_o2_preparation_is_refused_with_the_order(policy):
    model = make_mlp()
    opt = mp.LossScaleOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-2))
    mp.auto_mixed_precision(model, policy, "O2")
    with pytest.raises(mp.MisuseError, match=ORDER) as caught:
        opt.backward(loss_of(model))
    message = str(caught.value)
    assert "6 parameters" in message and "no float32 master" in message
    assert ("no loss scaling" in message) == (policy == "mixed_float16")


def test_float16_o1_preparation_after_the_optimizer_is_refused_for_its_scaler():
    # O1 keeps float32 weights, but float16 math needs the dynamic scaler the optimizer did
    # not choose when it was built over a float32 model.
    model = make_mlp()
    opt = mp.LossScaleOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    assert isinstance(opt.loss_scaler, mp.NoOpLossScaler)
    mp.auto_mixed_precision(model, "mixed_float16", "O1")
    with pytest.raises(mp.MisuseError, match="no loss scaling") as caught:
        opt.backward(loss_of(model))
    assert "no float32 master" not in str(caught.value)
    x, y = classification_data(n=8)
    grads = torch.autograd.grad(nn.functional.cross_entropy(model(x), y), list(model.parameters()))
    with pytest.raises(mp.MisuseError, match=ORDER):  # Keras' loop is checked too
        opt.apply_gradients(zip(grads, model.parameters(), strict=True))


def test_a_scaler_chosen_by_the_user_and_the_right_order_pass():
    model = make_mlp()
    opt = mp.LossScaleOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), mp.NoOpLossScaler())
    mp.auto_mixed_precision(model, "mixed_float16", "O1")
    opt.backward(loss_of(model))  # the user's scaler is the user's choice
    assert opt.step().applied
    model = mp.auto_mixed_precision(make_mlp(), "mixed_float16", "O2")
    opt = mp.LossScaleOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    opt.backward(loss_of(model))
    assert opt.step().applied


@pytest.mark.parametrize("amp_level", ["O2", "O3"])
def test_plain_optimizer_over_16bit_weights_with_masters_warns_once(amp_level):
    model = mp.auto_mixed_precision(make_mlp(), amp_level=amp_level)  # MindSpore's: masters
    opt = torch.optim.SGD(model.parameters(), lr=0.1)

    def step() -> None:
        opt.zero_grad()
        loss_of(model).backward()
        opt.step()

    with pytest.warns(UserWarning, match=r"SGD steps .* float16 parameters .* directly") as got:
        step()
    said = [w for w in got if "directly" in str(w.message)]
    assert len(said) == 1 and said[0].filename == __file__  # points at the caller's step
    message = str(said[0].message)
    assert "no float32 master" in message
    assert "opt = mp.LossScaleOptimizer(torch.optim.SGD(model.parameters(), ...))" in message
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        step()  # once per optimizer


@pytest.mark.parametrize("level", ["O1", "O2"])
def test_a_second_plain_optimizer_over_a_float16_model_is_told_of_the_scaling(level):
    """A Muon-style split, one optimizer wrapped and one not, under mixed_float16: the plain
    one stepped the scaled loss's gradients (a loss of 1110 where float32 reached 1.48), and
    at O1, every weight float32, nothing was said. Under a GradScaler's step (torch's or
    mixprec's, which unscale first) nothing is said."""
    model = mp.auto_mixed_precision(make_mlp(), "mixed_float16", level)
    rest = list(model[3].parameters())  # the LayerNorm, float32 at every level
    mats = [p for p in model.parameters() if all(p is not q for q in rest)]
    wrapped, plain = mp.LossScaleOptimizer(torch.optim.SGD(mats, lr=0.1)), torch.optim.SGD(rest)
    wrapped.backward(loss_of(model))
    wrapped.step()
    with pytest.warns(
        UserWarning,
        match=rf"SGD steps 2 parameters of a model prepared for "
        rf"float16 math \(level {level}\) by itself: nothing unscales",
    ) as got:
        plain.step()
    assert [w.filename for w in got if "by itself" in str(w.message)] == [__file__]
    scalers = (mp.GradScaler(), torch.amp.GradScaler("cpu")) if level == "O1" else ()
    for scaler in scalers:  # (torch's refuses O2's float16 gradients itself)
        other = mp.auto_mixed_precision(make_mlp(), "mixed_float16", level)
        opt = torch.optim.SGD(other.parameters(), lr=0.1)
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            scaler.scale(loss_of(other)).backward()
            scaler.step(opt)
            scaler.update()
        assert not [w for w in seen if "by itself" in str(w.message)]


@pytest.mark.parametrize("level", ["O1", "O2"])
def test_a_loop_that_unscales_by_hand_is_not_told_of_the_scaling(level):
    """MindSpore's manual loop (docs/migration.md): the scaler's unscale_(grads), then a
    plain step. It was told "nothing unscales or checks their gradients"."""
    model = mp.auto_mixed_precision(make_mlp(), "mixed_float16", level)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = mp.DynamicLossScaler()
    scaler.scale(loss_of(model)).backward()
    grads = [p.grad for p in model.parameters()]
    scaler.unscale_(grads)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        opt.step()
    assert not [w for w in seen if "by itself" in str(w.message)]


def test_gradients_no_unscale_reached_are_still_told_of_the_scaling():
    """A GAN's D unscaled by hand and G not (G's gradients the scale times too large),
    and an unscale_ of one gradient of four: both warned before the hand-unscale look, and
    must still (a first version took one id, which a new gradient could reuse)."""
    scaler = mp.DynamicLossScaler(init_scale=2.0**10)
    d, g = (mp.auto_mixed_precision(make_mlp(seed=s), "mixed_float16", "O1") for s in (0, 1))
    opt_d, opt_g = torch.optim.SGD(d.parameters(), lr=0.1), torch.optim.SGD(g.parameters())
    scaler.scale(loss_of(d)).backward()
    scaler.unscale_(p.grad for p in d.parameters())  # any iterable, as before
    opt_d.step()
    opt_d.zero_grad()
    scaler.scale(loss_of(g)).backward()
    with pytest.warns(UserWarning, match="by itself: nothing unscales"):
        opt_g.step()
    part = mp.auto_mixed_precision(make_mlp(seed=2), "mixed_float16", "O1")
    opt = torch.optim.SGD(part.parameters(), lr=0.1)
    scaler.scale(loss_of(part)).backward()
    scaler.unscale_([part[0].weight.grad])
    with pytest.warns(UserWarning, match="by itself: nothing unscales"):
        opt.step()


def test_no_scaling_warning_for_a_wrapped_delegating_optimizer_or_a_float32_model():
    """A Lookahead-style optimizer in a LossScaleOptimizer steps its base optimizer, whose
    gradients the wrapper unscaled; a model taken back to float32 (mp.to_float) computes
    in float32 and needs no scaling. Both were told their gradients went unscaled."""

    class Lookahead(torch.optim.Optimizer):
        def __init__(self, base: torch.optim.Optimizer) -> None:
            self.base = base
            super().__init__([p for g in base.param_groups for p in g["params"]], {})
            self.param_groups = base.param_groups

        def step(self, closure=None):  # type: ignore[override]
            return self.base.step()

    model = mp.auto_mixed_precision(make_mlp(), "mixed_float16", "O1")
    wrapped = mp.LossScaleOptimizer(Lookahead(torch.optim.SGD(model.parameters(), lr=0.1)))
    widened = mp.to_float(mp.auto_mixed_precision(make_mlp(), "mixed_float16", "O1"), "float32")
    plain = torch.optim.SGD(widened.parameters(), lr=0.1)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        wrapped.backward(loss_of(model))
        assert wrapped.step().applied
        loss_of(widened).backward()
        plain.step()
    assert not [w for w in seen if "by itself" in str(w.message)]


def test_no_warning_for_a_loss_scale_optimizer_or_pure_16bit_o3():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        model = mp.auto_mixed_precision(make_mlp(), "mixed_bfloat16", "O2")
        opt = mp.LossScaleOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))
        opt.backward(loss_of(model))
        assert opt.step().applied
        pure = mp.auto_mixed_precision(make_mlp(), "bfloat16", "O3")  # no masters, by design
        plain = mp.CompensatedAdamW(pure.parameters(), lr=1e-3)
        loss_of(pure).backward()
        plain.step()


INNER_STEP = (
    r"SGD.step\(\) was called on the optimizer a LossScaleOptimizer wraps: .*inf/NaN check "
    r"and the float32 master weights"
)


@pytest.mark.parametrize(("policy", "level"), [("mixed_bfloat16", "O2"), ("mixed_float16", "O1")])
def test_stepping_the_wrapped_optimizer_itself_is_refused(policy, level):
    """The wrapper's inner optimizer stepped by the user: at O2 it holds the masters, which
    have no gradients (the 16-bit weights never moved); under float16 at O1 it applied the
    scaled gradients unchecked (every weight NaN within 10 steps). Neither said a word."""
    model = mp.auto_mixed_precision(make_mlp(), policy, level)
    before = _weights(model)
    inner = torch.optim.SGD(model.parameters(), lr=0.1)
    opt = mp.LossScaleOptimizer(inner)
    opt.backward(loss_of(model))
    with pytest.raises(mp.MisuseError, match=INNER_STEP):
        inner.step()
    assert all(torch.equal(a, b) for a, b in zip(before, _weights(model), strict=True))
    assert opt.step().applied  # the wrapper's own step goes on, through the inner one
    assert not all(torch.equal(a, b) for a, b in zip(before, _weights(model), strict=True))
    opt.zero_grad()
    opt.backward(loss_of(model))
    assert opt.step().applied
    # After the wrapper's own steps too (a loop calling both stepped twice: 1.83x).
    opt.zero_grad()
    opt.backward(loss_of(model))
    with pytest.raises(mp.MisuseError, match=INNER_STEP):
        inner.step()


def test_a_second_wrapper_over_one_optimizer_leaves_the_first_one_working_and_guarded():
    """A float32 model's optimizer wrapped twice (no masters to refuse it): the first
    wrapper's steps were refused as the optimizer's own, and once the second wrapper was
    gone, the optimizer's own step went through while the first still wrapped it."""
    import gc

    model = make_mlp()
    inner = torch.optim.SGD(model.parameters(), lr=0.1)
    first = mp.LossScaleOptimizer(inner)
    second = mp.LossScaleOptimizer(inner)
    first.backward(loss_of(model))
    assert first.step().applied
    del second
    gc.collect()
    first.zero_grad()
    first.backward(loss_of(model))
    with pytest.raises(mp.MisuseError, match=INNER_STEP):
        inner.step()
    assert first.step().applied


@pytest.mark.parametrize("policy", ["mixed_bfloat16", "mixed_float16"])
def test_the_wrapped_optimizers_zero_grad_clears_what_the_wrappers_does(policy):
    """torch.amp's loop keeps ``optimizer.zero_grad()`` after wrapping: at O2 its groups hold
    the float32 masters, so it cleared theirs alone and the 16-bit weights' gradients added
    up over every step (a gradient norm of 0.853 against float32's 0.234 after 20 steps)."""
    x, y = classification_data(n=64, seed=1)
    control = make_mlp()
    model = mp.auto_mixed_precision(make_mlp(), policy, "O2")
    model.load_state_dict(control.state_dict())
    plain = torch.optim.SGD(control.parameters(), lr=0.1)
    inner = torch.optim.SGD(model.parameters(), lr=0.1)
    opt = mp.LossScaleOptimizer(inner)
    for i in range(8):
        xb, yb = x[i * 8 : (i + 1) * 8], y[i * 8 : (i + 1) * 8]
        plain.zero_grad()
        nn.functional.cross_entropy(control(xb), yb).backward()
        plain.step()
        inner.zero_grad()  # the old line, on the optimizer the wrapper holds
        opt.backward(nn.functional.cross_entropy(model(xb).float(), yb))
        assert opt.step().applied
    for a, b in zip(control.parameters(), model.parameters(), strict=True):
        torch.testing.assert_close(b.float(), a, atol=1e-2, rtol=0)  # 16-bit rounding
    inner.zero_grad(set_to_none=False)  # torch's keyword, passed on
    assert all(p.grad is not None and not p.grad.any() for p in model.parameters())


def test_the_inner_optimizer_is_its_own_again_once_its_wrapper_is_gone():
    import gc

    model = make_mlp()  # float32: an optimizer that needs no wrapper
    inner = torch.optim.SGD(model.parameters(), lr=0.1)
    opt = mp.LossScaleOptimizer(inner)
    del opt
    gc.collect()
    loss_of(model).backward()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        inner.step()


def test_a_plain_optimizer_is_looked_at_again_when_its_model_is_prepared():
    """Float32 warm-up steps, then the model prepared at O2 under the same plain optimizer:
    the guard had looked at that optimizer already (any model prepared earlier in the
    process installed it) and let its 16-bit steps through."""
    mp.auto_mixed_precision(make_mlp(), "mixed_bfloat16", "O2")  # the guard installed
    model = make_mlp()
    plain = torch.optim.SGD(model.parameters(), lr=0.1)
    loss_of(model).backward()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        plain.step()  # float32: nothing to say
    mp.auto_mixed_precision(model, "mixed_bfloat16", "O2")
    plain.zero_grad()
    loss_of(model).backward()
    with pytest.warns(UserWarning, match=r"SGD steps .* bfloat16 parameters .* directly"):
        plain.step()


@pytest.mark.parametrize(("policy", "level"), [("float32", "O0"), ("mixed_float16", "O2")])
def test_a_step_without_gradients_applies_nothing_and_says_so_once(policy, level):
    model = mp.auto_mixed_precision(make_mlp(), policy, level)
    opt = mp.LossScaleOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-2))
    before, scaler = _weights(model), opt.loss_scaler.state
    opt.backward(loss_of(model))
    opt.zero_grad()  # between backward and step: the gradients are gone
    with pytest.warns(UserWarning, match=r"no parameter has a gradient.*zero_grad\(\)") as got:
        result = opt.step()
    assert [w.filename for w in got if "gradient" in str(w.message)] == [__file__]
    assert not result.applied and not result.found_inf and not result.accumulating
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))
    assert opt.loss_scaler.state == scaler  # not a step: the scale's counters do not move
    opt.backward(loss_of(model))
    opt.zero_grad()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert not opt.step().applied  # said once per optimizer
    opt.backward(loss_of(model))
    assert opt.step().applied  # a normal step afterwards


def test_custom_loop_stuck_at_the_scale_floor_warns_once():
    # Every batch overflows: from 4 the scale backs off to its floor, 1, and stays there,
    # skipping 60 of 60 steps. The custom loop hears it once, from the optimizer.
    model = mp.auto_mixed_precision(make_mlp(), "mixed_float16", "O2")
    opt = mp.LossScaleOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.1), mp.DynamicLossScaler(init_scale=4.0)
    )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        results = []
        for _ in range(60):
            opt.zero_grad()
            opt.backward(loss_of(model, scale=float("inf")))
            results.append(opt.step())
    assert not any(r.applied for r in results) and opt.loss_scaler.get_scale() == 1.0
    said = [w for w in caught if issubclass(w.category, UserWarning)]
    assert len(said) == 1, [str(w.message) for w in said]
    assert str(said[0].message).startswith("training is stuck: the loss scale is at its floor")
    assert "trace_overflow=True" in str(said[0].message)
    assert said[0].filename == __file__


def test_health_watch_can_be_turned_off_and_names_the_module_when_traced():
    model = mp.auto_mixed_precision(make_mlp(), "mixed_float16", "O2")
    opt = mp.LossScaleOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.1), mp.DynamicLossScaler(init_scale=2.0)
    )
    assert isinstance(opt.health, mp.ScalerHealth)
    opt.health = None  # e.g. a training loop that watches the scaler itself
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for _ in range(20):
            opt.zero_grad()
            opt.backward(loss_of(model, scale=float("inf")))
            assert not opt.step().applied
    traced = mp.LossScaleOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.1),
        mp.DynamicLossScaler(init_scale=2.0),
        trace_overflow=True,
    )
    x, y = classification_data(n=32)
    x[0, 0] = float("inf")
    with pytest.warns(UserWarning, match=r"training is stuck.*came from 0 \(Linear\)"):
        for _ in range(6):
            traced.zero_grad()
            traced.backward(nn.functional.cross_entropy(model(x), y))
            traced.step()


def test_stuck_while_traced_with_no_module_found_does_not_ask_for_tracing():
    # The inf is in the gradient of a parameter outside the model (a learned temperature
    # in the loss): tracing, on, finds no module. The warning used to say "run with
    # trace_overflow=True to name it"; it now says where else the values turn non-finite.
    model = mp.auto_mixed_precision(make_mlp(), "mixed_float16", "O1")
    temperature = nn.Parameter(torch.ones(()))
    opt = mp.LossScaleOptimizer(
        torch.optim.SGD([*model.parameters(), temperature], lr=0.1),
        mp.DynamicLossScaler(init_scale=2.0),
        trace_overflow=model,
    )
    x, y = classification_data(n=32)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(6):
            opt.zero_grad()
            with torch.autocast("cpu", torch.float16):
                out = model(x)
            # d/dt of t * 1e30 * 1e30 is 1e60: inf in float32, at any scale.
            opt.backward(nn.functional.cross_entropy(out.float(), y) + temperature * 1e30 * 1e30)
            assert not opt.step().applied
    said = [str(w.message) for w in caught if str(w.message).startswith("training is stuck")]
    assert len(said) == 1, said
    assert "Tracing the step found no module whose output or gradient was inf/NaN" in said[0]
    assert "trace_overflow=True" not in said[0]
    assert "the last 3 steps there were all skipped" in said[0]  # no step spent asking


def _with_norm() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.LayerNorm(32), nn.ReLU(), nn.Linear(32, 4))


@pytest.mark.parametrize("level", ["O1", "O2"])
@pytest.mark.parametrize("cast", ["to", "half"])
def test_a_16bit_cast_after_training_started_is_refused_at_the_next_backward(level, cast):
    # SGD without momentum and RMSprop step 16-bit parameters without a word: the O1 model
    # (or O2's float32 norms) would train on in 16 bits with no masters.
    model = mp.auto_mixed_precision(_with_norm(), "mixed_bfloat16", level)
    opt = mp.LossScaleOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    x, y = torch.randn(8, 16), torch.randint(0, 4, (8,))
    for _ in range(2):
        opt.zero_grad()
        opt.backward(nn.functional.cross_entropy(model(x), y))
        assert opt.step().applied
    if cast == "to":
        model.to(torch.bfloat16)
    else:
        model.half()
    opt.zero_grad()
    with pytest.raises(mp.MisuseError, match="cast to 16 bits .* after its first backward") as got:
        opt.backward(nn.functional.cross_entropy(model(x.to(torch.bfloat16)).float(), y))
    kind = "bfloat16" if cast == "to" else "float16"
    plain = 6 if level == "O1" else 2  # O2's two LayerNorm parameters have no masters
    assert f"{plain} parameters it holds are now {kind}" in str(got.value)


def test_the_way_on_after_a_cast_mid_training_works_as_written(tmp_path):
    """The error after a cast said "prepare it again and build a new optimizer", which
    auto_mixed_precision refuses for a prepared model, cast or not; and "the model now
    computes in float16" of a bfloat16 model whose parameters .half() made float16. It now
    says what works, followed here as written: a fresh model, prepared, a new optimizer,
    the last checkpoint loaded into both; training goes on from the checkpoint's masters."""
    model = mp.auto_mixed_precision(_with_norm(), "mixed_bfloat16", "O2")
    opt = mp.LossScaleOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    x, y = torch.randn(8, 16), torch.randint(0, 4, (8,))
    opt.backward(nn.functional.cross_entropy(model(x), y))
    opt.step()
    path = mp.save_checkpoint(tmp_path / "last.safetensors", model, opt)
    masters = [m.clone() for _, m in opt.master_weights()]
    model.half()
    with pytest.raises(mp.MisuseError) as got:
        opt.backward(nn.functional.cross_entropy(model(x.half()).float(), y))
    said = str(got.value)
    assert "its parameters are now float16, which needs loss scaling" in said
    assert "build it afresh in float32, then build the optimizer after auto_mixed_precision" in said
    assert said.endswith("and load your last checkpoint into both: "
                         "mp.load_checkpoint(path, model, opt)")  # fmt: skip
    with pytest.raises(RuntimeError, match="already applied"):  # "prepare it again": refused
        mp.auto_mixed_precision(model, "mixed_bfloat16", "O2")
    model = mp.auto_mixed_precision(_with_norm(), "mixed_bfloat16", "O2")
    opt = mp.LossScaleOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    mp.load_checkpoint(path, model, opt)
    for saved, (_, master) in zip(masters, opt.master_weights(), strict=True):
        assert torch.equal(saved, master)
    opt.backward(nn.functional.cross_entropy(model(x), y))
    assert opt.step().applied


def test_half_mid_training_of_an_o2_model_with_no_float32_parameter_is_refused():
    """An O2 model with no norm layer keeps every parameter behind a master: ``.half()``
    after training started changed only the 16-bit weights, which were not looked at, and
    the float16 model trained on with no loss scaling (41% of the first layer's gradients
    0), unsaid. A change of 16-bit dtype that loses nothing is looked at once."""
    torch.manual_seed(0)
    model = mp.auto_mixed_precision(
        nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4)), "mixed_bfloat16", "O2"
    )
    opt = mp.LossScaleOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    assert not opt._weights.plain  # the case in question: every parameter has a master
    x, y = torch.randn(8, 16), torch.randint(0, 4, (8,))
    opt.backward(nn.functional.cross_entropy(model(x), y))
    opt.step()
    model.half()
    opt.zero_grad()
    with pytest.raises(mp.MisuseError, match="does no loss scaling"):
        opt.backward(nn.functional.cross_entropy(model(x.half()).float(), y))
    # mixed_float16 cast to bfloat16: scaled, nothing lost; looked at once, then not.
    model = mp.auto_mixed_precision(
        nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4)), "mixed_float16", "O2"
    )
    opt = mp.LossScaleOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    opt.backward(nn.functional.cross_entropy(model(x), y))
    opt.step()
    model.bfloat16()
    for _ in range(2):
        opt.zero_grad()
        opt.backward(nn.functional.cross_entropy(model(x.bfloat16()).float(), y))
        opt.step()
        assert not opt._setup.due(opt._weights)


def test_an_o3_model_back_in_float32_trains_on_and_is_not_looked_at_again():
    model = mp.auto_mixed_precision(_with_norm(), "mixed_bfloat16", "O3")
    opt = mp.LossScaleOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    x, y = torch.randn(8, 16), torch.randint(0, 4, (8,))
    opt.backward(nn.functional.cross_entropy(model(x), y))
    opt.step()
    model.float()  # a widening loses nothing
    for _ in range(2):
        opt.zero_grad()
        opt.backward(nn.functional.cross_entropy(model(x), y))
        assert opt.step().applied
        assert not opt._setup.due(opt._weights)


@pytest.mark.parametrize("set_to_none", [True, False])
def test_gradients_cleared_inside_an_accumulation_group_are_refused(set_to_none):
    """``model.zero_grad()`` before each backward, in a loop given ``accumulation_steps=4``:
    each micro-batch's gradients were dropped, and the group's step applied the last one
    alone, still divided by 4 (its update 0.39 where the group's was 0.69), saying
    nothing."""
    model = mp.auto_mixed_precision(make_mlp(), "mixed_bfloat16", "O2")
    opt = mp.LossScaleOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), accumulation_steps=4)
    model.zero_grad(set_to_none=set_to_none)
    opt.backward(loss_of(model))
    opt.step()
    model.zero_grad(set_to_none=set_to_none)
    with pytest.raises(mp.MisuseError, match=r"first 1 micro-batch were cleared .*opt.zero_grad"):
        opt.backward(loss_of(model))


def test_an_accumulation_loop_that_keeps_its_gradients_is_not_stopped():
    """opt.zero_grad() between micro-batches keeps them; a gradient edited in place (noise
    added, not cleared) is the loop's own business."""
    model = mp.auto_mixed_precision(make_mlp(), "mixed_bfloat16", "O2")
    opt = mp.LossScaleOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), accumulation_steps=3)
    for i in range(6):
        opt.zero_grad()
        opt.backward(loss_of(model))
        if i == 1:
            with torch.no_grad():
                next(model.parameters()).grad.add_(1e-3)
        result = opt.step()
        assert result.applied == (i % 3 == 2)


@pytest.mark.parametrize("policy", ["mixed_bfloat16", "mixed_float16"])
def test_two_backwards_per_micro_batch_are_refused_and_a_whole_group_before_a_step_is_not(
    policy,
):
    """Two losses per micro-batch with ``accumulation_steps=4``: each backward counted as a
    micro-batch, so the group was applied after two micro-batches (4 steps where float32
    took 2), unsaid."""
    model = mp.auto_mixed_precision(make_mlp(), policy, "O2")
    opt = mp.LossScaleOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), accumulation_steps=4)
    opt.backward(loss_of(model))
    opt.backward(loss_of(model))
    said = r"2 backward\(\) calls since the last step\(\), with accumulation_steps=4: "
    before = _weights(model)
    with pytest.raises(mp.MisuseError, match=said + r".*opt.backward\(loss_a \+ loss_b\)"):
        opt.step()
    # Refused, the group is dropped: a second step() does not apply it.
    with pytest.raises(mp.MisuseError, match=r"without a new backward"):
        opt.step()
    assert all(torch.equal(a, b) for a, b in zip(before, _weights(model), strict=True))
    # The loop that steps every N-th batch: a whole group's backwards, then one step.
    x, y = classification_data(n=64)
    control = make_mlp()
    model = mp.auto_mixed_precision(make_mlp(), policy, "O1")
    opt = mp.LossScaleOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), accumulation_steps=4)
    for i in range(4):
        opt.backward(
            nn.functional.cross_entropy(model(x[16 * i : 16 * (i + 1)]), y[16 * i : 16 * (i + 1)])
        )
    assert opt.step().applied
    nn.functional.cross_entropy(control(x), y).backward()
    torch.optim.SGD(control.parameters(), lr=0.1).step()
    for a, b in zip(control.parameters(), model.parameters(), strict=True):
        torch.testing.assert_close(b, a, atol=2e-3, rtol=0)  # 16-bit compute


def test_clipping_the_scaled_gradients_before_the_unscale_warns_once():
    """The torch.amp habit without its unscale: under float16 the clip saw gradients about
    65536 times too large and cut them by that (the loss 1.48 after 100 steps where
    max_grad_norm= reached 0.001), saying nothing."""
    model = mp.auto_mixed_precision(make_mlp(), "mixed_float16", "O2")
    opt = mp.LossScaleOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))

    def step(clip_first: bool) -> None:
        opt.zero_grad()
        opt.backward(loss_of(model))
        if not clip_first:
            opt.unscale_()
        nn.utils.clip_grad_norm_(model.parameters() if clip_first else opt.master_params(), 1.0)
        opt.step()

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        step(clip_first=False)  # unscale_() first, as the docs say: nothing to say
    with pytest.warns(
        UserWarning,
        match=r"rewritten between backward\(\) and the unscale, while still multiplied by the "
        r"loss scale \(65536\)",
    ) as got:
        step(clip_first=True)
    said = [w for w in got if "loss scale" in str(w.message)]
    assert len(said) == 1 and said[0].filename == __file__
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        step(clip_first=True)  # said once


def test_clipping_before_the_step_at_scale_one_is_not_warned_about():
    """bfloat16: no loss scale, so a clip before the step clips the real gradients."""
    model = mp.auto_mixed_precision(make_mlp(), "mixed_bfloat16", "O2")
    opt = mp.LossScaleOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for _ in range(4):
            opt.zero_grad()
            opt.backward(loss_of(model))
            nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            assert opt.step().applied


def test_two_wrappers_over_one_loss_are_pointed_to_one_wrapper_over_both():
    """opt_a.backward(loss); opt_a.step(); opt_b.step(): the refusal said to call
    opt_b.backward(loss) first, and following it added every gradient twice (each update
    exactly 2.00x too large). It now names one LossScaleOptimizer over both."""
    model = mp.auto_mixed_precision(make_mlp(), "mixed_float16", "O2")
    body = [p for name, p in model.named_parameters() if not name.startswith("5.")]
    inner_a = torch.optim.SGD(body, lr=0.01)
    inner_b = torch.optim.SGD(model[5].parameters(), lr=0.1)
    opt_a, opt_b = mp.LossScaleOptimizer(inner_a), mp.LossScaleOptimizer(inner_b)
    opt_a.backward(loss_of(model))
    assert opt_a.step().applied
    with pytest.raises(
        mp.MisuseError, match=r"did not run.*mp.LossScaleOptimizer\(\[opt_a, opt_b\]\)"
    ):
        opt_b.step()
    both = mp.LossScaleOptimizer(
        [torch.optim.SGD(body, lr=0.01), torch.optim.SGD(model[5].parameters(), lr=0.1)]
    )
    before = _weights(model)
    both.zero_grad()
    both.backward(loss_of(model))
    assert both.step().applied
    moved = [not torch.equal(a, b) for a, b in zip(before, _weights(model), strict=True)]
    assert all(moved)


class _FailsInBackward(torch.autograd.Function):
    """Identity whose backward raises (an out-of-memory half way through a backward)."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        raise MemoryError("simulated: out of memory in the backward")


def test_a_backward_that_raises_drops_its_accumulation_group():
    """The failed micro-batch had added its last layers' gradients but not its first's,
    and was counted: the next group applied after fewer batches, a mix that included the
    failed batch in one layer and not in another (0.31 and 0.43 from either reference)."""
    x, y = classification_data(n=32)

    def build():
        model = mp.auto_mixed_precision(make_mlp(), "mixed_bfloat16", "O2")
        sgd = torch.optim.SGD(model.parameters(), lr=0.1)
        return model, mp.LossScaleOptimizer(sgd, accumulation_steps=2)

    model, opt = build()
    opt.backward(nn.functional.cross_entropy(model(x[:8]), y[:8]))
    # Between the layers: the head's gradients are added, then the backward raises.
    hook = model[2].register_forward_hook(lambda m, a, out: _FailsInBackward.apply(out))
    with pytest.raises(MemoryError):
        opt.backward(nn.functional.cross_entropy(model(x[8:16]), y[8:16]))
    hook.remove()
    assert opt.pending_micro_steps == 0
    assert all(p.grad is None for p in model.parameters())
    twin, twin_opt = build()  # the same two batches, with nothing before them
    for m, o in ((model, opt), (twin, twin_opt)):
        for i in (16, 24):
            o.backward(nn.functional.cross_entropy(m(x[i : i + 8]), y[i : i + 8]))
            result = o.step()
        assert result.applied
    assert all(
        torch.equal(a, b) for a, b in zip(model.parameters(), twin.parameters(), strict=True)
    )


def test_a_fit_after_one_stopped_mid_group_drops_that_group_and_says_so():
    """Ctrl-C between two micro-batches of a group, then fit again: the new fit added its
    first batches to the old group's gradients (a group spanning two fit calls)."""
    x, y = classification_data(n=32)
    model = make_mlp()
    trainer = mp.Trainer(model, "cross_entropy", torch.optim.SGD(model.parameters(), lr=0.1),
                         policy="mixed_bfloat16", device="cpu", metrics=(),
                         accumulation_steps=4)  # fmt: skip

    class StopAt(mp.Callback):
        def on_train_batch_end(self, step, logs):
            if step == 1:
                raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        trainer.fit(x, y, batch_size=4, epochs=1, verbose=0, callbacks=[StopAt()])
    assert trainer.optimizer.pending_micro_steps == 2
    with pytest.warns(UserWarning, match=r"2 of 4 micro-batches of a group an earlier fit left"):
        trainer.fit(x, y, batch_size=4, epochs=1, verbose=0)
    assert trainer.optimizer.pending_micro_steps == 0


class _SharedTrunk(nn.Module):
    """Two heads over one trunk: each loss reaches the trunk."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.trunk, self.a, self.b = nn.Linear(8, 16), nn.Linear(16, 1), nn.Linear(16, 1)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = torch.relu(self.trunk(x))
        return self.a(h), self.b(h)


def test_a_gradient_another_optimizer_scaled_differently_is_said():
    """Two LossScaleOptimizers over one model (trunk and head a; head b), one backward
    each: the trunk's gradient held la * 1024 + lb * 65536, which the first divided by 1024,
    applying lb's part 64 times (the trunk 1.09 off float32 after 3 steps), unsaid."""
    model = mp.auto_mixed_precision(_SharedTrunk(), "mixed_float16", "O2")
    first = [*model.trunk.parameters(), *model.a.parameters()]
    opt_a = mp.LossScaleOptimizer(torch.optim.SGD(first, lr=0.1), mp.StaticLossScaler(2.0**10))
    opt_b = mp.LossScaleOptimizer(
        torch.optim.SGD(model.b.parameters(), lr=0.1), mp.StaticLossScaler(2.0**16)
    )
    x, y = torch.randn(32, 8), torch.randn(32, 1)
    ya, yb = model(x)
    opt_a.backward(((ya.float() - y) ** 2).mean(), retain_graph=True)
    opt_b.backward(((yb.float() - y) ** 2).mean())
    said = r"^another LossScaleOptimizer's backward, at loss scale 65536, added to gradients"
    with pytest.warns(UserWarning, match=said + r" of this one's \(scale 1024\)") as got:
        opt_a.step()
    assert "comes out 64 times too large or small" in str(got[0].message)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the second's gradients are its own: nothing to say
        opt_b.step()


def test_an_unrelated_models_backward_before_a_clip_of_ones_own_is_not_said():
    """Model A (float16, scale 65536) and model B (bfloat16, scale 1) share nothing; B
    clips its own gradients between its backward and step, as it may at scale 1. A's
    backward in between was taken for an addition to B's gradients: B said they came out
    65536 times too large and advised merging the optimizers."""
    a = mp.auto_mixed_precision(make_mlp(0), "mixed_float16", "O1")
    b = mp.auto_mixed_precision(make_mlp(1), "mixed_bfloat16", "O2")
    opt_a = mp.LossScaleOptimizer(torch.optim.SGD(a.parameters(), lr=0.1))
    opt_b = mp.LossScaleOptimizer(torch.optim.SGD(b.parameters(), lr=0.1))
    x, y = classification_data(n=16)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for _ in range(3):
            opt_a.zero_grad()
            opt_b.zero_grad()
            opt_b.backward(nn.functional.cross_entropy(b(x), y))
            opt_a.backward(nn.functional.cross_entropy(a(x), y))
            nn.utils.clip_grad_norm_(b.parameters(), 0.01)
            assert opt_b.step().applied and opt_a.step().applied


def test_a_loop_that_steps_whole_groups_applies_an_epochs_shorter_last_group_as_its_mean():
    """10 batches at accumulation_steps=4, step() every 4th and at the epoch's end (the loop
    Hugging Face documents): the last 2 were refused as "2 backward() calls" and dropped,
    and a last 1 went into the next epoch's first group, which then raised. Applied as the
    mean of its micro-batches, as a float32 loop that divides by the group's size does."""
    x, y = classification_data(n=80)
    batches = [(x[8 * i : 8 * (i + 1)], y[8 * i : 8 * (i + 1)]) for i in range(10)]
    model = mp.auto_mixed_precision(make_mlp(), "float32")
    opt = mp.LossScaleOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), accumulation_steps=4)
    control = make_mlp()
    plain = torch.optim.SGD(control.parameters(), lr=0.1)
    for length in (10, 9):  # groups of 4, 4, 2; then 4, 4, 1
        group: list[int] = []
        for i, (xb, yb) in enumerate(batches[:length]):
            opt.backward(nn.functional.cross_entropy(model(xb), yb))
            group.append(i)
            if len(group) == 4 or i + 1 == length:
                assert opt.step().applied and opt.pending_micro_steps == 0
                opt.zero_grad()
                for j in group:
                    xj, yj = batches[j]
                    (nn.functional.cross_entropy(control(xj), yj) / len(group)).backward()
                plain.step()
                plain.zero_grad()
                group = []
    for a, b in zip(control.parameters(), model.parameters(), strict=True):
        torch.testing.assert_close(b, a, atol=1e-6, rtol=1e-5)
    # A step() after each backward since: accumulation as before (not taken for tails).
    for i in range(4):
        opt.backward(loss_of(model))
        assert opt.step().applied == (i == 3)


def test_clipping_by_hand_before_an_epochs_shorter_last_group_applies_it_as_its_mean():
    """unscale_() then clip_grad_norm_ before each step (the Hugging Face no-trainer loop):
    the epoch's last 2 of 4 raised "unscale_() called after 2 of 4 micro-batches", for a
    group that has no further micro-batch. Its unscale takes the group's mean, once."""
    x, y = classification_data(n=80)
    model = mp.auto_mixed_precision(make_mlp(), "float32")
    opt = mp.LossScaleOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), accumulation_steps=4)
    control = make_mlp()
    plain = torch.optim.SGD(control.parameters(), lr=0.1)
    group: list[int] = []
    for i in range(10):  # groups of 4, 4 and 2
        opt.backward(nn.functional.cross_entropy(model(x[8 * i : 8 * i + 8]), y[8 * i : 8 * i + 8]))
        group.append(i)
        if len(group) == 4 or i == 9:
            opt.unscale_()
            nn.utils.clip_grad_norm_(list(opt.master_params()), 0.5)
            assert opt.step().applied
            opt.zero_grad()
            for j in group:
                loss = nn.functional.cross_entropy(
                    control(x[8 * j : 8 * j + 8]), y[8 * j : 8 * j + 8]
                )
                (loss / len(group)).backward()
            nn.utils.clip_grad_norm_(list(control.parameters()), 0.5)
            plain.step()
            plain.zero_grad()
            group = []
    for a, b in zip(control.parameters(), model.parameters(), strict=True):
        torch.testing.assert_close(b, a, atol=1e-6, rtol=1e-5)
    # Outside a loop of whole groups, unscale_() before a group's last micro-batch still
    # raises.
    opt.backward(loss_of(model))
    opt.step()
    opt.backward(loss_of(model))
    with pytest.raises(mp.MisuseError, match=r"unscale_\(\) called after 2 of 4 accumulation"):
        opt.unscale_()


@pytest.mark.parametrize(
    ("build", "said"),
    [
        (lambda inner: mp.LossScaleOptimizer([inner, inner]),
         r"optimizer lists the same SGD twice \(at 1 and at 0\); list it once"),
        (lambda inner: mp.LossScaleOptimizer(inner, trace_overflow="yes"),
         r"trace_overflow='yes' is invalid; use True, False or the model"),
        (lambda inner: mp.LossScaleOptimizer(inner, keep_grad_buffers=1),
         r"keep_grad_buffers must be True or False, got 1"),
    ],
)  # fmt: skip
def test_a_refused_wrap_leaves_the_torch_optimizer_stepping_the_model(build, said):
    """A wrap refused after its groups were adopted left the torch optimizer over detached
    float32 masters: its own step then moved nothing, and a second wrap was refused as "a
    cell run again". Arguments are checked first, and an adoption refused half way (a
    parameter in two groups) is put back."""
    model = mp.auto_mixed_precision(make_mlp(), "mixed_float16", "O2")
    inner = torch.optim.SGD(model.parameters(), lr=0.5)
    given = [p for g in inner.param_groups for p in g["params"]]
    with pytest.raises(mp.ArgumentError, match=said):
        build(inner)
    held = [p for g in inner.param_groups for p in g["params"]]
    assert all(a is b for a, b in zip(given, held, strict=True))
    opt = mp.LossScaleOptimizer(inner)  # wrapped once fixed, and trains the model
    before = model[0].weight.detach().clone()
    x, y = classification_data(n=16)
    opt.backward(nn.functional.cross_entropy(model(x), y))
    assert opt.step().applied and not torch.equal(before, model[0].weight)


def test_a_parameter_in_two_optimizers_puts_back_every_group_adopted():
    """Also the float32 values: the masters made before the refusal went with it, and
    the wrap retried once fixed started from the 16-bit roundings (4.9e-4 off) and said
    an earlier optimizer was gone."""
    float32 = make_mlp()
    model = mp.auto_mixed_precision(make_mlp(), "mixed_float16", "O2")
    every = list(model.parameters())
    first, second = torch.optim.SGD(every, lr=0.1), torch.optim.Adam(every[:1])
    with pytest.raises(
        mp.ArgumentError,
        match=r"optimizers\[1\]\.param_groups\[0\]\['params'\]\[0\].*already a parameter",
    ):
        mp.LossScaleOptimizer([first, second])
    assert all(a is b for a, b in zip(every, first.param_groups[0]["params"], strict=True))
    assert second.param_groups[0]["params"][0] is every[0]
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no "masters in an earlier LossScaleOptimizer"
        opt = mp.LossScaleOptimizer(first)  # wraps once fixed
    masters = dict(opt.master_weights())
    for p, q in zip(every, float32.parameters(), strict=True):
        if p.dtype == torch.float16:
            assert torch.equal(masters[p], q.detach())  # the exact float32 values


def test_a_copy_taken_between_backward_and_step_holds_no_pending_micro_batch():
    """torch drops .grad in a deep copy: the copy's optimizer still counted the original's
    micro-batch, and its next backward was refused as "model.zero_grad() between
    micro-batches?"."""
    import copy

    model = mp.auto_mixed_precision(make_mlp(), "mixed_bfloat16", "O2")
    opt = mp.LossScaleOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), accumulation_steps=2)
    x, y = classification_data(n=16)
    opt.backward(nn.functional.cross_entropy(model(x), y))
    model2, opt2 = copy.deepcopy((model, opt))
    assert opt.pending_micro_steps == 1 and opt2.pending_micro_steps == 0
    for _ in range(2):
        opt2.backward(nn.functional.cross_entropy(model2(x), y))
        result = opt2.step()
    assert result.applied
