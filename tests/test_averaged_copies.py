"""A torch ``AveragedModel`` of a prepared model with 16-bit weights averages in 16 bits and
stops moving: the next step says so, unless the average was made float32 first."""

from __future__ import annotations

import copy
import inspect
import warnings

import pytest
import torch
from torch import nn
from torch.optim.swa_utils import AveragedModel, get_ema_avg_fn, get_ema_multi_avg_fn

import mixprec as mp
from tests.conftest import classification_data, make_mlp

AVERAGES_IN = r"the AveragedModel made at .*test_averaged_copies.py:\d+ holds the model's bfloat16"


def _train(model, opt, averages, steps=150, first=0):
    x, y = classification_data(n=256, seed=3)
    for i in range(first, first + steps):
        j = (i * 32) % 256
        loss = nn.functional.cross_entropy(model(x[j : j + 32]).float(), y[j : j + 32])
        if isinstance(opt, mp.LossScaleOptimizer):
            opt.backward(loss)
        else:
            loss.backward()
        opt.step()
        opt.zero_grad()
        for average in averages:
            average.update_parameters(model)


def test_a_16bit_average_is_said_at_the_next_step_and_a_float32_one_tracks_float32():
    control = make_mlp()
    control_ema = AveragedModel(control, multi_avg_fn=get_ema_multi_avg_fn(0.999))
    _train(control, torch.optim.SGD(control.parameters(), lr=0.05), [control_ema])

    model = mp.auto_mixed_precision(make_mlp(), "mixed_bfloat16", "O2")
    opt = mp.LossScaleOptimizer(torch.optim.SGD(model.parameters(), lr=0.05))
    line = inspect.currentframe().f_lineno + 1
    stuck = AveragedModel(model, multi_avg_fn=get_ema_multi_avg_fn(0.999))
    kept = AveragedModel(model, avg_fn=get_ema_avg_fn(0.999))
    kept.module.float()  # the fix the warning names: no word for this one
    with pytest.warns(UserWarning, match=AVERAGES_IN) as said:
        _train(model, opt, [stuck, kept], steps=1)
    told = [w for w in said if "AveragedModel" in str(w.message)]
    assert len(told) == 1 and f"test_averaged_copies.py:{line} " in str(told[0].message)
    assert told[0].filename == __file__  # at the step's line
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _train(model, opt, [stuck, kept], steps=149, first=1)  # said once

    def off(average):
        return max(
            (a.float() - b).abs().max().item()
            for a, b in zip(average.parameters(), control_ema.parameters(), strict=True)
        )

    # Against the float32 run's average (which moved 3.5e-2): the float32 average of the
    # bfloat16 run is 1.1e-3 off, the bfloat16 one 2.1e-2 (the model itself: 1.3e-2).
    assert off(kept) < 3e-3 and off(stuck) > 1e-2


def test_no_word_for_other_copies_or_float32_weights():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        o1 = mp.auto_mixed_precision(make_mlp(), "mixed_bfloat16", "O1")
        average = AveragedModel(o1)
        o2 = mp.auto_mixed_precision(make_mlp(), "mixed_bfloat16", "O2")
        teacher = copy.deepcopy(o2)  # a copy for another purpose
        for model in (o1, o2):
            opt = mp.LossScaleOptimizer(torch.optim.SGD(model.parameters(), lr=0.05))
            _train(model, opt, [average] if model is o1 else [], steps=2)
        assert next(teacher.parameters()).dtype == torch.bfloat16


def test_said_at_the_callers_line_under_a_compiled_step():
    """The eager part of ``torch.compile(opt.step)`` runs beneath dynamo's frames: the
    warning named torch/_dynamo/eval_frame.py."""
    model = mp.auto_mixed_precision(make_mlp(), "mixed_bfloat16", "O2")
    opt = mp.LossScaleOptimizer(torch.optim.SGD(model.parameters(), lr=0.05))
    step = torch.compile(opt.step, backend="eager")
    average = AveragedModel(model, multi_avg_fn=get_ema_multi_avg_fn(0.999))
    x, y = classification_data(n=32, seed=3)
    opt.backward(nn.functional.cross_entropy(model(x).float(), y))
    with pytest.warns(UserWarning, match=AVERAGES_IN) as said:
        step()
    told = [w for w in said if "AveragedModel" in str(w.message)]
    assert len(told) == 1 and told[0].filename == __file__
    assert next(average.parameters()).dtype == torch.bfloat16


