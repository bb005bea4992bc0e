"""LossScaleOptimizer's step: skipping, clipping, accumulation, one host synchronisation,
the scale-1 host step and the general path, misuse and bad arguments."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import mixprec as mp
from mixprec.scaling import finite
from tests.conftest import classification_data, interrupt_copy_back, make_mlp
from tests.optim._helpers import (
    loss_of,
    prepared,
    same_state,
    snapshot,
    step_ops_against_plain,
)

BF16, F32 = torch.bfloat16, torch.float32


@pytest.mark.parametrize("policy", ["mixed_float16", "mixed_bfloat16"])
def test_skipped_step_leaves_weights_and_state_bit_identical(policy):
    model, opt = prepared(policy, max_grad_norm=1.0)
    opt.zero_grad()
    opt.backward(loss_of(model))
    opt.step()
    weights, state = snapshot(model, opt)
    scale = opt.loss_scaler.get_scale()
    opt.zero_grad()
    opt.backward(loss_of(model, scale=float("inf")))
    result = opt.step()
    assert not result.applied and result.found_inf and result.skipped
    for a, b in zip(weights, model.parameters(), strict=True):
        assert torch.equal(a, b)
    after = opt.state_dict()
    for key, entry in state["optimizers"][0]["state"].items():
        for name, value in entry.items():
            assert torch.equal(value, after["optimizers"][0]["state"][key][name])
    for a, b in zip(state["master_weights"], after["master_weights"], strict=True):
        assert torch.equal(a, b)
    if policy == "mixed_float16":
        assert opt.loss_scaler.get_scale() == scale / 2
    assert opt.loss_scaler.state.skipped_steps == 1


def test_clipping_uses_unscaled_gradients():
    model, opt = prepared("mixed_float16", max_grad_norm=1e-3)
    reference = copy.deepcopy(make_mlp())
    ref_loss = loss_of(reference)
    ref_loss.backward()
    ref_norm = torch.nn.utils.get_total_norm([p.grad for p in reference.parameters()]).item()
    opt.zero_grad()
    opt.backward(loss_of(model))
    result = opt.step()
    # float16 compute: a few parts in a thousand of the float32 norm.
    assert result.grad_norm == pytest.approx(ref_norm, rel=1e-2)
    clipped = torch.nn.utils.get_total_norm([m.grad for m in opt.master_params()]).item()
    assert clipped == pytest.approx(1e-3, rel=1e-3)


def test_accumulation_matches_one_big_batch():
    x, y = classification_data(n=64)
    big = make_mlp()
    opt_big = mp.LossScaleOptimizer(torch.optim.SGD(big.parameters(), lr=0.1))
    opt_big.backward(nn.functional.cross_entropy(big(x), y))
    opt_big.step()

    small = make_mlp()
    opt = mp.LossScaleOptimizer(torch.optim.SGD(small.parameters(), lr=0.1), accumulation_steps=4)
    results = []
    for i in range(4):
        opt.zero_grad()  # a no-op between micro-batches
        sl = slice(16 * i, 16 * (i + 1))
        opt.backward(nn.functional.cross_entropy(small(x[sl]), y[sl]))
        results.append(opt.step())
    assert [r.accumulating for r in results] == [True, True, True, False]
    assert results[-1].applied and opt.loss_scaler.state.steps == 1
    for a, b in zip(big.parameters(), small.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)  # float32 summation order


def test_several_param_groups_and_schedulers():
    model = mp.auto_mixed_precision(make_mlp(), "mixed_bfloat16", "O2")
    groups = [
        {"params": list(model[0].parameters()), "lr": 0.1},
        {"params": [p for n, p in model.named_parameters() if not n.startswith("0.")]},
    ]
    opt = mp.LossScaleOptimizer(torch.optim.SGD(groups, lr=0.01))
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    assert isinstance(opt, torch.optim.Optimizer)
    opt.zero_grad()
    opt.backward(loss_of(model))
    if opt.step().applied:
        sched.step()
    assert [g["lr"] for g in opt.param_groups] == [0.05, 0.005]
    extra = nn.Linear(2, 2).to(BF16)
    opt.add_param_group({"params": extra.parameters()})
    assert opt.param_groups[-1]["params"][0].dtype == F32


@pytest.mark.parametrize("on_host", [False, True], ids=["device-path", "cpu-path"])
def test_one_host_sync_per_step(monkeypatch, on_host):
    # SGD: Adam reads its (CPU-resident) step counter with .item(), which would be counted.
    # The device path (what CUDA runs) reads one tensor per step; on CPU, where a read costs
    # no synchronisation, the finiteness checks read their per-tensor sums at once.
    if not on_host:
        monkeypatch.setattr(finite, "checks_on_host", lambda tensors: False)
    model = mp.auto_mixed_precision(make_mlp(), "mixed_float16", "O2")
    opt = mp.LossScaleOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), max_grad_norm=1.0
    )
    calls = []
    for name in ("item", "tolist", "__bool__", "cpu", "numpy"):
        original = getattr(torch.Tensor, name)

        def counting(self, *a, _original=original, _name=name, **k):
            calls.append(_name)
            return _original(self, *a, **k)

        monkeypatch.setattr(torch.Tensor, name, counting)
    loss = loss_of(model)
    opt.zero_grad()
    opt.backward(loss)
    calls.clear()
    opt.step()
    if not on_host:
        assert calls == ["tolist"]
    else:  # the float16 weights' check: one .item() per weight, then the flags' tolist
        weights = [p for p in model.parameters() if p.dtype == torch.float16]
        assert calls == ["tolist"] + ["item"] * len(weights)


def test_misuse():
    model, opt = prepared("mixed_float16")
    opt.zero_grad()
    opt.backward(loss_of(model))
    opt.step()
    with pytest.raises(RuntimeError, match=r"step\(\) called without a new backward"):
        opt.step()
    opt.backward(loss_of(model))
    opt.unscale_()
    with pytest.raises(RuntimeError, match=r"unscale_\(\) has already been called"):
        opt.unscale_()
    opt.step()
    with pytest.raises(RuntimeError, match=r"unscale_\(\) called without a backward"):
        opt.unscale_()
    with pytest.raises(RuntimeError, match="does not take a closure"):
        opt.step(closure=lambda: 0.0)


def test_lbfgs_is_refused_when_wrapped():
    """LBFGS steps through a closure: wrapped, it failed at its first step in torch's raw
    TypeError, with nothing said up front."""
    model = make_mlp()
    with pytest.raises(mp.ArgumentError, match=r"^optimizer=LBFGS is not supported: its step"):
        mp.LossScaleOptimizer(torch.optim.LBFGS(model.parameters()))


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"max_grad_norm": 0}, ValueError, r"max_grad_norm=0 is invalid"),
        ({"max_grad_norm": float("inf")}, ValueError, r"max_grad_norm=inf is invalid"),
        ({"accumulation_steps": 0}, ValueError, r"accumulation_steps=0 is invalid; .*>= 1"),
        ({"accumulation_steps": 1.5}, TypeError, r"accumulation_steps must be an int, got 1.5"),
        ({"loss_scaler": "dynamic"}, TypeError, r"loss_scaler must be .* got str"),
    ],
)
def test_bad_arguments(kwargs, error, match):
    with pytest.raises(error, match=match):
        mp.LossScaleOptimizer(torch.optim.SGD(make_mlp().parameters(), lr=0.1), **kwargs)


def test_bad_optimizer_and_integer_parameters():
    with pytest.raises(TypeError, match="a non-empty list of them, got list"):
        mp.LossScaleOptimizer([])
    with pytest.raises(TypeError, match="optimizer must be a torch.optim.Optimizer, got str"):
        mp.LossScaleOptimizer(["sgd"])  # type: ignore[list-item]
    inner = torch.optim.SGD(make_mlp().parameters(), lr=0.1)
    wrapped = mp.LossScaleOptimizer(inner)
    with pytest.raises(TypeError, match="already a LossScaleOptimizer"):
        mp.LossScaleOptimizer(wrapped)  # type: ignore[arg-type]
    counts = torch.zeros(3, dtype=torch.int64)
    with pytest.raises(
        TypeError, match=r"param_groups\[0\]\['params'\]\[0\] has dtype torch.int64"
    ):
        mp.LossScaleOptimizer(torch.optim.SGD([counts], lr=0.1))
    # A complex parameter: the valid dtypes said (float64 too) and where it can be stepped.
    with pytest.raises(TypeError, match=r"\(float32, float64, float16, bfloat16\)\. Step a "
                       r"complex one with an optimizer of its own"):  # fmt: skip
        mp.LossScaleOptimizer(torch.optim.SGD([nn.Parameter(torch.zeros(2, dtype=torch.cfloat))]))


@pytest.mark.parametrize("level", ["auto", "O0"])
def test_float32_step_adds_only_the_finiteness_check(level):
    # Issue 14 item 5: where a model trains in float32 (``auto`` on a CPU without fast
    # 16-bit math, or O0), the step runs plain SGD's kernels plus one sum and one read per
    # gradient, and nothing else (no flag tensors, copies or collectives).
    torch.manual_seed(0)
    plain = make_mlp()
    model = mp.auto_mixed_precision(copy.deepcopy(plain), "float32", level)
    # Both fused: LossScaleOptimizer would pick fused for a float32 SGD left to torch.
    sgd = torch.optim.SGD(plain.parameters(), lr=0.1, momentum=0.9, fused=True)
    opt = mp.LossScaleOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, fused=True)
    )
    ours, theirs = step_ops_against_plain(opt, model, sgd, plain)
    grads = len(list(model.parameters()))
    extra = ours - theirs
    assert set(extra) <= {"aten::sum", "aten::item", "aten::_local_scalar_dense"}
    assert extra["aten::sum"] == grads and extra["aten::item"] == grads
    assert not theirs - ours
    for a, b in zip(model.parameters(), plain.parameters(), strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize("bad", ["dense-nan", "sparse-inf"])
def test_scale_one_host_step_skips_non_finite_gradients(bad, monkeypatch):
    # The scale-1 host path (float32, bfloat16 O1 on CPU): dense and sparse gradients are
    # checked, a skip leaves weights and state untouched and is counted.
    torch.manual_seed(0)
    emb = nn.Embedding(10, 4, sparse=True)
    lin = nn.Linear(4, 1)
    opt = mp.LossScaleOptimizer(
        [torch.optim.SparseAdam(emb.parameters(), lr=0.1), torch.optim.Adam(lin.parameters())]
    )
    monkeypatch.setattr(opt, "_finish", _not_called)
    ids = torch.tensor([[1, 2], [3, 4]])

    def backward() -> None:
        opt.zero_grad()
        opt.backward(lin(emb(ids).mean(1)).square().mean())

    backward()
    assert opt.step().applied
    before = [p.detach().clone() for p in (*emb.parameters(), *lin.parameters())]
    state = copy.deepcopy(opt.state_dict())
    backward()
    if bad == "dense-nan":
        lin.weight.grad[0, 0] = float("nan")
    else:
        emb.weight.grad._values()[0, 0] = float("inf")
    result = opt.step()
    assert (result.applied, result.found_inf, result.scale) == (False, True, 1.0)
    for a, b in zip(before, (*emb.parameters(), *lin.parameters()), strict=True):
        assert torch.equal(a, b)
    assert same_state(opt.state_dict()["optimizers"], state["optimizers"])
    assert opt.loss_scaler.state.skipped_steps == 1 and opt.loss_scaler.state.steps == 2
    backward()
    assert opt.step().applied and opt.loss_scaler.state.consecutive_skips == 0


def _not_called() -> None:
    raise AssertionError("the general step path ran")


class _Scaler(mp.NoOpLossScaler):
    """A subclass may do more in unscale_ than the check: it gets the general path."""


def _float16_o3():
    return mp.auto_mixed_precision(make_mlp(), "float16", "O3")


@pytest.mark.parametrize(
    "case", ["scale-2", "clipping-set-later", "scaler-subclass", "float16-weights"]
)
def test_the_general_step_path_where_the_host_step_does_not_apply(case, monkeypatch):
    model = _float16_o3() if case == "float16-weights" else make_mlp()
    scaler = {
        "scale-2": mp.StaticLossScaler(2.0),
        "scaler-subclass": _Scaler(),
        "float16-weights": mp.NoOpLossScaler(),  # scale 1: only the float16 weights decide
    }.get(case)
    opt = mp.LossScaleOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), scaler)
    if case == "clipping-set-later":
        opt.max_grad_norm = 1.0
    finished = []
    general = opt._finish
    monkeypatch.setattr(opt, "_finish", lambda: finished.append(1) or general())
    opt.backward(loss_of(model))
    result = opt.step()
    assert finished == [1] and result.applied
    if case == "clipping-set-later":
        assert result.grad_norm is not None


def test_a_step_result_is_true_only_when_applied():
    """``if opt.step(): scheduler.step()``: a dataclass is always true, so a skipped step
    advanced the scheduler too."""
    model = mp.auto_mixed_precision(make_mlp(), "mixed_float16", "O2")
    opt = mp.LossScaleOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    x, y = classification_data(n=16)
    opt.backward(nn.functional.cross_entropy(model(x), y) * float("inf"))
    skipped = opt.step()
    assert not skipped and skipped.skipped
    opt.zero_grad()
    opt.backward(nn.functional.cross_entropy(model(x), y))
    assert opt.step()


def test_a_custom_backward_written_in_terms_of_the_scale_matches_float32():
    """docs/loss-scaling.md: a backward that clamps its incoming gradient sees it scaled
    under float16 (99.9% off); clamped at ``c * opt.loss_scaler.get_scale()`` it matches."""
    scale_of = []

    class ClipGrad(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x.view_as(x)

        @staticmethod
        def backward(ctx, g):
            s = scale_of[0]() if scale_of else 1.0
            return g.clamp(-0.05 * s, 0.05 * s)

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b = nn.Linear(16, 16), nn.Linear(16, 4)

        def forward(self, x):
            return self.b(ClipGrad.apply(self.a(x)))

    torch.manual_seed(0)
    control, x = Net(), torch.randn(8, 16)
    model = mp.auto_mixed_precision(copy.deepcopy(control), "mixed_float16", "O1")
    (control(x) ** 2).sum().backward()
    scaler = mp.DynamicLossScaler(init_scale=1024.0)  # no overflow in the first backward
    opt = mp.LossScaleOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), scaler)
    scale_of.append(opt.loss_scaler.get_scale)
    opt.backward((model(x) ** 2).sum())
    opt.unscale_()
    torch.testing.assert_close(model.a.weight.grad, control.a.weight.grad, rtol=2e-2, atol=1e-3)


def test_a_plain_loss_backward_is_named_as_the_likely_cause(monkeypatch):
    """A torch habit, ``loss.backward()`` then ``opt.step()``: the refusal guessed "another
    LossScaleOptimizer's backward" even where there was no other wrapper."""
    from mixprec.optim import sharing

    monkeypatch.setattr(sharing, "_LIVE", sharing.WeakIdKeyDictionary())  # no other wrapper
    model = mp.auto_mixed_precision(make_mlp(), "mixed_bfloat16", "O2")
    opt = mp.LossScaleOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    loss_of(model).backward()
    with pytest.raises(mp.MisuseError) as caught:
        opt.step()
    said = str(caught.value)
    assert "a plain loss.backward()? Use opt.backward(loss) in its place" in said
    assert "wrap both in one" not in said
    # Two wrappers over one model's parts, the backward through one: both causes named.
    head = mp.LossScaleOptimizer(torch.optim.SGD(model[-1].parameters(), lr=0.1))
    opt.zero_grad()
    opt.backward(loss_of(model))
    opt.step()
    with pytest.raises(mp.MisuseError, match=r"a plain loss.backward\(\)\?.*wrap both"):
        head.step()


