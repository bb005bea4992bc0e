"""Models already in 16 bits (``model.to(torch.bfloat16)``, a float16 checkpoint) given to
``auto_mixed_precision``: levels with float32 weights or masters (O0, O1, O2, MindSpore's O3)
upcast them to float32 first and say so in one warning; O3 takes them as they are."""

from __future__ import annotations

import re
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import mixprec as mp
from mixprec.float8 import is_float8

BF16, F16, F32 = torch.bfloat16, torch.float16, torch.float32


def net(seed: int = 0) -> nn.Sequential:
    """10 floating parameters (3 Linear, BatchNorm, LayerNorm) and 2 floating buffers."""
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Linear(16, 32),
        nn.BatchNorm1d(32),
        nn.ReLU(),
        nn.Linear(32, 32),
        nn.LayerNorm(32),
        nn.Linear(32, 16),
    )


def note(dtype: torch.dtype, level: str, what: str = "10 parameters and 2 buffers") -> str:
    """The warning, whole, as a regex."""
    why = {"O2": "master weights and norms", "O3": "master weights"}.get(level, "weights")
    name = str(dtype).removeprefix("torch.")
    return "^" + re.escape(
        f"auto_mixed_precision: {what} of the model were {name}; upcast to float32 so that "
        f"{level} has float32 {why}; the precision lost when they were rounded to 16 bits is "
        "not recovered"
    ) + "$"  # fmt: skip


def floating(model: nn.Module) -> dict[str, torch.dtype]:
    tensors = [*model.named_parameters(), *model.named_buffers()]
    return {n: t.dtype for n, t in tensors if t.is_floating_point()}


@pytest.mark.parametrize("dtype", [BF16, F16])
@pytest.mark.parametrize(("policy", "level"), [("float32", "O0"), ("mixed_bfloat16", "O1")])
def test_o0_and_o1_store_a_16_bit_model_in_float32(dtype, policy, level):
    model = net().to(dtype)
    with pytest.warns(UserWarning, match=note(dtype, level)) as record:
        mp.auto_mixed_precision(model, policy, level)
    assert len(record) == 1 and record[0].filename == __file__  # one line, at this call
    assert set(floating(model).values()) == {F32}
    assert model(torch.randn(4, 16)).dtype == F32


@pytest.mark.parametrize("dtype", [BF16, F16])
@pytest.mark.parametrize("compute", [BF16, F16])
def test_o2_gives_a_16_bit_model_float32_norms_and_exact_float32_masters(dtype, compute):
    model = net().to(dtype)
    values = {n: p.detach().clone() for n, p in model.named_parameters()}
    policy = "mixed_bfloat16" if compute == BF16 else "mixed_float16"
    with pytest.warns(UserWarning, match=note(dtype, "O2")):
        mp.auto_mixed_precision(model, policy, "O2")
    stored = floating(model)
    assert {stored[f"{i}.{w}"] for i in (0, 3, 5) for w in ("weight", "bias")} == {compute}
    norms = ["1.weight", "1.bias", "1.running_mean", "1.running_var", "4.weight", "4.bias"]
    assert {stored[n] for n in norms} == {F32}
    opt = mp.LossScaleOptimizer(torch.optim.AdamW(model.parameters()))
    names = {id(p): n for n, p in model.named_parameters()}
    pairs = opt.master_weights()
    assert len(pairs) == 6  # the three Linear layers' weights and biases
    for half, master in pairs:
        # The masters are the checkpoint's 16-bit values exactly, even where the compute
        # dtype differs (float16 values stored in bfloat16 would lose 3 bits).
        assert master.dtype == F32 and torch.equal(master, values[names[id(half)]].float())
        assert torch.equal(half, master.to(compute))


@pytest.mark.parametrize("dtype", [BF16, F16])
def test_o2_from_an_upcast_model_trains_as_o2_from_the_rounded_float32_weights(dtype):
    """The control: the same weights, rounded to ``dtype``, held in a float32 model. After
    the upcast both models hold exactly the same float32 values, so every step is bitwise
    the same (tolerance 0): losses, 16-bit weights, masters and norm statistics."""
    half = net().to(dtype)
    control = net()
    with torch.no_grad():
        for p in [*control.parameters(), *control.buffers()]:
            if p.is_floating_point():
                p.copy_(p.to(dtype).float())
    with pytest.warns(UserWarning, match=note(dtype, "O2")):
        mp.auto_mixed_precision(half, "mixed_float16", "O2")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a float32 model: nothing to say
        mp.auto_mixed_precision(control, "mixed_float16", "O2")
    runs = []
    for model in (half, control):
        opt = mp.LossScaleOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-2))
        g = torch.Generator().manual_seed(1)
        losses = []
        for _ in range(5):
            x, y = torch.randn(8, 16, generator=g), torch.randn(8, 16, generator=g)
            loss = F.mse_loss(model(x), y)
            opt.backward(loss)
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
        runs.append((losses, model.state_dict(), [m for _, m in opt.master_weights()]))
    (losses_a, state_a, masters_a), (losses_b, state_b, masters_b) = runs
    assert losses_a == losses_b and losses_a[-1] < losses_a[0]
    assert state_a.keys() == state_b.keys()
    assert all(torch.equal(state_a[k], state_b[k]) for k in state_a)
    assert all(torch.equal(a, b) for a, b in zip(masters_a, masters_b, strict=True))


