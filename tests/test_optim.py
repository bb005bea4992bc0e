"""LossScaleOptimizer: master weights, skipping, clipping, accumulation, the Keras methods,
sparse gradients, state, misuse."""

from __future__ import annotations

import copy
import warnings
from collections import Counter

import pytest
import torch
from torch import nn
from torch.profiler import ProfilerActivity, profile

import mixprec as mp
from tests.conftest import classification_data, make_mlp, make_transformer

BF16, F16, F32 = torch.bfloat16, torch.float16, torch.float32


def prepared(policy="mixed_bfloat16", level="O2", **opt_kwargs):
    model = mp.auto_mixed_precision(make_mlp(), policy, level)
    opt = mp.LossScaleOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-2), **opt_kwargs)
    return model, opt


def loss_of(model, scale=1.0):
    x, y = classification_data(n=32)
    return nn.functional.cross_entropy(model(x), y) * scale


def snapshot(model, opt):
    return (
        copy.deepcopy([p.detach() for p in model.parameters()]),
        copy.deepcopy(opt.state_dict()),
    )


def test_zero_grad_frees_master_gradients_unless_zeroing():
    # Kept, float32 master gradients would sit beside the next forward's activations.
    model, opt = prepared()
    opt.backward(loss_of(model))
    opt.step()
    masters = list(opt.master_params())
    assert all(m.grad is not None for m in masters)
    opt.zero_grad()
    assert all(m.grad is None for m in masters)
    assert all(p.grad is None for p in model.parameters())
    opt.backward(loss_of(model))
    opt.step()
    opt.zero_grad(set_to_none=False)
    assert all(m.grad is not None for m in masters)
    assert all(p.grad is not None and not p.grad.any() for p in model.parameters())


def test_masters_are_float32_and_seeded_from_unrounded_weights():
    reference = make_mlp()
    model, opt = prepared()
    masters = list(opt.master_params())
    assert {m.dtype for m in masters} == {F32}
    for m, p in zip(masters, reference.parameters(), strict=True):
        assert torch.equal(m, p)  # not the bfloat16-rounded values
    opt.zero_grad()
    opt.backward(loss_of(model))
    assert opt.step().applied
    for state in opt.state.values():
        assert state["exp_avg"].dtype == F32
    # After the step the 16-bit weights are the rounded masters.
    for m, p in zip(masters, model.parameters(), strict=True):
        assert torch.equal(p, m.to(p.dtype))


def test_default_scaler_follows_the_policy():
    assert isinstance(prepared("mixed_float16")[1].loss_scaler, mp.DynamicLossScaler)
    assert isinstance(prepared("mixed_bfloat16")[1].loss_scaler, mp.NoOpLossScaler)
    assert isinstance(prepared("mixed_float16", "O0")[1].loss_scaler, mp.NoOpLossScaler)
    plain = mp.LossScaleOptimizer(torch.optim.SGD(make_mlp().parameters(), lr=0.1))
    assert isinstance(plain.loss_scaler, mp.NoOpLossScaler)
    with mp.policy_scope("mixed_float16"):
        scaled = mp.LossScaleOptimizer(torch.optim.SGD(make_mlp().parameters(), lr=0.1))
    assert isinstance(scaled.loss_scaler, mp.DynamicLossScaler)


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


def test_o3_has_no_masters():
    model = mp.auto_mixed_precision(make_mlp(), "bfloat16", "O3")
    opt = mp.LossScaleOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    assert all(p.dtype == BF16 for p in opt.master_params())
    assert all(a is b for a, b in zip(opt.master_params(), model.parameters(), strict=True))


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