def test_a_batch_dropped_by_hand_after_unscale_counts_as_a_skipped_step():
    """The float32 habit: ``unscale_()``, a check (``clip_grad_norm_(...,
    error_if_nonfinite=True)``), and ``zero_grad(); continue`` when it fails. The dropped
    unscale never reached the scaler: the scale stayed at 65536 and all 30 batches were
    dropped, where the loop without the check applied 26 and backed off."""

    def run(by_hand):
        torch.manual_seed(0)
        net = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 4))
        model = mp.auto_mixed_precision(net, "mixed_float16", "O2")
        opt = mp.LossScaleOptimizer(torch.optim.SGD(model.parameters(), lr=0.01))
        applied = 0
        for _ in range(30):
            x, y = torch.randn(32, 16) * 3, torch.randint(0, 4, (32,))
            opt.zero_grad()
            opt.backward(nn.functional.cross_entropy(model(x), y, reduction="sum"))
            if by_hand:
                opt.unscale_()
                grads = [p.grad for p in opt.master_params()]
                if not all(torch.isfinite(g).all() for g in grads):
                    continue
            applied += bool(opt.step().applied)
        opt.zero_grad()
        weights = [p.detach().clone() for p in model.parameters()]
        return applied, opt.loss_scaler.get_scale(), weights

    plain, by_hand = run(False), run(True)
    assert plain[0] == by_hand[0] < 30 and plain[1] == by_hand[1] < 65536.0
    assert all(torch.equal(a, b) for a, b in zip(plain[2], by_hand[2], strict=True))


