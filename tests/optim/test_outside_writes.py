"""What the optimizer's user does around the step, outside it: weights written before a
save, ``opt.state[weight]``, step hooks, a parameter given twice, a step that raised, a
checkpoint taken mid-accumulation. None of it may lose a master or a state silently."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import mixprec as mp
from mixprec.optim.compensated import CompensatedAdamW
from tests.optim._helpers import float16_bias_pushed_over


def _o2(policy: str = "mixed_bfloat16", seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return mp.auto_mixed_precision(nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2)), policy, "O2")


def _train(model: nn.Module, opt: mp.LossScaleOptimizer, steps: int = 1) -> None:
    x, y = torch.randn(8, 4), torch.randint(0, 2, (8,))
    for _ in range(steps):
        opt.zero_grad()
        opt.backward(F.cross_entropy(model(x), y))
        opt.step()


def test_a_weight_written_before_a_save_is_what_the_checkpoint_holds(tmp_path):
    """Pretrained weights loaded into the model after the optimizer was built, then saved
    at once: the checkpoint holds them, not the masters they are about to replace."""
    model = _o2()
    opt = mp.LossScaleOptimizer(torch.optim.AdamW(model.parameters()))
    _train(model, opt)
    pretrained = {k: torch.full_like(v, 0.5) for k, v in model.state_dict().items()}
    model.load_state_dict(pretrained)
    masters = opt.state_dict()["master_weights"]
    assert all(torch.equal(m, torch.full_like(m, 0.5)) for m in masters)
    assert all(torch.equal(m, torch.full_like(m, 0.5)) for _, m in opt.master_weights())
    mp.save_checkpoint(tmp_path / "c.safetensors", model, opt)
    fresh = _o2(seed=1)
    opt2 = mp.LossScaleOptimizer(torch.optim.AdamW(fresh.parameters()))
    mp.load_checkpoint(tmp_path / "c.safetensors", fresh, opt2)
    assert all(torch.equal(p, torch.full_like(p, 0.5)) for p in fresh.parameters())


def test_a_write_through_data_before_the_optimizer_is_its_master():
    """Hugging Face's init writes ``weight.data`` after preparation (no version bump): the
    kept float32 copy no longer rounds to the weight, so the master starts from the weight."""
    model = _o2()
    with torch.no_grad():
        model[0].weight.data.fill_(0.25)
    opt = mp.LossScaleOptimizer(torch.optim.SGD(model.parameters(), lr=0.0))
    master = dict((id(p), m) for p, m in opt.master_weights())[id(model[0].weight)]
    assert torch.equal(master, torch.full_like(master, 0.25))
    _train(model, opt)
    assert torch.equal(model[0].weight, torch.full_like(model[0].weight, 0.25))


def test_state_is_found_by_the_model_weight_and_never_inserted_under_it():
    model = _o2()
    opt = mp.LossScaleOptimizer(torch.optim.AdamW(model.parameters()))
    _train(model, opt)
    w = model[0].weight
    master = dict((id(p), m) for p, m in opt.master_weights())[id(w)]
    assert opt.state[w] is opt.optimizer.state[master]
    assert opt.state[w]["exp_avg"].dtype == torch.float32 and w in opt.state
    opt.state_dict()  # a lookup left nothing under the 16-bit weight (a KeyError here)
    assert len(opt.state) == 4
    with pytest.raises(KeyError, match=r"tensor of shape \(3,\)' is not a parameter"):
        opt.state[torch.zeros(3)]
    assert torch.zeros(3) not in opt.state


def test_state_of_several_inner_optimizers_is_written_where_they_read_it():
    model = _o2()
    first = torch.optim.SGD(model[0].parameters(), lr=0.1, momentum=0.9)
    second = torch.optim.SGD(model[1].parameters(), lr=0.1, momentum=0.9)
    opt = mp.LossScaleOptimizer([first, second])
    _train(model, opt)
    bias = model[1].bias
    opt.state[bias]["momentum_buffer"].zero_()
    master = dict((id(p), m) for p, m in opt.master_weights())[id(bias)]
    assert torch.count_nonzero(second.state[master]["momentum_buffer"]) == 0


def test_a_step_post_hook_sees_and_keeps_its_writes_to_the_updated_weights():
    """A Keras-style constraint (clamp after each update) written into the 16-bit weights
    stays: the hook runs after the copy-back, on applied steps only."""
    model = _o2()
    opt = mp.LossScaleOptimizer(torch.optim.SGD(model.parameters(), lr=1.0))
    seen: list[torch.Tensor] = []

    def constrain(optimizer, args, kwargs):
        assert optimizer is opt
        seen.append(model[0].weight.detach().clone())
        with torch.no_grad():
            model[0].weight.clamp_(-0.01, 0.01)

    handle = opt.register_step_post_hook(constrain)
    before = model[0].weight.detach().clone()
    _train(model, opt)
    assert not torch.equal(seen[0], before)  # the updated weights
    assert model[0].weight.abs().max() <= 0.0101
    _train(model, opt)  # the master followed the clamp: the next step starts from it
    assert len(seen) == 2 and seen[1].abs().max() <= 1.01 + 0.0101
    opt.zero_grad()
    opt.backward(model(torch.full((2, 4), float("nan"))).float().sum())
    assert not opt.step().applied and len(seen) == 2  # a skipped step runs no hook
    handle.remove()
    _train(model, opt)
    assert len(seen) == 2


def test_a_parameter_given_twice_is_refused():
    model = _o2()
    opt = mp.LossScaleOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    with pytest.raises(ValueError, match=r"param_group\['params'\]\[0\] \(shape \(4, 4\), "
                       r"torch.bfloat16\) is already a parameter"):  # fmt: skip
        opt.add_param_group({"params": [model[0].weight]})
    with pytest.raises(ValueError, match="is already a parameter"):
        mp.LossScaleOptimizer(
            [torch.optim.SGD([model[0].weight], lr=0.1), torch.optim.SGD([model[0].weight])]
        )


def test_a_step_that_raised_leaves_nothing_to_the_next():
    """A float16 weight pushed past 65504 raises; the user repairs the weight and goes on
    at lr 0: the next step applies its own (zero-lr) update, not the raising step's."""
    model, opt = float16_bias_pushed_over("mixed_float16", "O2")
    with pytest.raises(FloatingPointError):
        opt.step()
    with torch.no_grad():
        model[0].bias.fill_(1.0)
    for group in opt.param_groups:
        group["lr"] = 0.0
    opt.zero_grad()
    opt.backward(model(torch.zeros(4, 2)).float().mean())
    assert opt.step().applied
    assert model[0].bias.item() == 1.0


