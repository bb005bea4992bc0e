"""The float32 master weights: adopted from the unrounded weights, their gradients, writes
made outside the optimizer, and float16 weights an update pushes past their range."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

import mixprec as mp
from tests.conftest import make_mlp
from tests.optim._helpers import float16_bias_pushed_over, loss_of, prepared

BF16, F32 = torch.bfloat16, torch.float32


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


def test_keep_grad_buffers_keeps_the_master_gradients_and_trains_the_same():
    # keep_grad_buffers=True: the float32 master gradients outlive zero_grad (the same
    # tensors every step), and training is bit for bit the default's.
    runs = []
    for keep in (False, True):
        model = mp.auto_mixed_precision(make_mlp(), "mixed_bfloat16", "O2")
        opt = mp.LossScaleOptimizer(
            torch.optim.AdamW(model.parameters(), lr=1e-2), keep_grad_buffers=keep
        )
        buffers = []
        for _ in range(3):
            opt.zero_grad()
            opt.backward(loss_of(model))
            assert opt.step().applied
            buffers.append([m.grad for _, m in opt.master_weights()])
        opt.zero_grad()
        if keep:
            assert all(a is b for a, b in zip(buffers[0], buffers[2], strict=True))
        assert opt.master_weights() and all(
            (m.grad is not None) == keep for _, m in opt.master_weights()
        )
        assert all(p.grad is None for p in model.parameters())
        runs.append([p.detach().clone() for p in model.parameters()])
    assert all(torch.equal(a, b) for a, b in zip(*runs, strict=True))
    with pytest.raises(TypeError, match=r"keep_grad_buffers must be True or False, got 1"):
        mp.LossScaleOptimizer(torch.optim.SGD(make_mlp().parameters()), keep_grad_buffers=1)


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


def test_o3_has_no_masters():
    model = mp.auto_mixed_precision(make_mlp(), "bfloat16", "O3")
    opt = mp.LossScaleOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    assert all(p.dtype == BF16 for p in opt.master_params())
    assert all(a is b for a, b in zip(opt.master_params(), model.parameters(), strict=True))


def test_warns_when_adam_eps_vanishes_in_pure_float16():
    model = mp.auto_mixed_precision(make_mlp(), "float16", "O3")
    said = r"gradient statistics .* in float16.*eps=1e-08 is 0 in float16"
    with pytest.warns(UserWarning, match=said) as seen:
        mp.LossScaleOptimizer(torch.optim.AdamW(model.parameters()))
    # At the user's line, directly and through build_train_step; AdamW's default decay
    # (1e-5 of a weight a step) rounds away in float16 too.
    assert [w.filename for w in seen] == [__file__, __file__]
    assert "weight decay takes 1e-05 of a weight a step" in str(seen[1].message)
    with pytest.warns(UserWarning, match=said) as seen:
        mp.build_train_step(model, torch.optim.AdamW(model.parameters()), "cross_entropy",
                            "float16", "O3")  # fmt: skip
    assert [w.filename for w in seen if "eps=" in str(w.message)] == [__file__]

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        mp.LossScaleOptimizer(mp.CompensatedAdamW(model.parameters()))  # float32 state
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
    # O2 keeps a float32 copy on each 16-bit parameter until its optimizer's masters start
    # from it (the bytes released, non-zero); O3 keeps none.
    o2 = mp.auto_mixed_precision(make_mlp(), "mixed_bfloat16", "O2")
    assert mp.release_float32_copies(o2) > 0
    o3 = mp.auto_mixed_precision(make_mlp(), "bfloat16", "O3")
    assert mp.release_float32_copies(o3) == 0


@pytest.mark.parametrize("name", ["float16", "bfloat16"])
def test_masters_keep_updates_the_16_bit_weights_cannot_hold(name):
    """A weight of 1.0 and 20 SGD updates of eps/8 each (2**-13 in float16, 2**-10 in
    bfloat16; loss = w * 1, so the gradient is exactly 1 and the scale 1 keeps it so): a
    quarter of the ulp just below 1.0 (eps/2), so one update rounds away in 16 bits. The
    float32 master sums them exactly to 1 - 20 * eps/8, which the 16-bit weight then holds
    (a multiple of eps/2); at O3, with no master, the weight never moves."""
    dtype = getattr(torch, name)
    update = torch.finfo(dtype).eps / 8
    for level in ("O2", "O3"):
        lin = nn.Linear(1, 1, bias=False)
        nn.init.ones_(lin.weight)
        model = mp.auto_mixed_precision(nn.Sequential(lin), f"mixed_{name}", level)
        sgd = torch.optim.SGD(model.parameters(), lr=update)
        opt = mp.LossScaleOptimizer(sgd, loss_scaler=mp.StaticLossScaler(1.0))
        weights = []
        for _ in range(20):
            opt.zero_grad()
            opt.backward(model(torch.ones(1, 1)).sum())
            assert opt.step().applied
            weights.append(lin.weight.item())
        assert lin.weight.dtype == dtype
        if level == "O3":
            assert opt.master_weights() == [] and weights == [1.0] * 20
            continue
        ((weight, master),) = opt.master_weights()
        assert weight is lin.weight and master.dtype == F32
        assert master.item() == 1 - 20 * update
        # After each step the 16-bit weight is the master's sum so far, rounded.
        rounded = [torch.tensor(1 - k * update).to(dtype).item() for k in range(1, 21)]
        assert weights == rounded and weights[0] == 1.0 and weights[-1] == 1 - 20 * update


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
    # Not every later step applied with an inf bias: the next step raises.
    opt, applied = _push_past_float16(mp.StaticLossScaler(1.0))
    assert applied == [True]  # the overflowing update, then the error before anything else
    assert opt.loss_scaler.get_scale() == 1.0


def test_update_past_float16_range_with_the_default_dynamic_scaler() -> None:
    _, applied = _push_past_float16(None)
    # The scale backs off from 2**16 until the scaled loss fits, one update applies, and the
    # next step names the weight (not skipped or applied with an inf weight for ever).
    assert applied[-1] is True and applied.count(True) == 1


def test_o3_float16_weight_pushed_to_inf_is_named() -> None:
    _, opt = float16_bias_pushed_over("float16", "O3")
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


def test_frozen_weights_keeping_their_float32_values_are_said_once():
    """A frozen backbone at O2: its 16-bit weights kept their float32 values for good (no
    optimizer takes them), 1.5 times the float32 model's weight memory, unsaid."""
    torch.manual_seed(0)
    backbone = nn.Sequential(*[nn.Linear(256, 256) for _ in range(8)]).requires_grad_(False)
    model = mp.auto_mixed_precision(nn.Sequential(backbone, nn.Linear(256, 10)),
                                    "mixed_bfloat16", "O2")  # fmt: skip
    opt = mp.LossScaleOptimizer(
        torch.optim.AdamW([p for p in model.parameters() if p.requires_grad])
    )
    x, y = torch.randn(4, 256), torch.randint(0, 10, (4,))
    with pytest.warns(UserWarning, match=r"16 16-bit weights no LossScaleOptimizer holds .* "
                      r"2\.0 MiB more.*release_float32_copies") as said:  # fmt: skip
        for _ in range(3):
            opt.zero_grad()
            opt.backward(nn.functional.cross_entropy(model(x), y))
            opt.step()
    assert len([w for w in said if "no LossScaleOptimizer holds" in str(w.message)]) == 1
    assert mp.release_float32_copies(model) == 8 * (256 * 256 + 256) * 4
    trained = mp.auto_mixed_precision(make_mlp(), "mixed_bfloat16", "O2")  # all held
    opt = mp.LossScaleOptimizer(torch.optim.AdamW(trained.parameters()))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        opt.backward(loss_of(trained))
        opt.step()


