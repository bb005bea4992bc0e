"""``FusedStep``: the default CPU step calls torch's fused Adam/AdamW/SGD kernels with lists
built once. It must train bit for bit as ``inner.step()`` would, rebuild its lists when the
state or the groups change, and leave the step to torch whenever torch would do more
(hooks, a patched ``step``, the profiler, a parameter without a gradient)."""

from __future__ import annotations

import pytest
import torch
from torch.optim.optimizer import register_optimizer_step_post_hook
from torch.profiler import ProfilerActivity, profile

import mixprec as mp
from mixprec.optim.direct import FusedStep
from tests.conftest import make_mlp
from tests.optim._helpers import loss_of, same_state

_OPTIMIZERS = {
    "adamw": lambda ps: torch.optim.AdamW(ps, lr=1e-2),
    "adam-amsgrad-decay": lambda ps: torch.optim.Adam(ps, lr=1e-2, weight_decay=0.1, amsgrad=True),
    "adam-maximize": lambda ps: torch.optim.Adam(ps, lr=1e-3, maximize=True),
    "sgd-plain": lambda ps: torch.optim.SGD(ps, lr=0.05),  # unfused: one add a parameter
    "sgd-nesterov": lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9, nesterov=True),
    "sgd-dampening": lambda ps: torch.optim.SGD(
        ps, lr=0.05, momentum=0.9, dampening=0.2, weight_decay=1e-3
    ),
}