def test_mid_accumulation_state_warns_and_a_checkpoint_is_refused(tmp_path):
    model = _o2()
    opt = mp.LossScaleOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), accumulation_steps=4)
    opt.zero_grad()
    opt.backward(model(torch.randn(2, 4)).float().sum())
    assert opt.step().accumulating and opt.pending_micro_steps == 1
    with pytest.warns(UserWarning, match="taken 1 of 4 micro-batches into an accumulation"):
        opt.state_dict()
    with pytest.raises(ValueError, match="is 1 of 4 micro-batches into an accumulation group"):
        mp.save_checkpoint(tmp_path / "c.safetensors", model, opt)
    assert not (tmp_path / "c.safetensors").exists()
    for _ in range(3):
        opt.backward(model(torch.randn(2, 4)).float().sum())
        opt.step()
    assert opt.pending_micro_steps == 0
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        mp.save_checkpoint(tmp_path / "c.safetensors", model, opt)


def test_a_negative_micro_step_count_is_refused():
    model = _o2()
    opt = mp.LossScaleOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    state = opt.state_dict()
    state["micro_steps"] = -7
    with pytest.raises(ValueError, match=r"'micro_steps'=-7 is invalid; it must be an int >= 0"):
        opt.load_state_dict(state)


def test_apply_gradients_clips_its_own_copy_not_the_callers():
    model = _o2()
    opt = mp.LossScaleOptimizer(torch.optim.SGD(model.parameters(), lr=0.0), max_grad_norm=1.0)
    grads = [torch.full(p.shape, 10.0) for p in model.parameters()]
    result = opt.apply_gradients(zip(grads, model.parameters(), strict=True))
    assert result.grad_norm > 1.0
    assert all(torch.equal(g, torch.full_like(g, 10.0)) for g in grads)