def test_a_retried_step_after_one_that_raised_names_the_raise():
    """A step whose inner optimizer raised (a hook, Ctrl-C), retried: refused as it must
    be (plain weights may be unscaled in place already), but the refusal blamed a plain
    ``loss.backward()`` or another wrapper."""
    model = mp.auto_mixed_precision(make_mlp(), "mixed_float16", "O2")
    inner = torch.optim.SGD(model.parameters(), lr=0.1)
    opt = mp.LossScaleOptimizer(inner)
    fail = [True]

    def interrupt(*_):
        if fail[0]:
            fail[0] = False
            raise RuntimeError("interrupted")

    inner.register_step_pre_hook(interrupt)
    opt.backward(loss_of(model))
    with pytest.raises(RuntimeError, match="interrupted"):
        opt.step()
    with pytest.raises(mp.MisuseError, match=r"The last step\(\) raised before it finished"):
        opt.step()
    opt.zero_grad()
    opt.backward(loss_of(model))
    assert opt.step().applied


@pytest.mark.parametrize(
    ("policy", "on_device"),
    [("mixed_float16", False), ("mixed_bfloat16", False), ("mixed_bfloat16", True)],
)  # _finish, host_step, the device path (a GPU, or ON_HOST here)
def test_a_step_interrupted_after_its_update_is_finished_as_applied(monkeypatch, policy, on_device):
    """Ctrl-C in the copy-back, after Adam stepped the masters. Before: the step counted
    as not applied (scaler not updated), the 16-bit weights stayed one update behind, the
    retry's message said to run the batch's backward again, which applied it twice (Adam
    at step 9 of 8, weights 0.026 off), and a save then took the stale weights for .data
    writes and put them into the masters. On the device path (the fused kernel decided on
    the device) the step was treated as dropped (a review's script)."""
    from mixprec.optim import deferred

    def run(interrupt: bool):
        monkeypatch.setattr(deferred, "ON_HOST", on_device)  # again: undone after each run
        model = mp.auto_mixed_precision(make_mlp(), policy, "O2")
        opt = mp.LossScaleOptimizer(torch.optim.Adam(model.parameters(), lr=1e-2))
        if interrupt:
            interrupt_copy_back(monkeypatch, opt, at=3)
        for i in range(6):
            opt.zero_grad()
            opt.backward(loss_of(model) * (1 + i))
            try:
                assert opt.step().applied
            except KeyboardInterrupt:
                assert interrupt and i == 2 and opt.applied_before_raising
                with pytest.raises(mp.MisuseError, match="that batch is done; go on with"):
                    opt.step()
        monkeypatch.undo()
        return [p.detach().clone() for p in model.parameters()], opt

    (plain, full), (stopped, opt) = run(False), run(True)
    assert all(torch.equal(a, b) for a, b in zip(plain, stopped, strict=True))
    assert opt.loss_scaler.state == full.loss_scaler.state
    assert not opt.applied_before_raising  # a backward since
    masters = [m.clone() for m in opt._weights.masters]
    opt.state_dict()  # the save's look for .data writes finds none
    assert all(torch.equal(a, b) for a, b in zip(masters, opt._weights.masters, strict=True))


