"""mp.GradScaler against torch.amp.GradScaler on CPU: same scales, same parameters (bitwise),
same errors on misuse."""

from __future__ import annotations

import copy
import pickle
import warnings

import pytest
import torch
from torch import nn

import mixprec as mp
from tests.conftest import classification_data, make_mlp

INJECT = {3, 4, 9}  # steps whose loss is blown up to overflow the float16 gradients


def loop(scaler_cls, opt_factory, steps=14, unscale_every=2, **scaler_kwargs):
    model = make_mlp(seed=5)
    opt = opt_factory(model.parameters())
    scaler = scaler_cls("cpu", init_scale=2.0**14, growth_interval=3, **scaler_kwargs)
    x, y = classification_data(n=64)
    scales, returns = [], []
    for step in range(steps):
        opt.zero_grad()
        with torch.autocast("cpu", dtype=torch.float16):
            loss = nn.functional.cross_entropy(model(x), y)
        if step in INJECT:
            loss = loss * 1e30
        scaler.scale(loss).backward()
        if step % unscale_every == 0:
            scaler.unscale_(opt)
            nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        returns.append(scaler.step(opt))
        scaler.update()
        scales.append(scaler.get_scale())
    return scales, [p.detach().clone() for p in model.parameters()], scaler, returns


@pytest.mark.parametrize(
    "opt_factory",
    [
        lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9),
        lambda p: torch.optim.AdamW(p, lr=1e-2, foreach=True),
        lambda p: torch.optim.Adam(p, lr=1e-2, fused=True),  # _step_supports_amp_scaling path
    ],
    ids=["sgd", "adamw-foreach", "adam-fused"],
)
def test_same_scales_and_parameters_as_torch(opt_factory):
    ref_scales, ref_params, ref, ref_ret = loop(torch.amp.GradScaler, opt_factory)
    our_scales, our_params, ours, our_ret = loop(mp.GradScaler, opt_factory)
    assert our_scales == ref_scales
    assert len(set(ref_scales)) > 2  # the run really backed off and grew
    for a, b in zip(our_params, ref_params, strict=True):
        assert torch.equal(a, b)
    assert our_ret == ref_ret
    theirs = ref.state_dict()
    mine = ours.state_dict()
    assert {k: mine[k] for k in theirs} == theirs
    assert mine["skipped_steps"] == len(INJECT)
    assert ours.state.last_overflow_step == max(INJECT)


def test_state_dict_interchange_with_torch():
    _, _, ref, _ = loop(torch.amp.GradScaler, lambda p: torch.optim.SGD(p, lr=0.05), steps=6)
    ours = mp.GradScaler("cpu")
    ours.load_state_dict(ref.state_dict())
    assert ours.get_scale() == ref.get_scale()
    assert ours._get_growth_tracker() == ref._get_growth_tracker()
    back = torch.amp.GradScaler("cpu")
    back.load_state_dict(ours.state_dict())
    assert back.state_dict() == ref.state_dict()


def test_hysteresis_and_bounds_extras():
    scales, _, scaler, _ = loop(
        mp.GradScaler, lambda p: torch.optim.SGD(p, lr=0.05), hysteresis=2, max_scale=2.0**14
    )
    # Steps 3 and 4 overflow back to back: with hysteresis 2 only the second backs off.
    assert scales[3] == scales[2] and scales[4] == scales[3] / 2
    assert max(scales) <= 2.0**14
    assert scaler.state_dict()["hysteresis"] == 2