def test_keras_style_methods():
    model, opt = prepared("mixed_float16")
    params = list(model.parameters())
    scaled = opt.get_scaled_loss(loss_of(model))
    grads = torch.autograd.grad(scaled, params)
    unscaled = opt.get_unscaled_gradients(grads)
    scale = opt.loss_scaler.get_scale()
    assert torch.equal(unscaled[0], grads[0].float() * (1.0 / scale))  # float32: no flush
    before = [p.detach().clone() for p in params]
    result = opt.apply_gradients(zip(unscaled, params, strict=True))
    assert result.applied
    assert not any(torch.equal(a, b) for a, b in zip(before, params, strict=True))
    bad = [torch.full_like(g, float("nan")) for g in unscaled]
    assert not opt.apply_gradients(zip(bad, params, strict=True)).applied
    with pytest.raises(ValueError, match=r"variable 0 \(shape \(3,\), torch.float32\) is not a"):
        opt.apply_gradients([(torch.ones(3), torch.zeros(3))])
    with pytest.raises(ValueError, match=r"gradient 0 has shape \(2,\), its variable \(64, 32\)"):
        opt.apply_gradients([(torch.ones(2), params[0])])


def test_sparse_embeddings_with_sparse_adam_and_split():
    class Rec(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.table = nn.Embedding(100, 8, sparse=True)
            self.mlp = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))

        def forward(self, ids):
            return self.mlp(self.table(ids).mean(1)).squeeze(-1)

    torch.manual_seed(0)
    model = mp.auto_mixed_precision(Rec(), "mixed_float16", "O2")
    emb, dense = mp.split_embedding_parameters(model)
    assert emb == [model.table.weight] and len(dense) == 4
    opt = mp.LossScaleOptimizer(
        [torch.optim.SparseAdam(emb, lr=1e-2), torch.optim.Adam(dense, lr=1e-2)],
        max_grad_norm=1.0,
    )
    ids = torch.randint(0, 100, (32, 5))
    target = torch.randn(32)
    losses, results = [], []
    for _ in range(40):
        opt.zero_grad()
        loss = nn.functional.mse_loss(model(ids), target)
        losses.append(loss.item())
        opt.backward(loss)  # one loss scale for both optimizers
        assert model.table.weight.grad.is_sparse
        results.append(opt.step())
    assert sum(r.applied for r in results) >= 35  # the first steps may overflow float16
    assert opt.loss_scaler.state.skipped_steps == sum(not r.applied for r in results)
    assert model.table.weight.dtype == F32  # sparse tables stay float32 under float16
    assert next(iter(opt.master_params())).dtype == F32
    state = opt.state_dict()
    assert len(state["optimizers"]) == 2
    assert losses[-1] < 0.5 * losses[0]


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


def test_state_dict_round_trip():
    model, opt = prepared("mixed_float16")
    for _ in range(3):
        opt.zero_grad()
        opt.backward(loss_of(model))
        opt.step()
    state = copy.deepcopy(opt.state_dict())
    model2, opt2 = prepared("mixed_float16")
    # As with any optimizer: the model's own state (float32 norms here) comes from the model.
    model2.load_state_dict(model.state_dict())
    opt2.load_state_dict(state)
    for a, b in zip(model.parameters(), model2.parameters(), strict=True):
        assert torch.equal(a, b)
    assert opt2.loss_scaler.state == opt.loss_scaler.state
    for step_opt, step_model in ((opt, model), (opt2, model2)):
        step_opt.zero_grad()
        step_opt.backward(loss_of(step_model))
        step_opt.step()
    for a, b in zip(model.parameters(), model2.parameters(), strict=True):
        assert torch.equal(a, b)
    doubled = {**state, "optimizers": state["optimizers"] * 2}
    with pytest.raises(ValueError, match="state has 2 inner optimizers, this LossScale.* 1"):
        opt2.load_state_dict(doubled)
    with pytest.raises(ValueError, match="state has 3 master weights, this LossScale.* 6"):
        opt2.load_state_dict({**state, "master_weights": state["master_weights"][:3]})
    with pytest.raises(ValueError, match="missing master_weights"):
        opt2.load_state_dict({"optimizers": [], "loss_scaler": {}})