def test_a_second_inner_optimizer_that_raises_before_its_update_is_said():
    """The first inner optimizer had applied its update: the step was finished as applied
    with no word that the second's parameters did not move."""
    model = mp.auto_mixed_precision(make_mlp(), "mixed_bfloat16", "O2")
    params = list(model.parameters())
    first, second = torch.optim.SGD(params[:2], lr=0.1), torch.optim.SGD(params[2:], lr=0.1)
    second.register_step_pre_hook(lambda *_: (_ for _ in ()).throw(RuntimeError("refused")))
    opt = mp.LossScaleOptimizer([first, second])
    before = [p.detach().clone() for p in params]
    opt.backward(loss_of(model))
    said = pytest.warns(UserWarning, match=r"step\(\) raised in optimizers\[1\] before its "
                        r"update, after optimizers\[0:1\] had applied theirs")  # fmt: skip
    with said, pytest.raises(RuntimeError, match="refused"):
        opt.step()
    assert opt.applied_before_raising
    assert not torch.equal(before[0], params[0]) and torch.equal(before[2], params[2])


def test_an_accumulation_group_whose_step_never_came_is_dropped_by_zero_grad(tmp_path):
    """User code raised between a group's last backward and its step(); the loop caught
    it and went on. Before: zero_grad() cleared the gradients but kept the count, so the
    next group was refused ("2 backward() calls since the last step()") and dropped too;
    a state saved then recorded micro_steps=2, and the resumed run applied its first
    micro-batch alone at half weight."""
    model = mp.auto_mixed_precision(make_mlp(), "mixed_bfloat16", "O2")
    opt = mp.LossScaleOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), accumulation_steps=2)
    for _ in range(2):
        opt.zero_grad()
        opt.backward(loss_of(model))
    assert opt.state_dict()["micro_steps"] == 0  # the group's gradients are not in it
    results = []
    for _ in range(2):  # the step raised (not called); the loop goes on
        opt.zero_grad()
        opt.backward(loss_of(model))
        results.append(opt.step())
    assert results[0].accumulating and results[1].applied