def test_compensated_adamw_resumes_with_float32_moments():
    torch.manual_seed(0)
    w = nn.Parameter(torch.randn(8).bfloat16())
    opt = CompensatedAdamW([w], lr=1e-2)
    w.grad = torch.ones(8, dtype=torch.bfloat16)
    opt.step()
    state = copy.deepcopy(opt.state_dict())  # torch's load shares same-dtype tensors
    w2 = nn.Parameter(w.detach().clone())
    opt2 = CompensatedAdamW([w2], lr=1e-2)
    opt2.load_state_dict(state)
    for key in ("exp_avg", "exp_avg_sq"):  # as saved, not rounded to bfloat16 and back
        assert opt2.state[w2][key].dtype == torch.float32
        assert torch.equal(opt2.state[w2][key], opt.state[w][key])
    for p, o in ((w, opt), (w2, opt2)):
        p.grad = torch.ones(8, dtype=torch.bfloat16)
        o.step()
    assert torch.equal(w, w2)


def test_compensated_adamw_checks_every_groups_compensation():
    with pytest.raises(ValueError, match=r"compensation='kahn' is invalid \(param_groups\[0\]\)"):
        CompensatedAdamW([{"params": [nn.Parameter(torch.ones(2))], "compensation": "kahn"}])
    opt = CompensatedAdamW([nn.Parameter(torch.ones(2))])
    half = nn.Parameter(torch.ones(2, dtype=torch.float16))
    with pytest.raises(ValueError, match=r"rounds to bfloat16 \(param_groups\[1\]\)"):
        opt.add_param_group({"params": [half], "compensation": "stochastic"})
    assert len(opt.param_groups) == 1  # the refused group is not kept


def test_a_group_added_later_gets_the_eps_warning_too():
    model = mp.auto_mixed_precision(nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2)), "float16",
                                    "O3")  # fmt: skip
    with pytest.warns(UserWarning, match="eps=1e-08"):
        opt = mp.LossScaleOptimizer(torch.optim.AdamW(model[0].parameters()))
    with pytest.warns(UserWarning, match=r"param_groups\[1\].*eps=1e-08"):
        opt.add_param_group({"params": list(model[1].parameters())})


def test_a_state_one_inner_optimizer_refuses_loads_into_none():
    model = mp.auto_mixed_precision(nn.Sequential(nn.Embedding(10, 4), nn.Linear(4, 4)),
                                    "mixed_bfloat16", "O2")  # fmt: skip
    emb, dense = mp.split_embedding_parameters(model)

    def build(lr):
        return mp.LossScaleOptimizer([torch.optim.SGD(emb, lr=lr), torch.optim.SGD(dense, lr=lr)])

    state = build(0.5).state_dict()
    state["optimizers"][1]["param_groups"].append(
        dict(state["optimizers"][1]["param_groups"][0], params=[99])
    )
    target = build(0.1)
    with pytest.raises(ValueError, match=r"inner optimizer 1 \(SGD\) has param groups of sizes "
                       r"\[2\]; the state's are \[2, 1\]"):  # fmt: skip
        target.load_state_dict(state)
    assert [g["lr"] for g in target.param_groups] == [0.1, 0.1]


def test_clipping_the_16bit_gradients_after_unscale_is_said():
    """The torch.amp habit, unscale_() then clip_grad_norm_(model.parameters()), clips
    gradients step() does not apply (the masters' are): said at the user's line. Clipping
    master_params() is what works, and is not said."""
    model = _o2()
    opt = mp.LossScaleOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    x = torch.randn(2, 4)
    opt.zero_grad()
    opt.backward(model(x).float().sum())
    opt.unscale_()
    nn.utils.clip_grad_norm_(model.parameters(), 0.1)
    with pytest.warns(UserWarning, match=r"changed after unscale_\(\) .* clip opt.master_params"
                      ) as seen:  # fmt: skip
        opt.step()
    assert [w.filename for w in seen] == [__file__]
    opt.zero_grad()
    opt.backward(model(x).float().sum())
    opt.unscale_()
    nn.utils.clip_grad_norm_(list(opt.master_params()), 0.1)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        opt.step()


def test_a_new_optimizer_starts_from_the_live_masters_of_the_last_one():
    """A second fit (Lightning runs configure_optimizers again), a later phase: the new
    masters are the old ones while those live; once gone, their loss is said."""
    import gc

    model = _o2()
    first = mp.LossScaleOptimizer(torch.optim.SGD(model.parameters(), lr=0.01))
    _train(model, first, steps=3)
    before = {id(p): m.clone() for p, m in first.master_weights()}
    assert any(not torch.equal(m.to(torch.bfloat16).float(), m) for m in before.values())
    second = mp.LossScaleOptimizer(torch.optim.SGD(model.parameters(), lr=0.01))
    assert all(torch.equal(m, before[id(p)]) for p, m in second.master_weights())
    del first, second
    gc.collect()
    with pytest.warns(UserWarning, match=r"4 16-bit weight\(s\) had float32 masters in an "
                      r"earlier LossScaleOptimizer that is gone") as seen:  # fmt: skip
        third = mp.LossScaleOptimizer(torch.optim.SGD(model.parameters(), lr=0.01))
    assert [w.filename for w in seen] == [__file__]
    assert all(torch.equal(m, p.float()) for p, m in third.master_weights())