@pytest.mark.parametrize("on_host", [False, True], ids=["device-path", "cpu-path"])
def test_one_host_sync_per_step(monkeypatch, on_host):
    # SGD: Adam reads its (CPU-resident) step counter with .item(), which would be counted.
    # The device path (what CUDA runs) reads one tensor per step; on CPU, where a read costs
    # no synchronisation, the finiteness checks read their per-tensor sums at once.
    if not on_host:
        monkeypatch.setattr(mp.scaling, "checks_on_host", lambda tensors: False)
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


def test_split_embedding_parameters_with_tied_weights():
    model = make_transformer()
    emb, other = mp.split_embedding_parameters(model)
    assert emb == [model.embed.weight]
    assert len(emb) + len(other) == len(list(model.parameters()))
    with pytest.raises(TypeError, match="needs an nn.Module, got int"):
        mp.split_embedding_parameters(3)  # type: ignore[arg-type]


def test_warns_when_adam_eps_vanishes_in_pure_float16():
    model = mp.auto_mixed_precision(make_mlp(), "float16", "O3")
    with pytest.warns(UserWarning, match=r"eps=1e-08 .* rounds to 0 in float16"):
        mp.LossScaleOptimizer(torch.optim.AdamW(model.parameters()))

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        mp.LossScaleOptimizer(torch.optim.AdamW(model.parameters(), eps=1e-4))
        o2 = mp.auto_mixed_precision(make_mlp(), "mixed_float16", "O2")
        mp.LossScaleOptimizer(torch.optim.AdamW(o2.parameters()))  # masters: float32 math


@pytest.mark.parametrize("load_after_optimizer", [False, True])
def test_weights_loaded_into_a_16_bit_model_are_kept(load_after_optimizer):
    checkpoint = make_mlp(seed=42).state_dict()
    model = mp.auto_mixed_precision(make_mlp(seed=0), "mixed_bfloat16", "O2")
    if not load_after_optimizer:
        model.load_state_dict(checkpoint)
    opt = mp.LossScaleOptimizer(torch.optim.SGD(model.parameters(), lr=0.0))
    if load_after_optimizer:
        model.load_state_dict(checkpoint)
    opt.zero_grad()
    opt.backward(loss_of(model))
    assert opt.step().applied
    # lr=0: the step must leave the loaded weights as they were (bfloat16-rounded).
    for name, p in model.named_parameters():
        assert torch.equal(p, checkpoint[name].to(p.dtype)), name


def test_o3_keeps_no_hidden_float32_copies():
    model = mp.auto_mixed_precision(make_mlp(), "bfloat16", "O3")
    assert not any(hasattr(p, "_mixprec_fp32") for p in model.parameters())


def test_accumulation_misuse_and_keras_path_averages():
    model, opt = prepared("mixed_float16")
    opt = mp.LossScaleOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), accumulation_steps=2)
    opt.backward(loss_of(model))
    with pytest.raises(RuntimeError, match=r"unscale_\(\) called after 1 of 2 accumulation"):
        opt.unscale_()
    loss = loss_of(model)
    scaled = opt.get_scaled_loss(loss)
    assert scaled.item() == pytest.approx(loss.item() * opt.loss_scaler.get_scale() / 2)


def test_to_float_float16_alone_gets_loss_scaling():
    model = make_mlp()
    mp.to_float(model[5], "float16")
    opt = mp.LossScaleOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    assert isinstance(opt.loss_scaler, mp.DynamicLossScaler)


def test_keras_unscaled_gradients_of_16_bit_weights_are_float32():
    """Unscaling float16 gradients in float16 would flush small values to zero."""
    model = mp.auto_mixed_precision(make_mlp(), "mixed_float16", "O2")
    opt = mp.LossScaleOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    params = list(model.parameters())
    grads = torch.autograd.grad(opt.get_scaled_loss(loss_of(model) * 1e-6), params)
    unscaled = opt.get_unscaled_gradients(grads)
    assert unscaled[0].dtype == torch.float32
    assert unscaled[0].abs().max() > 0
    assert opt.apply_gradients(zip(unscaled, params, strict=True)).applied