def _ema_by_hand(policy, widen=False, decay=0.99, steps=60):
    """timm's ModelEmaV2 kept by hand: a deep copy updated over the state dicts."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
    start = torch.cat([p.detach().reshape(-1).clone() for p in model.parameters()])
    if policy:
        model = mp.auto_mixed_precision(model, policy, "O2")
    inner = torch.optim.AdamW(model.parameters(), lr=1e-3)
    opt = mp.LossScaleOptimizer(inner) if policy else inner
    ema = copy.deepcopy(model).eval()
    if widen:
        ema.float()
    g = torch.Generator().manual_seed(1)
    for _ in range(steps):
        x, y = torch.randn(32, 16, generator=g), torch.randint(0, 4, (32,), generator=g)
        opt.zero_grad()
        loss = nn.functional.cross_entropy(model(x), y)
        opt.backward(loss) if policy else loss.backward()
        opt.step()
        with torch.no_grad():
            for e, v in zip(ema.state_dict().values(), model.state_dict().values(), strict=True):
                e.copy_(decay * e + (1 - decay) * v)
    moved = torch.cat([p.detach().float().reshape(-1) for p in ema.parameters()]) - start
    return moved


def test_an_average_kept_by_hand_in_a_16bit_copy_is_said_and_its_fix_is_not():
    """An O2 bfloat16 EMA in a plain deep copy ended 0.88 of float32's movement away from
    it (relative), unsaid. Said once, at the third step that wrote it; the advised
    ``.float()`` copy is silent and within 0.1 of float32."""
    control = _ema_by_hand(None)
    with pytest.warns(UserWarning, match=r"copy of the model made at .*test_averaged_copies"
                      r".py:\d+ holds its bfloat16 weights .*copy.float\(\)") as said:  # fmt: skip
        stalled = _ema_by_hand("mixed_bfloat16")
    assert len([w for w in said if "copy of the model" in str(w.message)]) == 1
    assert (stalled - control).norm() / control.norm() > 0.5  # the defect the warning names
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        fixed = _ema_by_hand("mixed_bfloat16", widen=True)
    assert (fixed - control).norm() / control.norm() < 0.1


def test_a_teacher_a_best_model_and_a_copy_trained_by_its_own_wrapper_are_not_said():
    model = mp.auto_mixed_precision(
        nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4)), "mixed_bfloat16", "O2"
    )
    opt = mp.LossScaleOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    teacher, best, twin = copy.deepcopy(model), copy.deepcopy(model), copy.deepcopy(model)
    twin_opt = mp.LossScaleOptimizer(torch.optim.SGD(twin.parameters(), lr=0.1))
    x, y = torch.randn(8, 16), torch.randint(0, 4, (8,))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for i in range(8):
            for net, step in ((model, opt), (twin, twin_opt)):  # the twin: a wrapper's own
                step.zero_grad()
                step.backward(nn.functional.cross_entropy(net(x), y))
                step.step()
            if i in (1, 2, 5):  # improved at those steps
                best.load_state_dict(model.state_dict())
            with torch.no_grad():
                teacher(x)
    assert not mp._averaged_copies.WATCHED  # nothing watched after the first steps


def _gan_with_a_copy(steps: int, update) -> None:
    """A GAN under two wrappers; after G's steps, ``update(copy_weight, g_weight)`` writes
    the copy of G made before them (an EMA, a synced copy)."""
    gen = mp.auto_mixed_precision(
        nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4)), "mixed_bfloat16", "O2"
    )
    disc = mp.auto_mixed_precision(
        nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Linear(16, 1)), "mixed_bfloat16", "O2"
    )
    copied = copy.deepcopy(gen).eval()
    opt_g = mp.LossScaleOptimizer(torch.optim.Adam(gen.parameters(), lr=1e-3))
    opt_d = mp.LossScaleOptimizer(torch.optim.Adam(disc.parameters(), lr=1e-3))
    for _ in range(steps):
        z, real = torch.randn(8, 8), torch.randn(8, 4)
        opt_d.zero_grad()
        opt_d.backward(disc(gen(z).detach()).mean() - disc(real).mean())
        opt_d.step()
        opt_g.zero_grad()
        opt_g.backward(-disc(gen(z)).mean())
        opt_g.step()
        with torch.no_grad():
            for e, p in zip(copied.parameters(), gen.parameters(), strict=True):
                update(e, p)


def test_a_gan_ema_under_two_wrappers_is_said_and_a_copy_synced_by_loads_is_not():
    """StyleGAN's G_ema, written after G's steps alone: D's step between found it unchanged
    and dropped it, unsaid. PPO's old policy, loaded from the policy after each update, is
    an exact copy: it was said as a stalled average."""
    with pytest.warns(UserWarning, match="copy of the model made at") as said:
        _gan_with_a_copy(6, lambda e, p: e.copy_(p.lerp(e, 0.999)))
    assert len([w for w in said if "copy of the model" in str(w.message)]) == 1
    policy = mp.auto_mixed_precision(
        nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4)), "mixed_bfloat16", "O2"
    )
    old = copy.deepcopy(policy)
    opt = mp.LossScaleOptimizer(torch.optim.Adam(policy.parameters(), lr=1e-3))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for _ in range(6):
            opt.zero_grad()
            opt.backward(policy(torch.randn(8, 8)).mean())
            opt.step()
            old.load_state_dict(policy.state_dict())


def _written_copy_message(line: int) -> str:
    return (
        f"the copy of the model made at {__file__}:{line} holds its bfloat16 weights and was "
        "written in place at each step since: an average kept by hand (an EMA, as timm's "
        "ModelEmaV2 keeps one; or a plain optimizer's steps) moves in bfloat16, where an "
        "update below half a unit in the last place of a weight rounds away, and at "
        "decay=0.999 it stops moving. Keep the copy in float32 (copy.float() once made: the "
        "state dict's values are cast as they are copied in), or use the Trainer's "
        "mp.EMA(decay)"
    )


@pytest.mark.parametrize("sync", ["after the step", "before the forward"])
def test_a_copy_kept_in_step_with_the_model_is_not_said_and_an_ema_beside_it_is(sync):
    """Review: a previous-step (or target) copy, ``q.copy_(p)`` each step, was said as a
    16-bit average that stops moving: it is an exact copy, nothing rounds away."""
    torch.manual_seed(0)
    model = mp.auto_mixed_precision(
        nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4)), "mixed_bfloat16", "O2"
    )
    opt = mp.LossScaleOptimizer(torch.optim.Adam(model.parameters(), lr=1e-3))
    prev = copy.deepcopy(model).requires_grad_(False)
    line = inspect.currentframe().f_lineno + 1
    ema = copy.deepcopy(model).requires_grad_(False)

    def sync_prev():
        with torch.no_grad():
            for q, p in zip(prev.parameters(), model.parameters(), strict=True):
                q.copy_(p)

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(8):
            x, y = torch.randn(8, 16), torch.randint(0, 4, (8,))
            if sync == "before the forward":
                sync_prev()
            with torch.no_grad():
                target = prev(x).softmax(-1)
            out = model(x)
            loss = nn.functional.cross_entropy(out, y) + nn.functional.kl_div(
                out.log_softmax(-1), target, reduction="batchmean"
            )
            opt.zero_grad()
            opt.backward(loss)
            opt.step()
            if sync == "after the step":
                sync_prev()
            with torch.no_grad():
                for e, p in zip(ema.parameters(), model.parameters(), strict=True):
                    e.copy_(p.lerp(e, 0.999))
    said = [str(w.message) for w in caught if "copy of the model" in str(w.message)]
    assert said == [_written_copy_message(line)]  # the EMA's, not the synced copy's
    assert not mp._averaged_copies.WATCHED  # both looked at, then dropped: no more cost


def test_a_gan_generators_synced_copy_under_two_wrappers_is_not_said():
    # Written after G's steps alone, looked at by D's steps too: equal to G as it was at
    # the look before the last, whichever wrapper's step that was.
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _gan_with_a_copy(8, lambda e, p: e.copy_(p))
    assert not mp._averaged_copies.WATCHED


def test_an_ema_over_a_model_that_first_stands_still_is_still_said():
    """A float16 model whose first steps skip while the scale settles: its EMA equals the
    still model, was taken for a synced copy at the looks of those steps and dropped,
    unsaid. The decision waits for a move of the model."""
    torch.manual_seed(0)
    model = mp.auto_mixed_precision(
        nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4)), "mixed_float16", "O2"
    )
    opt = mp.LossScaleOptimizer(torch.optim.Adam(model.parameters(), lr=1e-3))
    ema = copy.deepcopy(model).requires_grad_(False)
    applied = []
    with pytest.warns(UserWarning, match="copy of the model made at") as said:
        for _ in range(12):
            opt.zero_grad()
            x, y = torch.randn(8, 16), torch.randint(0, 4, (8,))
            opt.backward(nn.functional.cross_entropy(model(x).float(), y) * 1e3)
            applied.append(opt.step().applied)
            with torch.no_grad():
                for e, p in zip(ema.parameters(), model.parameters(), strict=True):
                    e.copy_(p.lerp(e, 0.999))
    assert applied[:4] == [False] * 4 and applied[-1]  # it stood still, then moved
    assert len([w for w in said if "copy of the model" in str(w.message)]) == 1
    # The float32 values the copy carried (a best model's export) were stale once averaged
    # into: dropped, not kept beside the EMA for good (4 bytes a parameter).
    from mixprec._float32_copies import FP32_COPY_ATTR

    assert not any(FP32_COPY_ATTR in p.__dict__ for p in ema.parameters())


def test_float32_values_loaded_into_a_copy_are_not_dropped_as_stale():
    """A copy kept aside, then loaded with float32 weights: the watcher dropped the values
    the load kept, taking them for those the copy carried, and the copy's export started
    from the roundings (4.9e-4 off)."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
    loaded = {k: v + 1e-3 * torch.randn_like(v) for k, v in net.state_dict().items()}
    model = mp.auto_mixed_precision(net, "mixed_bfloat16", "O2")
    opt = mp.LossScaleOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-2))
    best = copy.deepcopy(model)
    best.load_state_dict(loaded)
    for _ in range(2):
        opt.zero_grad()
        opt.backward(nn.functional.mse_loss(model(torch.randn(8, 16)), torch.zeros(8, 4)))
        opt.step()
    widened = mp.to_float(copy.deepcopy(best), "float32")
    assert torch.equal(widened[0].weight, loaded["0.weight"])