@pytest.mark.parametrize("inner", [False, True], ids=["add_param_group", "inner"])
def test_a_group_added_after_the_last_optimizer_is_gone_says_its_masters_are_lost(inner):
    """A head-only phase with a new optimizer, the first one dropped, then the backbone
    unfrozen with ``add_param_group``: its masters restarted from the roundings (10 times
    the first phase's movement off after AdamW at 1e-5), said only when a whole new
    optimizer was built. Through the inner optimizer's own ``add_param_group``, said at
    the next step."""
    import gc

    model = _o2()
    first = mp.LossScaleOptimizer(torch.optim.SGD(model.parameters(), lr=0.01))
    _train(model, first, steps=3)
    head = torch.optim.SGD(model[1].parameters(), lr=0.01)
    second = mp.LossScaleOptimizer(head)
    del first
    gc.collect()
    _train(model, second)
    backbone = {"params": list(model[0].parameters())}
    with pytest.warns(UserWarning, match=r"2 16-bit weight\(s\) had float32 masters in an "
                      r"earlier LossScaleOptimizer that is gone") as seen:  # fmt: skip
        if inner:
            head.add_param_group(backbone)
            _train(model, second)
        else:
            second.add_param_group(backbone)
    assert __file__ in [w.filename for w in seen]
    with warnings.catch_warnings():  # said once, for the weights of that group
        warnings.simplefilter("error")
        _train(model, second)
        second.add_param_group({"params": [nn.Parameter(torch.zeros(2))]})


def test_weights_loaded_anew_after_the_last_optimizer_is_gone_are_their_own():
    """The old optimizer deleted, then 16-bit weights loaded (a pretrained state dict):
    nothing of a master is lost, yet a new optimizer and ``add_param_group`` said their
    masters restart from the roundings."""
    import gc

    model = _o2()
    first = mp.LossScaleOptimizer(torch.optim.SGD(model.parameters(), lr=0.01))
    _train(model, first, steps=2)
    del first
    gc.collect()
    model.load_state_dict({k: torch.randn_like(v) for k, v in model.state_dict().items()})
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        second = mp.LossScaleOptimizer(torch.optim.SGD(model[1].parameters(), lr=0.01))
        second.add_param_group({"params": list(model[0].parameters())})


def test_a_write_of_the_masters_own_rounding_keeps_their_digits():
    """A checkpoint's 16-bit weights loaded after its masters (Fabric restores the masters
    first when "mixprec" comes before "model"): the weights change nothing, the masters
    keep their float32 digits. Any other write replaces them, element by element: a
    constraint that clamps one element replaced the whole master once, and with it the
    other elements' sub-ulp progress."""
    model = _o2()
    opt = mp.LossScaleOptimizer(torch.optim.SGD(model.parameters(), lr=0.01))
    _train(model, opt, steps=3)
    before = [m.clone() for _, m in opt.master_weights()]
    model.load_state_dict({k: v.clone() for k, v in model.state_dict().items()})
    saved = opt.state_dict()["master_weights"]  # a save takes the writes since the step
    assert all(torch.equal(a, m) for a, m in zip(before, saved, strict=True))
    with torch.no_grad():
        model[0].weight[0].add_(1.0)  # one row written: it wins, the others keep their digits
    now = opt.state_dict()["master_weights"][0]  # model[0].weight's master
    assert torch.equal(now[0], model[0].weight[0].float())
    assert torch.equal(now[1:], saved[0][1:])
    assert not torch.equal(now[1:], model[0].weight[1:].float())  # digits beyond bfloat16