def _trained(opt_factory, steps=15):
    """An O2 MLP trained ``steps`` AdamW/SGD steps; its weights and the wrapper."""
    model = mp.auto_mixed_precision(make_mlp(), "mixed_bfloat16", "O2")
    opt = mp.LossScaleOptimizer(opt_factory(model.parameters()))
    for _ in range(steps):
        opt.zero_grad()
        opt.backward(loss_of(model))
        opt.step()
    return [m.detach().clone() for m in opt.master_params()], opt


@pytest.mark.parametrize(
    "factory",
    [
        lambda ps: torch.optim.AdamW(ps, lr=1e-2),
        lambda ps: torch.optim.Adam(ps, lr=1e-2, amsgrad=True),
        lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, nesterov=True),
    ],
    ids=["AdamW", "Adam-amsgrad", "SGD-nesterov"],
)
def test_optimizers_left_to_torch_run_fused_and_train_like_the_loop(factory):
    fused, opt = _trained(factory)
    assert all(g["fused"] is True for g in opt.param_groups)

    def loop(ps):
        inner = factory(ps)
        for g in inner.param_groups:
            g["foreach"] = False  # the per-parameter loop torch picks on CPU
        return inner

    looped, ref = _trained(loop)
    assert all(not g["fused"] for g in ref.param_groups)
    # Same arithmetic in another order: float32 rounding over 15 steps.
    for a, b in zip(fused, looped, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("choice", [{"foreach": False}, {"foreach": True}, {"fused": False}])
def test_an_explicit_kernel_choice_is_kept(choice):
    model = mp.auto_mixed_precision(make_mlp(), "mixed_bfloat16", "O2")
    opt = mp.LossScaleOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-2, **choice))
    assert not opt.param_groups[0]["fused"]


def test_not_fused_once_the_optimizer_has_state_or_for_other_optimizers():
    model = make_mlp()
    inner = torch.optim.AdamW(model.parameters(), lr=1e-2)
    loss_of(model).backward()
    inner.step()  # state in the loop's format
    assert mp.LossScaleOptimizer(inner).param_groups[0]["fused"] is None
    # Plain SGD is one add per parameter: torch's loop is as fast as the fused kernel.
    sgd = mp.LossScaleOptimizer(torch.optim.SGD(make_mlp().parameters(), lr=1e-3))
    assert sgd.param_groups[0]["fused"] is None
    rms = torch.optim.RMSprop(make_mlp().parameters(), lr=1e-3)
    mp.LossScaleOptimizer(rms)
    assert rms.param_groups[0]["foreach"] is None and "fused" not in rms.param_groups[0]


def test_16_bit_parameters_keep_the_loop():
    # torch 2.13's fused CPU SGD skips most of a 16-bit update (pytorch/pytorch#191763).
    model = mp.auto_mixed_precision(make_mlp(), "bfloat16", "O3")
    opt = mp.LossScaleOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9))
    assert opt.param_groups[0]["fused"] is None
    before = [p.detach().clone() for p in model.parameters()]
    opt.backward(loss_of(model))
    opt.step()
    for p, b in zip(model.parameters(), before, strict=True):
        if p.dim() == 2:  # weight matrices: most elements move (norm scales at 1.0 need not)
            assert (p.detach() != b).float().mean() > 0.5


def test_a_fused_group_falls_back_for_sparse_gradients():
    # torch's fused SGD refuses sparse gradients; the wrapper steps that group unfused.
    torch.manual_seed(0)
    emb = nn.Embedding(20, 4, sparse=True)
    opt = mp.LossScaleOptimizer(torch.optim.SGD(emb.parameters(), lr=0.5, momentum=0.5))
    assert opt.param_groups[0]["fused"] is True
    before = emb.weight.detach().clone()
    opt.backward(emb(torch.tensor([1, 3, 3])).sum())
    assert opt.step().applied
    assert opt.param_groups[0]["fused"] is False
    changed = (emb.weight.detach() != before).any(dim=1)
    assert changed.tolist() == [i in (1, 3) for i in range(20)]