def test_disabled_is_a_no_op():
    s = mp.GradScaler("cpu", enabled=False)
    loss = torch.tensor(2.0, requires_grad=True)
    assert s.scale(loss) is loss
    assert s.get_scale() == 1.0 and s.state_dict() == {} and not s.is_enabled()
    model = nn.Linear(2, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model(torch.ones(1, 2)).sum().backward()
    before = model.weight.detach().clone()
    s.unscale_(opt)
    s.step(opt)
    s.update()
    assert not torch.equal(before, model.weight)


def test_cuda_device_without_cuda_warns_and_disables(monkeypatch):
    """Disabled, as torch's; torch's words alone named no fix, and a CPU float16 loop went on
    unscaled: the warning says what that costs and to pass the device."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        s = mp.GradScaler()
    assert [str(w.message) for w in said] == [
        "mixprec.GradScaler is enabled, but CUDA is not available.  Disabling. Losses are not "
        "scaled, so small float16 gradients may underflow to zero; to scale on the CPU, pass "
        'GradScaler("cpu") (device="cpu"), as with torch.amp.GradScaler'
    ]
    assert [w.filename for w in said] == [__file__]
    assert not s.is_enabled()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the fix it names: enabled, and said nothing
        assert mp.GradScaler("cpu").is_enabled() and mp.GradScaler(device="cpu").is_enabled()
        assert not mp.GradScaler(enabled=False).is_enabled()  # disabled on purpose: unsaid


def both(action):
    """Run ``action`` on torch's scaler and ours; return both exceptions."""
    errors = []
    for cls in (torch.amp.GradScaler, mp.GradScaler):
        model = nn.Linear(3, 1)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        scaler = cls("cpu")
        with pytest.raises(Exception) as err:
            action(scaler, model, opt)
        errors.append(err.value)
    return errors


def scaled_backward(scaler, model):
    scaler.scale(model(torch.ones(2, 3)).sum()).backward()


@pytest.mark.parametrize(
    "action",
    [
        lambda s, m, o: (scaled_backward(s, m), s.unscale_(o), s.unscale_(o)),
        lambda s, m, o: (scaled_backward(s, m), s.step(o), s.unscale_(o)),
        lambda s, m, o: (scaled_backward(s, m), s.step(o), s.step(o)),
        lambda s, m, o: (scaled_backward(s, m), s.step(o, closure=lambda: 0.0)),
        lambda s, m, o: s.step(o),
        lambda s, m, o: s.unscale_(o),
        lambda s, m, o: s.update(),
        lambda s, m, o: (scaled_backward(s, m), s.update()),
        lambda s, m, o: s.scale(3),
        lambda s, m, o: s.load_state_dict({}),
    ],
    ids=[
        "unscale-twice",
        "unscale-after-step",
        "step-twice",
        "closure",
        "step-before-scale",
        "unscale-before-scale",
        "update-before-scale",
        "update-without-step",
        "scale-non-tensor",
        "empty-state",
    ],
)
def test_misuse_raises_like_torch(action):
    theirs, ours = both(action)
    assert isinstance(ours, type(theirs))  # except clauses written for torch still match
    # Our messages start with torch's (some add the received value).
    assert str(ours).startswith(str(theirs).split("  This may")[0][:40])


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"growth_factor": 1.0}, "growth_factor=1.0 is invalid; it must be > 1.0"),
        ({"backoff_factor": 1.5}, "backoff_factor=1.5 is invalid"),
    ],
)
def test_bad_factors_raise_what_torch_raises_plus_valueerror(kwargs, message):
    with pytest.raises(AssertionError):
        torch.amp.GradScaler("cpu", **kwargs)
    with pytest.raises(AssertionError, match=message):
        mp.GradScaler("cpu", **kwargs)
    with pytest.raises(ValueError, match=message):
        mp.GradScaler("cpu", **kwargs)


@pytest.mark.parametrize(
    ("args", "kwargs", "message"),
    [
        (("gpu",), {}, r"GradScaler\(device='gpu'\) is invalid; valid: a device type"),
        ((5,), {}, r"GradScaler\(device=5\) is invalid"),
        (("cpu",), {"enabled": "no"}, r"GradScaler\(enabled='no'\) is invalid"),
    ],
)
def test_a_device_torch_does_not_know_or_an_enabled_that_is_no_bool_is_refused(
    args, kwargs, message
):
    """Taken before: "gpu" and 5 failed at the first scale(), and enabled="no" scaled."""
    with pytest.raises(mp.ArgumentError, match=message):
        mp.GradScaler(*args, **kwargs)