@pytest.mark.parametrize("dtype", [BF16, F16])
def test_o3_takes_a_16_bit_model_as_it_is(dtype):
    model = net().to(dtype)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        mp.auto_mixed_precision(model, "bfloat16", "O3")
    assert set(floating(model).values()) == {BF16}  # O3's storage: the compute dtype


def test_mindspore_o3_upcasts_for_its_float32_masters():
    model = net().to(F16)
    values = {id(p): p.detach().clone() for p in model.parameters()}
    with pytest.warns(UserWarning, match=note(F16, "O3")):
        mp.auto_mixed_precision(model, "mixed_bfloat16", amp_level="O3")
    assert set(floating(model).values()) == {BF16}
    opt = mp.LossScaleOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    pairs = opt.master_weights()
    assert len(pairs) == 10
    assert all(torch.equal(m, values[id(p)].float()) for p, m in pairs)  # float16's values


@pytest.mark.parametrize("dtype", [BF16, F16])
@pytest.mark.float8  # runs float8 matmuls on the CPU
def test_mixed_float8_keeps_float32_weights_in_float8_layers_of_a_16_bit_model(dtype):
    model = net().to(dtype)
    small = mp.Float8Options(min_features=16)
    with pytest.warns(UserWarning, match=note(dtype, "O2")):
        mp.auto_mixed_precision(model, "mixed_float8", float8=small)
    assert [is_float8(model[i]) for i in (0, 3, 5)] == [True, True, False]  # 5: the head
    stored = floating(model)
    assert {stored[f"{i}.{w}"] for i in (0, 3) for w in ("weight", "bias")} == {F32}
    assert stored["5.weight"] == BF16
    assert {stored[n] for n in ("1.weight", "1.running_var", "4.weight")} == {F32}
    out = model(torch.randn(8, 16))
    out.float().sum().backward()
    assert out.dtype == F32 and model[0].weight.grad.dtype == F32


def test_a_refused_call_leaves_the_16_bit_model_as_it_was():
    model = net().to(BF16)
    options = mp.Float8Options(min_features=16, fsdp_float8_all_gather=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no upcast note: nothing was upcast
        with pytest.raises(ValueError, match=r"fsdp_float8_all_gather=True\) needs the tensorwise"):
            mp.auto_mixed_precision(model, "mixed_float8_rowwise", float8=options)
    assert set(floating(model).values()) == {BF16} and mp.levels.applied(model) is None


def test_the_note_counts_what_it_upcast_and_points_at_the_users_line():
    """A model partly in 16 bits; prepared by build_train_step, the warning still names the
    user's line, not mixprec's."""
    model = net()
    model[3].to(BF16)  # one Linear: 2 parameters, no buffers
    with pytest.warns(UserWarning, match=note(BF16, "O2", "2 parameters")) as record:
        mp.build_train_step(model, "adam", "mse", "mixed_bfloat16", "O2")
    assert [w.filename for w in record] == [__file__]
    one = nn.Linear(4, 4, bias=False).to(F16)
    with pytest.warns(UserWarning, match=note(F16, "O1", "1 parameter")):
        mp.auto_mixed_precision(one, "mixed_float16", "O1")


def test_float32_values_a_16_bit_model_was_loaded_from_become_its_masters(tmp_path):
    """load_checkpoint of a float32 checkpoint into a bfloat16 model keeps the float32
    values; the upcast restores them, and the note says so."""
    path = mp.save_checkpoint(tmp_path / "ck.safetensors", net(seed=1))
    model = net().to(BF16)
    mp.load_checkpoint(path, model)
    tail = " (10 restored from the float32 values they were loaded from)"
    expected = note(BF16, "O2").removesuffix("$") + re.escape(tail) + "$"
    with pytest.warns(UserWarning, match=expected):
        mp.auto_mixed_precision(model, "mixed_bfloat16", "O2")
    opt = mp.LossScaleOptimizer(torch.optim.AdamW(model.parameters()))
    original = dict(net(seed=1).named_parameters())
    names = {id(p): n for n, p in model.named_parameters()}
    assert all(torch.equal(m, original[names[id(p)]]) for p, m in opt.master_weights())
    assert torch.equal(model[1].weight, original["1.weight"])  # the norm's float32 values