def test_fused_state_round_trips_and_sparse_fallback_survives_loading():
    _, opt = _trained(lambda ps: torch.optim.AdamW(ps, lr=1e-2), steps=2)
    _, fresh = _trained(lambda ps: torch.optim.AdamW(ps, lr=1e-2), steps=0)
    fresh.load_state_dict(copy.deepcopy(opt.state_dict()))
    assert all(g["fused"] is True for g in fresh.param_groups)
    # Loading replaces the group dicts: the sparse fallback must follow the new ones.
    emb = nn.Embedding(20, 4, sparse=True)
    first = mp.LossScaleOptimizer(torch.optim.SGD(emb.parameters(), lr=0.5, momentum=0.9))
    first.backward(emb(torch.tensor([2])).sum())
    first.step()
    saved = copy.deepcopy(first.state_dict())
    saved["optimizers"][0]["param_groups"][0]["fused"] = True  # as a dense step left it
    again = mp.LossScaleOptimizer(torch.optim.SGD(emb.parameters(), lr=0.5, momentum=0.9))
    again.load_state_dict(saved)
    again.backward(emb(torch.tensor([2])).sum())
    assert again.step().applied


# -- an update that overflows a 16-bit weight (issue 15 item 1) -----------------------------


def _push_past_float16(scaler: mp.LossScaler | None) -> tuple[mp.LossScaleOptimizer, list[bool]]:
    lin = nn.Linear(4, 1)
    lin.bias.data.fill_(65000.0)  # representable; one SGD step of +1000 takes it past 65504
    model = mp.auto_mixed_precision(nn.Sequential(lin), "mixed_float16", "O2")
    opt = mp.LossScaleOptimizer(torch.optim.SGD(model.parameters(), lr=1.0), loss_scaler=scaler)
    applied = []
    with pytest.raises(FloatingPointError) as err:
        for _ in range(30):
            opt.zero_grad()
            opt.backward(-model(torch.zeros(8, 4)).mean() * 1000)
            applied.append(opt.step().applied)
    message = str(err.value)
    assert (
        "float16 weights became inf or NaN in the last applied update: 0.bias (float16" in message
    )
    assert "float32 master's largest |value| is 66000" in message
    assert "keep_float32=" in message and "mixed_bfloat16" in message
    return opt, applied


def test_update_past_float16_range_stops_at_the_next_step() -> None:
    # Before: every step applied with an inf bias, for ever.
    opt, applied = _push_past_float16(mp.StaticLossScaler(1.0))
    assert applied == [True]  # the overflowing update, then the error before anything else
    assert opt.loss_scaler.get_scale() == 1.0


def test_update_past_float16_range_with_the_default_dynamic_scaler() -> None:
    _, applied = _push_past_float16(None)
    # The scale backs off from 2**16 until the scaled loss fits, one update applies, and the
    # next step names the weight (before: skipped or applied with an inf weight for ever).
    assert applied[-1] is True and applied.count(True) == 1


def test_o3_float16_weight_pushed_to_inf_is_named() -> None:
    lin = nn.Linear(2, 1)
    lin.bias.data.fill_(65000.0)
    model = mp.auto_mixed_precision(nn.Sequential(lin), "float16", "O3")
    opt = mp.LossScaleOptimizer(
        torch.optim.SGD(model.parameters(), lr=1.0), loss_scaler=mp.StaticLossScaler(1.0)
    )
    opt.zero_grad()
    opt.backward(-model(torch.zeros(4, 2)).float().mean() * 1000)
    assert opt.step().applied
    opt.zero_grad()
    opt.backward(model(torch.zeros(4, 2)).float().mean())
    with pytest.raises(FloatingPointError, match=r"update: 0.bias \(float16\)"):
        opt.step()


def test_finite_weights_train_on_unchanged() -> None:
    torch.manual_seed(0)
    model = mp.auto_mixed_precision(nn.Sequential(nn.Linear(4, 4)), "mixed_float16", "O2")
    opt = mp.LossScaleOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    for _ in range(5):
        opt.zero_grad()
        opt.backward(model(torch.randn(8, 4)).square().mean())
        assert opt.step().applied