class _Counted:
    """Count what ``FusedStep.step`` answered: True when it made the kernel calls."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, allow: bool = True) -> None:
        self.answers: list[bool] = []
        real = FusedStep.step

        def step(this: FusedStep) -> bool:
            answer = real(this) if allow else False
            self.answers.append(answer)
            return answer

        monkeypatch.setattr(FusedStep, "step", step)


def _run(factory, steps, monkeypatch, direct, between=None, level="O2"):
    """Train an MLP ``steps`` steps with ``factory``'s optimizer in two param groups (the
    second at half the learning rate); ``between(i, model, opt)`` runs before step i."""
    with monkeypatch.context() as m:
        counted = _Counted(m, allow=direct)
        torch.manual_seed(0)
        model = mp.auto_mixed_precision(make_mlp(), "mixed_bfloat16", level)
        params = list(model.parameters())
        inner = factory(params[:2])
        inner.add_param_group({"params": params[2:], "lr": inner.defaults["lr"] / 2})
        opt = mp.LossScaleOptimizer(inner)
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
        for i in range(steps):
            if between is not None:
                between(i, model, opt)
            opt.zero_grad()
            opt.backward(loss_of(model))
            assert opt.step().applied
            sched.step()
    state = (
        [p.detach().clone() for p in model.parameters()],
        [p.detach().clone() for p in opt.master_params()],
        opt.state_dict(),
    )
    return state, counted.answers


@pytest.mark.parametrize("name", list(_OPTIMIZERS))
def test_the_direct_kernel_calls_train_bit_for_bit_as_the_inner_step(name, monkeypatch):
    factory = _OPTIMIZERS[name]
    direct, answers = _run(factory, 6, monkeypatch, direct=True)
    reference, _ = _run(factory, 6, monkeypatch, direct=False)
    # The first step is torch's own (it builds the state); the rest are direct calls.
    # SGD without momentum has no state: every step is direct.
    assert answers == [name == "sgd-plain"] + [True] * 5
    assert same_state(direct, reference)  # tolerance 0: the same kernels, the same order


def test_o1_float32_masters_and_o3_take_the_same_path(monkeypatch):
    factory = _OPTIMIZERS["adamw"]
    for level in ("O1", "O3"):
        direct, answers = _run(factory, 4, monkeypatch, direct=True, level=level)
        reference, _ = _run(factory, 4, monkeypatch, direct=False, level=level)
        assert same_state(direct, reference)
        # O3's 16-bit weights are not fused (see optim.fused), so torch steps them itself.
        assert answers == ([False] + [True] * 3 if level == "O1" else [False] * 4)


def test_a_state_dict_loaded_midway_is_the_state_that_trains(monkeypatch):
    """``load_state_dict`` replaces the optimizer's state tensors: lists cached before it
    would update the old ones and train on stale moments."""

    def reload(i, model, opt):
        if i == 3:
            saved = opt.state_dict()
            opt.optimizer.state[next(iter(opt.optimizer.state))]["exp_avg"].fill_(1.0)
            opt.load_state_dict(saved)

    direct, answers = _run(_OPTIMIZERS["adamw"], 6, monkeypatch, True, between=reload)
    reference, _ = _run(_OPTIMIZERS["adamw"], 6, monkeypatch, False, between=reload)
    assert same_state(direct, reference)
    assert answers == [False, True, True, True, True, True]


@pytest.mark.parametrize("fused", [True, None])
def test_a_param_group_added_midway_is_stepped(fused, monkeypatch):
    def add_group(i, model, opt):
        if i == 2:
            extra = torch.nn.Parameter(torch.ones(3))
            model.register_parameter("extra", extra)
            opt.add_param_group({"params": [extra], "lr": 0.1, "fused": fused})

    def loss_with_extra(model):
        return loss_of(model) + getattr(model, "extra", torch.zeros(3)).float().square().sum()

    results = []
    for direct in (True, False):
        with monkeypatch.context() as m:
            counted = _Counted(m, allow=direct)
            torch.manual_seed(0)
            model = mp.auto_mixed_precision(make_mlp(), "mixed_bfloat16", "O2")
            opt = mp.LossScaleOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-2))
            for i in range(5):
                add_group(i, model, opt)
                opt.zero_grad()
                opt.backward(loss_with_extra(model))
                opt.step()
            results.append(([p.detach().clone() for p in model.parameters()], counted.answers))
    (direct, answers), (reference, _) = results
    assert same_state(direct, reference)
    assert not torch.equal(direct[-1], torch.ones(3))  # the new group was stepped
    if fused:  # step 3 is torch's (the new parameter has no state), then the lists grow
        assert answers == [False, True, False, True, True]
    else:  # a group added once there is state stays unfused (optim.fused): torch's steps
        assert answers == [False, True, False, False, False]


def _default(model_factory=make_mlp):
    torch.manual_seed(0)
    model = mp.auto_mixed_precision(model_factory(), "mixed_bfloat16", "O2")
    return model, mp.LossScaleOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-2))


def _steps(model, opt, n):
    for _ in range(n):
        opt.zero_grad()
        opt.backward(loss_of(model))
        opt.step()


def test_hooks_a_patched_step_and_the_profiler_get_torchs_own_step(monkeypatch):
    counted = _Counted(monkeypatch)
    model, opt = _default()
    _steps(model, opt, 2)
    assert counted.answers == [False, True]

    calls = []
    handle = opt.register_step_pre_hook(lambda *a: calls.append("pre"))
    _steps(model, opt, 2)
    assert calls == ["pre", "pre"]  # the user's hook ran on every applied step
    handle.remove()

    global_handle = register_optimizer_step_post_hook(lambda *a: calls.append("global"))
    try:
        _steps(model, opt, 1)
    finally:
        global_handle.remove()
    assert calls[-1] == "global"

    # A scheduler given the inner optimizer patches its step to see it called.
    torch.optim.lr_scheduler.StepLR(opt.optimizer, step_size=1)
    _steps(model, opt, 1)
    assert getattr(opt.optimizer, "_opt_called", False)
    del opt.optimizer.step

    # Under the profiler the direct calls still run, labelled as torch's own step.
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        _steps(model, opt, 1)
    assert any("Optimizer.step#AdamW" in e.name for e in prof.events())
    _steps(model, opt, 1)
    assert counted.answers == [False, True, False, False, False, False, True, True]


def test_a_parameter_without_a_gradient_is_left_alone_as_torch_leaves_it(monkeypatch):
    counted = _Counted(monkeypatch)
    model, opt = _default()
    _steps(model, opt, 2)
    frozen = next(model.parameters())
    frozen.requires_grad_(False)
    before = frozen.detach().clone()
    _steps(model, opt, 1)
    assert torch.equal(frozen, before)
    assert counted.answers == [False, True, False]


@pytest.mark.parametrize(
    ("name", "key", "value"),
    [("sgd-dampening", "momentum", 0.0), ("adam-amsgrad-decay", "weight_decay", 0.5)],
)
def test_a_hyperparameter_changed_between_steps_is_taken_as_torch_takes_it(
    name, key, value, monkeypatch
):
    def change(i, model, opt):
        if i == 3:
            for group in opt.param_groups:
                group[key] = value

    direct, answers = _run(_OPTIMIZERS[name], 6, monkeypatch, direct=True, between=change)
    reference, _ = _run(_OPTIMIZERS[name], 6, monkeypatch, direct=False, between=change)
    assert same_state(direct, reference)
    # Momentum switched off: that step is torch's, the next ones use lists without buffers.
    rebuilt = [False, True, True, False, True, True]
    assert answers == (rebuilt if key == "momentum" else [False] + [True] * 5)


def _swap_first_two(i, model, opt):
    if i == 2:
        params = opt.param_groups[0]["params"]
        params[0], params[1] = params[1], params[0]  # the same list object, reordered


def _clear_state(i, model, opt):
    if i == 2:
        opt.optimizer.state.clear()  # the same state object, emptied: torch starts afresh


def _replace_moment(i, model, opt):
    if i == 2:
        state = opt.optimizer.state[opt.param_groups[0]["params"][0]]
        state["exp_avg"] = torch.ones_like(state["exp_avg"])


def _replace_group(i, model, opt):
    if i == 2:
        opt.optimizer.param_groups[1] = {**opt.optimizer.param_groups[1], "lr": 0.5}


@pytest.mark.parametrize("change", [_swap_first_two, _clear_state, _replace_moment, _replace_group])
def test_parameters_state_or_groups_replaced_in_place_are_seen(change, monkeypatch):
    """Cached lists must follow what torch's own step would read: a parameter reordered in
    its group's list (stepped with another's moments, the kernel wrote out of bounds), a
    state emptied or a moment replaced, a group dict replaced."""
    factory = _OPTIMIZERS["adamw"]
    direct, answers = _run(factory, 5, monkeypatch, direct=True, between=change)
    reference, _ = _run(factory, 5, monkeypatch, direct=False, between=change)
    assert same_state(direct, reference)
    assert answers[2] is False  # torch's step where the change was made
    assert answers[-1] is True  # and direct again once the lists are rebuilt