def test_what_torchs_grad_scaler_takes_is_taken():
    import numpy

    for device, enabled in ((torch.device("cpu"), True), ("cpu", 1), ("cpu", numpy.bool_(True))):
        theirs, ours = (
            torch.amp.GradScaler(device, enabled=enabled),
            mp.GradScaler(device, enabled=enabled),
        )
        assert ours.is_enabled() == bool(theirs.is_enabled()) is True
    assert not mp.GradScaler("cpu", enabled=0).is_enabled()


def test_fp16_gradients_are_refused_like_torch():
    model = nn.Linear(3, 1).half()
    for cls in (torch.amp.GradScaler, mp.GradScaler):
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        s = cls("cpu")
        s.scale(model(torch.ones(2, 3, dtype=torch.float16)).sum()).backward()
        with pytest.raises(ValueError, match="Attempting to unscale FP16 gradients."):
            s.unscale_(opt)


def test_pickle_between_iterations():
    _, _, s, _ = loop(mp.GradScaler, lambda p: torch.optim.SGD(p, lr=0.05), steps=5)
    clone = pickle.loads(pickle.dumps(s))
    assert clone.state == s.state
    assert copy.deepcopy(s).get_scale() == s.get_scale()


def test_odd_init_scale_and_no_gradients_like_torch():
    for cls in (torch.amp.GradScaler, mp.GradScaler):
        scaler = cls("cpu", init_scale=0.1)
        scaler.scale(torch.tensor(1.0))  # torch holds the scale as a float32 tensor from here
        assert scaler.get_scale() == torch.tensor(0.1).item()
    theirs, ours = both(lambda s, m, o: (s.scale(torch.tensor(1.0)), s.step(o)))
    assert isinstance(ours, type(theirs))
    assert str(ours) == str(theirs) == "No inf checks were recorded for this optimizer."


def test_new_scale_by_hand():
    _, _, s, _ = loop(mp.GradScaler, lambda p: torch.optim.SGD(p, lr=0.05), steps=2)
    s.update(new_scale=1024.0)
    assert s.get_scale() == 1024.0
    s.update(new_scale=torch.tensor(512.0))
    assert s.get_scale() == 512.0
    # Named as update() takes it (the scaler's set_scale said "scale=-1.0").
    for bad in (-1.0, float("nan"), "x"):
        with pytest.raises(ValueError, match=rf"update\(new_scale={bad!r}\) is invalid"):
            s.update(new_scale=bad)
    assert s.get_scale() == 512.0


class _PassItself(torch.optim.SGD):
    """An optimizer on torch's older contract: step() takes grad_scaler= and unscales and
    skips by itself (written as PyTorch's own GradScaler tests write one)."""

    def __init__(self, params) -> None:
        super().__init__(params, lr=0.5)
        self._step_supports_amp_scaling = True
        self.seen: list[tuple[float, bool]] = []

    def step(self, closure=None, *, grad_scaler=None):  # type: ignore[override]
        assert not hasattr(self, "grad_scale") and not hasattr(self, "found_inf")
        scale = grad_scaler.get_scale()
        grads = [p.grad for g in self.param_groups for p in g["params"] if p.grad is not None]
        finite = all(bool(torch.isfinite(g).all()) for g in grads)
        self.seen.append((scale, finite))
        if finite:
            for g in grads:
                g.div_(scale)
            super().step()


def test_an_optimizer_taking_grad_scaler_gets_it_as_from_torch():
    """Issue 15 item 10: mixprec refused such an optimizer; torch passes itself, with a
    FutureWarning, and so does mixprec now. (torch's own scaler also needs the optimizer to
    call its private _check_inf_per_device; mixprec's checks the gradients itself.)"""
    param = nn.Parameter(torch.tensor([1.0, 2.0]))
    opt = _PassItself([param])
    scaler = mp.GradScaler("cpu", init_scale=4.0, growth_interval=2)
    for loss_scale in (1.0, float("inf"), 1.0, 1.0):
        opt.zero_grad()
        scaler.scale((param * loss_scale).sum()).backward()
        with pytest.warns(FutureWarning, match="stop passing itself") as said:
            scaler.step(opt)
        assert said[0].filename == __file__  # the caller's line, not mixprec's or torch's
        scaler.update()
    assert opt.seen == [(4.0, True), (4.0, False), (2.0, True), (2.0, True)]
    assert param.detach().tolist() == [-0.5, 0.5]  # three applied steps of lr 0.5
    assert scaler.get_scale() == 4.0  # backed off once, grown back after 2 clean steps