def test_a_model_widened_after_the_optimizer_keeps_its_masters_digits():
    """``model.float()`` mid-training (to evaluate in float32): the widened weights were
    compared in float32 with their masters, so every master took its own rounding (2.4e-4
    off in bfloat16, with no update). The weights now take the masters at the next step."""
    model = _o2()
    opt = mp.LossScaleOptimizer(torch.optim.SGD(model.parameters(), lr=0.01))
    _train(model, opt, steps=3)
    before = [m.clone() for _, m in opt.master_weights()]
    model.float()
    saved = opt.state_dict()["master_weights"]
    assert all(torch.equal(a, m) for a, m in zip(before, saved, strict=True))
    with torch.no_grad():
        model[0].weight[0].add_(1.0)  # a write after the widening still wins
    now = opt.state_dict()["master_weights"][0]
    assert torch.equal(now[0], model[0].weight[0]) and torch.equal(now[1:], before[0][1:])


def test_a_constraint_on_some_elements_keeps_the_others_progress():
    """One element clamped after each step (WGAN's clip, a max-norm on one row) made the
    whole master the clamped 16-bit weight: the other elements' updates, each below a
    bfloat16 ulp, were lost (they moved 9.8e-5 where float32 moved 5.0e-3 in 50 steps)."""
    model = nn.Sequential(nn.Linear(4, 4, bias=False))
    with torch.no_grad():
        model[0].weight.fill_(0.1)
    model = mp.auto_mixed_precision(model, "mixed_bfloat16", "O2")
    opt = mp.LossScaleOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    slope = torch.full((4, 4), -1e-3)
    slope[0, 0] = -1.0  # pushed past the clamp each step
    for _ in range(50):
        opt.zero_grad()
        opt.backward((model[0].weight.float() * slope).sum())  # gradient: slope, in bfloat16
        opt.step()
        with torch.no_grad():
            model[0].weight.clamp_(max=0.15)
    master = opt.state_dict()["master_weights"][0]  # with the last clamp taken in
    assert master[0, 0].item() == pytest.approx(0.15, abs=1e-3)
    # float32 reaches 0.1 + 50 * 0.1 * 1e-3 = 0.105 (bfloat16's ulp at 0.1 is 4.9e-4).
    step = -0.1 * slope[0, 1].to(torch.bfloat16).item()
    assert master[0, 1].item() == pytest.approx(0.1 + 50 * step, rel=1e-4)


def test_a_master_does_not_share_its_weights_version_counter():
    """The float32 values kept at preparation are a view of the float32 parameter as it
    was; a master made from them without a copy shared the weight's version counter, so
    every write to the master looked like an external write to the weight."""
    model = _o2()
    opt = mp.LossScaleOptimizer(torch.optim.SGD(model.parameters(), lr=0.01))
    weight, master = opt.master_weights()[0]
    version = weight._version
    with torch.no_grad():
        master.add_(0.5)
    assert weight._version == version


def test_a_weights_only_load_gives_the_masters_the_files_float32_values(tmp_path):
    """``load_checkpoint(path, model)`` with the optimizer already built: the masters took
    the loaded 16-bit weights, rounded, though the file holds the float32 masters (and the
    load keeps them on the weights). Training back from an earlier checkpoint lost them."""
    model = _o2()
    opt = mp.LossScaleOptimizer(torch.optim.SGD(model.parameters(), lr=0.01))
    _train(model, opt, steps=2)
    path = mp.save_checkpoint(tmp_path / "early.safetensors", model, opt)
    early = [m.clone() for _, m in opt.master_weights()]
    assert any(not torch.equal(m, m.bfloat16().float()) for m in early)  # digits to lose
    _train(model, opt, steps=3)
    mp.load_checkpoint(path, model)  # the weights alone, as the model's
    saved = opt.state_dict()["master_weights"]
    assert all(torch.equal(a, m) for a, m in zip(early, saved, strict=True))
    _train(model, opt)  # and the step after starts from them
    with torch.no_grad():
        model[0].weight.add_(1.0)  # a later write without float32 values: the weight wins
    assert torch.equal(opt.state_dict()["master_weights"][0], model[0].weight.float())