def test_gradients_set_by_hand_are_pointed_at_apply_gradients():
    model = mp.auto_mixed_precision(make_mlp(), "mixed_bfloat16", "O2")
    opt = mp.LossScaleOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    params = list(model.parameters())
    for p, g in zip(params, torch.autograd.grad(loss_of(model), params), strict=True):
        p.grad = g
    with pytest.raises(mp.MisuseError, match=r"opt.apply_gradients\(zip\(grads, params\)\)"):
        opt.step()
    opt.zero_grad()
    grads = torch.autograd.grad(loss_of(model), params)
    assert opt.apply_gradients(zip(grads, params, strict=True)).applied


def test_a_torch_optimizer_wrapped_twice_is_refused():
    """A notebook cell ``opt = mp.LossScaleOptimizer(inner)`` run again: the second
    wrapper took the first's float32 masters for plain parameters, and the 16-bit weights
    were never stepped again (every step applied=True, unsaid)."""
    model = mp.auto_mixed_precision(make_mlp(), "mixed_bfloat16", "O2")
    inner = torch.optim.AdamW(model.parameters(), lr=1e-2)
    mp.LossScaleOptimizer(inner)
    with pytest.raises(mp.ArgumentError, match=r"is the float32 master of a 16-bit weight .*"
                       r"wrapped in a LossScaleOptimizer already"):  # fmt: skip
        mp.LossScaleOptimizer(inner)


def test_a_batch_dropped_by_hand_backs_off_the_scale_every_rank_agrees_on(monkeypatch):
    """Under torch.distributed one rank's overflow, dropped by hand, backed off that rank's
    scale alone (65536 against 32768): the drop now agrees as a step does."""
    from mixprec.optim import checks

    model = mp.auto_mixed_precision(make_mlp(), "mixed_float16", "O2")
    opt = mp.LossScaleOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    opt.backward(loss_of(model))
    opt.unscale_()  # finite here
    monkeypatch.setattr(checks, "is_distributed", lambda: True)
    monkeypatch.setattr(checks, "agree_found_inf", lambda flags: torch.ones_like(flags))
    opt.zero_grad()  # another rank found inf
    assert opt.loss_scaler.get_scale() == 32768.0