def test_weights_that_train_under_a_later_optimizer_are_not_taken_for_frozen():
    """Fabric wraps each optimizer at its own first step: at the first one's step the
    second's weights still kept their float32 values, and were said as frozen."""
    torch.manual_seed(0)
    model = mp.auto_mixed_precision(
        nn.Sequential(nn.Linear(512, 512), nn.ReLU(), nn.Linear(512, 512)), "mixed_bfloat16", "O2"
    )
    biases = [p for n, p in model.named_parameters() if n.endswith("bias")]
    x = torch.randn(4, 512)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        first = mp.LossScaleOptimizer(torch.optim.SGD(biases, lr=0.1))
        first.backward(model(x).float().pow(2).mean())
        first.step()


@pytest.mark.parametrize("policy", ["mixed_bfloat16", "mixed_float16"])
def test_a_group_frozen_through_param_groups_stays_put_as_in_float32(policy):
    """``for p in opt.param_groups[0]["params"]: p.requires_grad_(False)``, as float32 code
    freezes a group: at O2 those are the masters, and each step still copied the 16-bit
    weights' gradients into them, so the "frozen" layer kept training (0.068 moved in 10
    AdamW steps where float32 moved 0), unsaid."""
    torch.manual_seed(0)
    model = mp.auto_mixed_precision(
        torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4)),
        policy, "O2",
    )  # fmt: skip
    params = list(model.parameters())
    opt = mp.LossScaleOptimizer(
        torch.optim.AdamW([{"params": params[:2]}, {"params": params[2:]}], lr=1e-2)
    )
    x, y = torch.randn(16, 8), torch.randint(0, 4, (16,))

    def step() -> None:
        opt.zero_grad()
        opt.backward(torch.nn.functional.cross_entropy(model(x).float(), y))
        opt.step()

    step()
    for p in opt.param_groups[0]["params"]:
        p.requires_grad_(False)
    frozen = model[0].weight.detach().clone()
    head = model[2].weight.detach().clone()
    for _ in range(5):
        step()
    assert torch.equal(model[0].weight, frozen)
    assert not torch.equal(model[2].weight, head)  # the other group trains on
    for p in opt.param_groups[0]["params"]:
        p.requires_grad_(True)
    step()
    assert not torch.equal(model[0].weight, frozen)  # and unfrozen, it trains again