@pytest.mark.parametrize("level", ["O1", "O2"])
def test_a_loss_scale_optimizer_is_refused_naming_the_two_scalers(level):
    """A torch.amp loop kept around a LossScaleOptimizer: the error was torch's "No inf
    checks were recorded" (O2) or about a missing backward (O1), not about the scalers."""
    model = mp.auto_mixed_precision(nn.Sequential(nn.Linear(8, 4)), "mixed_float16", level)
    opt = mp.LossScaleOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    scaler = mp.GradScaler("cpu")
    scaler.scale(model(torch.randn(4, 8)).float().sum()).backward()
    said = r"GradScaler given a LossScaleOptimizer, which scales the loss itself: .*opt.step\(\)"
    with pytest.raises(mp.MisuseError, match=said):
        scaler.unscale_(opt)
    with pytest.raises(mp.MisuseError, match=said):
        scaler.step(opt)


@pytest.mark.parametrize("fused", [False, True])
def test_a_step_that_raised_leaves_no_stale_unscale_to_the_next(fused):
    """The optimizer's step raised (Ctrl-C, a hook), the loop went on without update():
    the unfused path stayed UNSCALED, and the next step skipped its unscale and applied
    its gradients still scaled (a weight from -0.004 to -327.7, unsaid). Now the next
    step() raises until update(), as the fused path did; after update() training goes on."""
    torch.manual_seed(0)
    model = nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.01, fused=fused or None)
    scaler = mp.GradScaler("cpu", init_scale=1024.0)  # 65536 overflows this float16 grad
    fail = [True]

    def interrupt(*_):
        if fail[0]:
            fail[0] = False
            raise KeyboardInterrupt

    opt.register_step_pre_hook(interrupt)

    def backward():
        opt.zero_grad()
        with torch.autocast("cpu", dtype=torch.float16):
            loss = model(torch.ones(8, 4)).float().mean()
        scaler.scale(loss).backward()

    before = model.weight.detach().clone()
    backward()
    with pytest.raises(KeyboardInterrupt):
        scaler.step(opt)
    backward()
    with pytest.raises(RuntimeError, match=r"a step\(\) that raised counts too"):
        scaler.step(opt)
    assert torch.equal(model.weight, before)
    scaler.update()
    backward()
    scaler.step(opt)
    scaler.update()
    # One plain SGD step of the unscaled gradient: lr * 1 (d mean(w.x + b)/dw = x = 1).
    torch.testing.assert_close(model.weight.detach(), before - 0.01)


def test_a_scale_driven_to_its_floor_is_said():
    """200 NaN batches (a corrupt shard) drove the scale to its 2**-126 floor, where the
    float16 gradients of the clean batches after were 0: ~200k steps applied as zero
    updates, unsaid (torch's scale reaches 0 and writes NaN into the weights, loudly).
    The health watch LossScaleOptimizer has now watches GradScaler's update too."""
    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = mp.GradScaler("cpu")
    x, y = torch.randn(8, 4), torch.randn(8, 2)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(150):  # 65536 * 2**-142 is below the floor
            opt.zero_grad()
            with torch.autocast("cpu", torch.float16):
                loss = nn.functional.mse_loss(model(x).float(), y) * float("nan")
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
    said = [str(w.message) for w in caught if w.filename == __file__]
    assert scaler.get_scale() == 2.0**-126
    assert any(m.startswith("loss scale fell to") for m in said), said
    assert any(m.startswith("training is stuck: the loss scale is at its floor") for m in said)
    quiet = mp.GradScaler("cpu")
    quiet.health = None  # turned off, as LossScaleOptimizer's
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for _ in range(20):
            opt.zero_grad()
            quiet.scale(nn.functional.mse_loss(model(x), y) * float("nan")).backward()
            quiet.step(opt)
            quiet.update()