@pytest.mark.parametrize("policy", ["mixed_float16", "mixed_bfloat16"])
def test_a_group_added_to_the_inner_optimizer_gets_masters_and_unscaled_gradients(policy):
    """``inner.add_param_group`` on the optimizer kept from before the wrap: its 16-bit
    weights stepped with no master and, in float16, with gradients still multiplied by
    the loss scale (max |w| 0.25 -> 1305 in one step), without a word."""

    def run(mixed: bool) -> nn.Module:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 4))
        if mixed:
            model = mp.auto_mixed_precision(model, policy, "O2")
        inner = torch.optim.SGD(model[0].parameters(), lr=0.05)
        opt = mp.LossScaleOptimizer(inner) if mixed else inner
        x, y = torch.randn(32, 16), torch.randint(0, 4, (32,))
        for i in range(6):
            if i == 3:
                inner.add_param_group({"params": model[2].parameters()})
            opt.zero_grad()
            loss = F.cross_entropy(model(x).float(), y)
            opt.backward(loss) if mixed else loss.backward()
            opt.step()
        if mixed:
            assert any(w is model[2].weight for w, _ in opt.master_weights())
        return model

    control, mixed = run(False), run(True)
    torch.manual_seed(0)
    untrained = nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 4))[2].weight
    assert (control[2].weight - untrained).abs().max() > 0.01  # the head did train
    with torch.no_grad():
        moved = (control[2].weight - mixed[2].weight.float()).abs().max()
    assert moved < 2e-3, moved  # 16-bit rounding of weights of ~0.25, and of the forward


def test_a_keras_step_that_raised_leaves_the_next_backward_allowed():
    """``apply_gradients`` whose step raised (the scaler's max_consecutive_skips) left its
    unscale behind, and every later backward was refused as one after ``unscale_()``."""
    model = _o2("mixed_float16")
    scaler = mp.DynamicLossScaler(init_scale=16, max_consecutive_skips=1)
    opt = mp.LossScaleOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), loss_scaler=scaler)
    params = list(model.parameters())
    x, y = torch.randn(8, 4), torch.randint(0, 2, (8,))
    bad = [torch.full_like(p, float("inf"), dtype=torch.float32) for p in params]
    limit = r"^2 overflowing steps in a row \(more than max_consecutive_skips=1\)"
    with pytest.raises(RuntimeError, match=limit):
        for _ in range(3):
            opt.apply_gradients(zip(bad, params, strict=True))
    grads = torch.autograd.grad(opt.get_scaled_loss(F.cross_entropy(model(x).float(), y)), params)
    assert opt.apply_gradients(zip(opt.get_unscaled_gradients(grads), params, strict=True)).applied


def test_apply_gradients_with_accumulation_is_refused():
    """``get_scaled_loss`` divides by ``accumulation_steps`` and ``apply_gradients``
    applied every call: 1/N of each gradient, every step, silently."""
    model = _o2()
    opt = mp.LossScaleOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), accumulation_steps=4)
    params = [p for p in model.parameters()]
    x, y = torch.randn(8, 4), torch.randint(0, 2, (8,))
    grads = torch.autograd.grad(opt.get_scaled_loss(F.cross_entropy(model(x).float(), y)), params)
    with pytest.raises(mp.MisuseError, match=r"accumulation_steps=4 is for backward\(\) and step"):
        opt.apply_gradients(zip(opt.get_unscaled_gradients(grads), params, strict=True))


@pytest.mark.parametrize("policy", ["mixed_float16", "mixed_bfloat16"])
def test_master_params_before_unscale_is_said_and_clipping_after_it_clips(policy):
    """Apex's ``clip_grad_norm_(amp.master_params(opt), max)`` right after the backward:
    the masters' gradients are None until ``unscale_()``, so the clip returned 0 and
    clipped nothing, silently. Now said once; with ``unscale_()`` first it clips what
    the step applies, as a float32 run does."""

    def run(mixed: bool) -> tuple[nn.Module, list[float], list[str]]:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 4))
        if mixed:
            model = mp.auto_mixed_precision(model, policy, "O2")
        inner = torch.optim.SGD(model.parameters(), lr=0.1)
        opt = mp.LossScaleOptimizer(inner, accumulation_steps=2) if mixed else inner
        x, y = torch.randn(32, 16), torch.randint(0, 4, (32,))
        norms = []
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            for _ in range(3):
                opt.zero_grad()
                for xb, yb in ((x[:16], y[:16]), (x[16:], y[16:])):
                    loss = F.cross_entropy(model(xb).float(), yb) / (1 if mixed else 2)
                    opt.backward(loss) if mixed else loss.backward()
                if mixed:
                    list(opt.master_params())  # before unscale_(): said, once
                    opt.unscale_()
                params = opt.master_params() if mixed else model.parameters()
                norms.append(float(torch.nn.utils.clip_grad_norm_(params, max_norm=0.01)))
                opt.step()
        said = [str(w.message) for w in seen if "before unscale_()" in str(w.message)]
        return model, norms, said

    (control, control_norms, _), (mixed, mixed_norms, said) = run(False), run(True)
    assert len(said) == 1 and "clip_grad_norm_ would clip nothing the step applies" in said[0]
    assert mixed_norms == pytest.approx(control_norms, rel=0.02)
    assert min(control_norms) > 0.1  # the clip did act
    with torch.no_grad():
        moved = max((a - b.float()).abs().max() for a, b in zip(
            control.parameters(), mixed.parameters(), strict=True))  # fmt: skip
    assert moved < 3e-3, moved