@pytest.mark.parametrize(
    ("change", "match"),
    [
        (lambda good: 5, r"a LossScaleOptimizer state is a dict \(from state_dict\(\)\), got int"),
        (lambda good: {**good, "optimizers": 5}, r"'optimizers' must be a list of dict, got int"),
        (
            lambda good: {**good, "master_weights": [1, 2]},
            r"'master_weights' must be a list of Tensor, got list of \['int'\]",
        ),
    ],
)
def test_load_state_dict_of_the_wrong_types_is_a_type_error(change, match) -> None:
    model = mp.auto_mixed_precision(nn.Sequential(nn.Linear(2, 2)), "mixed_bfloat16", "O2")
    opt = mp.LossScaleOptimizer(torch.optim.SGD(model.parameters(), 0.1))
    good = opt.state_dict()
    before = [m.clone() for _, m in opt.master_weights()]
    with pytest.raises(TypeError, match=match):
        opt.load_state_dict(change(good))
    assert all(torch.equal(a, m) for a, (_, m) in zip(before, opt.master_weights(), strict=True))


def test_float16_weight_added_later_is_checked_too() -> None:
    first = nn.Linear(2, 1)
    later = nn.Linear(4, 1)
    later.bias.data.fill_(65000.0)
    model = mp.auto_mixed_precision(nn.ModuleList([first, later]), "mixed_float16", "O2")
    opt = mp.LossScaleOptimizer(
        torch.optim.SGD(first.parameters(), lr=1.0), loss_scaler=mp.StaticLossScaler(1.0)
    )
    opt.add_param_group({"params": list(later.parameters())})
    for _ in range(2):
        opt.zero_grad()
        x = torch.zeros(8, 4, dtype=torch.float16)  # a ModuleList has no forward: no region
        opt.backward(-model[1](x).float().mean() * 1000 + model[0].weight.float().sum())
        if _ == 0:
            assert opt.step().applied
    with pytest.raises(FloatingPointError, match=r"1\.bias \(float16"):
        opt.step()


def _aten_ops(step) -> Counter[str]:
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        step()
    # Outermost aten ops only: what a kernel calls inside itself is the kernel's business.
    return Counter(
        e.name
        for e in prof.events()
        if e.name.startswith("aten::")
        and (e.cpu_parent is None or not e.cpu_parent.name.startswith("aten::"))
    )


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
    for _ in range(2):  # the first steps create the momentum buffers
        sgd.zero_grad()
        loss_of(plain).backward()
        opt.zero_grad()
        opt.backward(loss_of(model))
        ours, theirs = _aten_ops(opt.step), _aten_ops(sgd.step)
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
    assert _same_state(opt.state_dict()["optimizers"], state["optimizers"])
    assert opt.loss_scaler.state.skipped_steps == 1 and opt.loss_scaler.state.steps == 2
    backward()
    assert opt.step().applied and opt.loss_scaler.state.consecutive_skips == 0


def _same_state(a, b) -> bool:
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_same_state(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_same_state(x, y) for x, y in zip(a, b, strict=True))
    if torch.is_tensor(a):
        return torch.equal(a, b)
    return a == b


def _not_called() -> None:
    raise AssertionError("the general step path ran")


class _Scaler(mp.NoOpLossScaler):
    """A subclass may do more in unscale_ than the check: it gets the general path."""


def _float16_o3():
    return mp.auto_mixed_precision(make_mlp(), "float16", "O3")


@pytest.mark.parametrize(
    "case", ["scale-2", "clipping-set-later", "scaler-subclass", "float16-weights", "masters"]
)
def test_the_general_step_path_where_the_host_step_does_not_apply(case, monkeypatch):
    model = _float16_o3() if case == "float16-weights" else make_mlp()
    if case == "masters":
        model = mp.auto_mixed_precision(model, "mixed_bfloat16", "O2")
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