def test_unscaled_gradients_dropped_by_zero_grad_take_their_unscale_with_them():
    """``unscale_()`` (to log a norm), then ``zero_grad()`` to skip the batch, then a new
    backward and step: the step skipped its own unscale, and a float32 weight took the new
    gradient still multiplied by the loss scale (it moved by 99 where it should move by
    1e-3). A backward after ``unscale_()`` without ``zero_grad()`` is refused."""
    torch.manual_seed(0)
    model = mp.auto_mixed_precision(
        nn.Sequential(nn.Linear(4, 4), nn.LayerNorm(4), nn.Linear(4, 2)), "mixed_float16", "O2"
    )
    opt = mp.LossScaleOptimizer(torch.optim.SGD(model.parameters(), lr=0.01))
    x, y = torch.randn(8, 4), torch.randint(0, 2, (8,))
    opt.zero_grad()
    opt.backward(F.cross_entropy(model(x).float(), y))
    opt.unscale_()
    with pytest.raises(mp.MisuseError, match=r"a backward after unscale_\(\) and before step"):
        opt.backward(F.cross_entropy(model(x).float(), y))
    opt.zero_grad()  # the batch skipped
    before = model[1].weight.detach().clone()
    opt.backward(F.cross_entropy(model(x).float(), y))
    assert opt.step().applied
    assert (model[1].weight - before).abs().max() < 0.05
    # A dropped group of two micro-batches: the next group counts its two anew.
    accumulating = mp.LossScaleOptimizer(torch.optim.SGD(model.parameters(), lr=0.01),
                                         accumulation_steps=2)  # fmt: skip
    for _ in range(2):
        accumulating.backward(F.cross_entropy(model(x).float(), y))
    accumulating.unscale_()
    accumulating.zero_grad()
    accumulating.backward(F.cross_entropy(model(x).float(), y))
    assert accumulating.step().accumulating  # one of two: not applied yet


def test_a_group_added_between_unscale_and_step_is_refused_and_states_hold_added_groups():
    model = _o2()
    inner = torch.optim.SGD(model[0].parameters(), lr=0.1)
    opt = mp.LossScaleOptimizer(inner)
    x, y = torch.randn(8, 4), torch.randint(0, 2, (8,))
    opt.backward(F.cross_entropy(model(x).float(), y))
    opt.unscale_()
    inner.add_param_group({"params": model[1].parameters()})
    with pytest.raises(mp.MisuseError, match=r"param group was added between unscale_\(\)"):
        opt.step()
    with pytest.raises(mp.MisuseError, match=r"param group was added between unscale_\(\)"):
        opt.add_param_group({"params": []})  # through the wrapper too
    # Between steps, a state holds the added group's masters (it held only the first two).
    opt.zero_grad()
    assert len(opt.state_dict()["master_weights"]) == 4


@pytest.mark.parametrize("when", ["before the optimizer", "after the optimizer"])
def test_a_float32_state_dict_loaded_into_a_prepared_model_starts_the_masters(when):
    """``model.load_state_dict(float32_state)`` into an O2 model, the ordinary torch habit
    for pretrained weights: the masters started from (or followed) the 16-bit rounding."""
    torch.manual_seed(5)
    values = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2)).state_dict()  # float32
    model = _o2()
    if when == "before the optimizer":
        model.load_state_dict(values)
    opt = mp.LossScaleOptimizer(torch.optim.SGD(model.parameters(), lr=0.0))
    if when == "after the optimizer":
        _train(model, opt)
        model.load_state_dict(values)
    masters = opt.state_dict()["master_weights"]  # a save takes the writes since the step
    expected = [values[k] for k in ("0.weight", "0.bias", "1.weight", "1.bias")]
    assert all(torch.equal(m, v) for m, v in zip(masters, expected, strict=True))
    assert any(not torch.equal(v, v.bfloat16().float()) for v in expected)  # digits to lose
    copy.deepcopy(model).load_state_dict(values)  # the hooks travel with a copy


@pytest.mark.parametrize("through_data", [True, False])
def test_a_write_through_data_is_said_at_the_second_step(through_data):
    """WGAN's ``p.data.clamp_(-c, c)`` after each step: the version counters do not move,
    so the next copy-back from the masters undid the clamp at every step, silently. A
    write on the weight itself is followed into its master, and nothing is said."""
    model = _o2()
    opt = mp.LossScaleOptimizer(torch.optim.SGD(model.parameters(), lr=0.5))
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        for _ in range(4):
            _train(model, opt)
            for p in model.parameters():
                if through_data:
                    p.data.clamp_(-0.01, 0.01)
                else:
                    with torch.no_grad():
                        p.clamp_(-0.01, 0.01)
    said = [str(w.message) for w in seen if "written through .data" in str(w.message)]
    if through_data:
        assert len(said) == 1 and said[0].startswith("4 16-bit weight(s) moved")
        assert max(float(m.abs().max()) for _, m in opt.master_weights()) > 0.1  # undone
        # A save, which writes the masters, gives them the weights' values first.
        with pytest.warns(UserWarning, match=r"differ from their float32 masters"):
            masters = opt.state_dict()["master_weights"]
    else:
        assert said == []
        masters = opt.state_dict()["master_weights"]
    assert max(float(m.abs().max()) for m in masters) <= 0.0101


def test_a_global_policy_over_an_unprepared_model_is_said():
    """Keras' habit: ``set_global_policy("mixed_float16")``, then a model and a
    ``LossScaleOptimizer``. torch's layers do not read the policy: the model trained in
    float32 (with loss scaling taken from the policy), and nothing said so."""
    mp.set_global_policy("mixed_float16")
    x, y = torch.randn(8, 4), torch.randint(0, 2, (8,))
    for prepare in (False, True):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
        if prepare:
            model = mp.auto_mixed_precision(model)  # the global policy is its default
        opt = mp.LossScaleOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            opt.backward(F.cross_entropy(model(x).float(), y))
        said = [str(w.message) for w in seen if "global policy" in str(w.message)]
        assert len(said) == (0 if prepare else 1), said
        if not prepare:
            assert "'mixed_float16'" in said[0] and "mp.auto_mixed_precision(model)" in said[0]


def test_a_write_through_data_after_the_second_step_is_what_a_save_holds(tmp_path):
    """A max-norm constraint (or an average) applied through .data after the second step:
    the save wrote the masters the model no longer held (the model evaluated was not the
    model saved, 0.182 apart), saying nothing. The save now takes the weights' values, and
    the masters follow them."""
    model = _o2()
    opt = mp.LossScaleOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    _train(model, opt, steps=3)
    with torch.no_grad():
        model[0].weight.data.mul_(0.5)  # unseen by the version counters
    written = model[0].weight.detach().clone()
    with pytest.warns(UserWarning, match=r"1 16-bit weight\(s\) differ from their float32"):
        mp.export_weights(model, tmp_path / "w.safetensors", optimizer=opt)
    fresh = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    mp.load_checkpoint(tmp_path / "w.safetensors", fresh)
    assert torch.equal(fresh[0].weight.to(written.dtype), written)  # the written values
    master = dict(opt.master_weights())[model[0].weight]
    assert torch.equal(master.to(written.dtype), written)  # the master follows them
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        mp.save_checkpoint(tmp_path / "c.safetensors", model, opt)  # said once
    _train(model, opt)  # the next step starts from the written weights, not undone
    assert (model[0].weight.float() - written.float()).abs().max() < 0.1


def test_a_weight_given_new_storage_after_the_second_step_is_followed():
    """``param.data = ...`` (``vector_to_parameters``, ``prune.remove``) after the second
    step: the version counters never saw it, and the next copy-back put the old values
    back (a rollback to a snapshot went on from the pre-rollback weights, 7.3e-2 away)."""
    model = _o2()
    opt = mp.LossScaleOptimizer(torch.optim.SGD(model.parameters(), lr=0.01))
    snapshot = nn.utils.parameters_to_vector(model.parameters()).clone()
    _train(model, opt, steps=3)
    nn.utils.vector_to_parameters(snapshot, model.parameters())  # param.data = ...
    back = [p.detach().float().clone() for p in model.parameters()]
    opt.zero_grad()  # a step with zero gradients moves nothing: the copy-back alone
    opt.backward(model(torch.randn(2, 4)).float().sum() * 0.0)
    opt.step()
    assert all(torch.equal(p.float(), b) for p, b in zip(model.parameters(), back, strict=True))
