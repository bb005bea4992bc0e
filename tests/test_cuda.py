"""The CUDA paths, on a real GPU (skipped without one): the default step reads nothing on the
host, a NaN gradient reaches no weight and no optimizer state, float16 dynamic scaling
matches ``torch.amp.GradScaler``, the Trainer trains as float32 does, a checkpoint round-trips
bit for bit, and a prepared model compiles whole-graph. What the CPU tests check with
``deferred.ON_HOST`` these check where the device path is the default."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import mixprec as mp
from mixprec.optim.step_result import DeviceFlag
from tests.conftest import classification_data, make_mlp
from tests.optim._helpers import same_state

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (none here)"),
]

_OPTIMIZERS = {
    "adamw": lambda ps: torch.optim.AdamW(ps, lr=1e-2),
    "sgd-momentum": lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9),
    "sgd-plain": lambda ps: torch.optim.SGD(ps, lr=0.05),  # fused on CUDA, so no sync
}


def _data(n: int = 64) -> tuple[torch.Tensor, torch.Tensor]:
    x, y = classification_data(n=n)
    return x.cuda(), y.cuda()


def _loss(model: nn.Module, data: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    x, y = data
    return nn.functional.cross_entropy(model(x), y)


def _state(model: nn.Module, opt: mp.LossScaleOptimizer) -> tuple:
    return (
        [p.detach().clone() for p in model.parameters()],
        [m.detach().clone() for m in opt.master_params()],
        copy.deepcopy([o.state_dict()["state"] for o in opt.optimizers]),
    )


def _prepared(name: str, policy: str = "mixed_bfloat16", level: str = "O2"):
    torch.manual_seed(0)
    model = mp.auto_mixed_precision(make_mlp().cuda(), policy, level)
    opt = mp.LossScaleOptimizer(_OPTIMIZERS[name](model.parameters()))
    return model, opt


@pytest.mark.parametrize("level", ["O2", "O3"])
@pytest.mark.parametrize("name", list(_OPTIMIZERS))
def test_the_default_bf16_step_reads_nothing_on_the_host(name, level):
    model, opt = _prepared(name, level=level)
    data = _data()
    for _ in range(3):  # the optimizer's own first step builds its state
        opt.zero_grad()
        opt.backward(_loss(model, data))
        opt.step()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")  # any device-to-host read raises
    try:
        for _ in range(3):
            opt.zero_grad()
            opt.backward(_loss(model, data))
            result = opt.step()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert isinstance(result.found_inf, DeviceFlag)  # decided on the device, read when asked
    assert result.applied and opt.loss_scaler.state.steps == 6


@pytest.mark.parametrize("name", list(_OPTIMIZERS))
def test_a_nan_gradient_reaches_no_weight_and_no_optimizer_state(name):
    model, opt = _prepared(name)
    data = _data()
    for _ in range(3):
        opt.zero_grad()
        opt.backward(_loss(model, data))
        opt.step()
    opt.zero_grad()
    opt.backward(_loss(model, data))
    next(model.parameters()).grad.view(-1)[0] = float("nan")
    before = _state(model, opt)
    result = opt.step()
    assert same_state(_state(model, opt), before)  # tolerance 0
    assert result.skipped and bool(result.found_inf)
    assert opt.loss_scaler.state.skipped_steps == 1
    opt.zero_grad()
    opt.backward(_loss(model, data))
    assert opt.step().applied  # and the next step trains again
    assert not same_state(_state(model, opt), before)


def test_an_o3_model_with_bfloat16_gradients_skips_a_nan_step():
    # CUDA's amp unscale kernel refuses bfloat16 gradients; the check falls back to two
    # multi-tensor kernels (``finite._check_and_unscale``).
    model, opt = _prepared("adamw", level="O3")
    assert next(model.parameters()).dtype == torch.bfloat16
    data = _data()
    opt.zero_grad()
    opt.backward(_loss(model, data))
    assert opt.step().applied
    opt.zero_grad()
    opt.backward(_loss(model, data))
    next(model.parameters()).grad.view(-1)[0] = float("nan")
    before = _state(model, opt)
    assert opt.step().skipped
    assert same_state(_state(model, opt), before)


@pytest.mark.parametrize("name", ["adamw", "sgd-momentum"])
def test_o3_bfloat16_parameters_step_fused_and_train_as_the_unfused_kernel(name):
    """O3's bfloat16 parameters run torch's fused kernel on CUDA (on CPU it is left out for
    pytorch/pytorch#191763). Against a float32 run of 8 steps, the fused kernel's weights
    stay at most 1.5x as far (mean absolute difference) as the foreach kernel's, and its
    loss at most 2e-2 further from float32's. Single elements are not compared: the kernels
    round the same update differently (fused in float32, foreach op by op in bfloat16), and
    Adam's sign-like step moves an element with a tiny gradient by up to lr either way."""
    data = _data()

    def run(level: str, foreach: bool | None) -> tuple[list[torch.Tensor], float]:
        torch.manual_seed(0)
        model = mp.auto_mixed_precision(make_mlp().cuda(), "mixed_bfloat16", level)
        inner = _OPTIMIZERS[name](model.parameters())
        inner.param_groups[0]["foreach"] = foreach  # set: mixprec leaves the kernel alone
        opt = mp.LossScaleOptimizer(inner)
        for _ in range(8):
            opt.zero_grad()
            opt.backward(_loss(model, data))
            opt.step()
        if level == "O3":
            assert inner.param_groups[0]["fused"] is (True if foreach is None else None)
        with torch.no_grad():
            return [p.detach().float() for p in model.parameters()], _loss(model, data).item()

    control, control_loss = run("O0", None)
    (fused, fused_loss), (unfused, unfused_loss) = run("O3", None), run("O3", True)

    def distance(weights: list[torch.Tensor]) -> float:
        return sum((w - c).abs().mean().item() for w, c in zip(weights, control, strict=True))

    assert 0 < distance(fused) <= 1.5 * distance(unfused)
    assert abs(fused_loss - control_loss) <= abs(unfused_loss - control_loss) + 2e-2


def test_the_device_path_trains_bit_for_bit_as_the_host_step(monkeypatch):
    from mixprec.optim import loss_scale_optimizer

    def run(device_path: bool):
        model, opt = _prepared("adamw")
        if not device_path:  # where the step asks, not where on_device is defined
            monkeypatch.setattr(loss_scale_optimizer, "on_device", lambda opt: False)
        data = _data()
        kinds = []
        for i in range(6):
            opt.zero_grad()
            opt.backward(_loss(model, data))
            if i == 3:
                next(model.parameters()).grad.view(-1)[0] = float("inf")
            kinds.append(type(opt.step().found_inf))
        monkeypatch.undo()
        return _state(model, opt), opt.loss_scaler.state, kinds

    (state, counters, kinds), (host_state, host_counters, host_kinds) = run(True), run(False)
    # The first step is torch's own (it builds the state); then the device's, or the host's.
    assert kinds == [bool] + [DeviceFlag] * 5 and host_kinds == [bool] * 6
    assert same_state(state, host_state)
    assert counters == host_counters and counters.skipped_steps == 1


def test_float16_dynamic_scaling_matches_torch_grad_scaler():
    """O1 float16 with mixprec's dynamic scaler against autocast + torch.amp.GradScaler with
    the same settings: the same scales and the same skipped steps. The weights differ by
    float16 rounding, since mixprec keeps layer norm and the loss in float32 where autocast
    leaves them to its op lists: within 5e-3 after 12 steps (3.1e-4 seen on CPU)."""
    data = _data()

    def run(ours: bool):
        torch.manual_seed(0)
        model = make_mlp().cuda()
        inner = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
        scales, applied = [], []
        if ours:
            model = mp.auto_mixed_precision(model, "mixed_float16", "O1")
            opt = mp.LossScaleOptimizer(
                inner, mp.DynamicLossScaler(init_scale=2.0**16, growth_interval=4)
            )
        else:
            scaler = torch.amp.GradScaler("cuda", init_scale=2.0**16, growth_interval=4)
        for i in range(12):
            inner.zero_grad()
            if ours:
                loss = _loss(model, data)
                opt.backward(loss)
            else:
                with torch.autocast("cuda", dtype=torch.float16):
                    loss = _loss(model, data)
                scaler.scale(loss).backward()
            if i in (2, 7):
                next(model.parameters()).grad.view(-1)[0] = float("inf")
            if ours:
                applied.append(bool(opt.step().applied))
                scales.append(opt.loss_scaler.get_scale())
            else:
                before = scaler.get_scale()
                scaler.step(inner)
                scaler.update()
                applied.append(scaler.get_scale() >= before)
                scales.append(scaler.get_scale())
        return [p.detach().float() for p in model.parameters()], scales, applied

    ours, theirs = run(True), run(False)
    assert ours[1] == theirs[1]
    assert ours[2] == theirs[2] and ours[2].count(False) == 2
    for a, b in zip(ours[0], theirs[0], strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=5e-3)


def test_the_trainer_trains_on_cuda_as_float32_does():
    """bf16 O2 against a float32 control on the same data and seed: final loss within 0.05
    and accuracy within 0.05 (bfloat16's 8-bit mantissa over 5 epochs of a small MLP)."""
    x, y = classification_data(n=512)
    results = {}
    for policy in ("float32", "mixed_bfloat16"):
        torch.manual_seed(0)
        model = make_mlp()
        trainer = mp.Trainer(
            model,
            "cross_entropy",
            torch.optim.AdamW(model.parameters(), 1e-2),
            policy=policy,
            device="cuda",
        )
        assert next(trainer.model.parameters()).is_cuda
        trainer.fit(x, y, batch_size=64, epochs=5, verbose=0)
        results[policy] = trainer.evaluate(x, y)
    assert abs(results["mixed_bfloat16"]["loss"] - results["float32"]["loss"]) < 0.05
    assert abs(results["mixed_bfloat16"]["accuracy"] - results["float32"]["accuracy"]) < 0.05
    assert results["float32"]["accuracy"] > 0.5  # it learned


def test_a_checkpoint_saved_on_cuda_loads_bit_for_bit(tmp_path):
    model, opt = _prepared("adamw")
    data = _data()
    for _ in range(3):
        opt.zero_grad()
        opt.backward(_loss(model, data))
        opt.step()
    path = mp.save_checkpoint(tmp_path / "ckpt.safetensors", model, opt)
    model2, opt2 = _prepared("adamw")
    mp.load_checkpoint(path, model2, opt2)
    assert same_state(_state(model2, opt2), _state(model, opt))
    assert next(model2.parameters()).is_cuda and next(opt2.master_params()).is_cuda
    for o, m in ((opt, model), (opt2, model2)):
        o.zero_grad()
        o.backward(_loss(m, data))
        o.step()
    assert same_state(_state(model2, opt2), _state(model, opt))


@pytest.mark.parametrize("policy", ["mixed_bfloat16", "mixed_float16"])
def test_a_prepared_model_compiles_whole_graph_on_cuda(policy):
    torch.manual_seed(0)
    model = mp.auto_mixed_precision(make_mlp().cuda(), policy, "O2")
    eager = copy.deepcopy(model)
    compiled = torch.compile(model, fullgraph=True)
    x, _ = _data()
    out = compiled(x)
    assert out.dtype == torch.float32
    torch.testing.assert_close(out, eager(x), rtol=2e-2, atol=2e-2)  # 16-bit rounding
    out.sum().backward()
    assert all(p.grad is not None for p in model.parameters())


@pytest.mark.parametrize("where", ["gpu", "cpu"])
def test_the_trainers_batches_are_its_samples_and_need_no_stall(where, monkeypatch):
    """Data on the GPU is gathered with the order copied there once an epoch; CPU data for
    a CUDA device through pinned buffers used in turn. Both give exactly ``x[order]``, the
    last short batch included, and an earlier batch is not overwritten by a later one."""
    from mixprec.train import batches
    from mixprec.train.batches import epoch_batches

    monkeypatch.setattr(batches, "STAGED_BYTES", 0)  # these batches are small

    x, y = classification_data(n=70)
    data = (x.cuda(), y.cuda()) if where == "gpu" else (x, y)
    make, steps, n = epoch_batches(*data, 16, True, device=torch.device("cuda"))
    assert (steps, n) == (5, 70)
    for seed in (0, 1):  # two epochs: the buffers are reused
        torch.manual_seed(seed)
        order = torch.randperm(70)
        torch.manual_seed(seed)
        torch.cuda.set_sync_debug_mode("error")  # a stall raises
        try:
            got = list(make())
        finally:
            torch.cuda.set_sync_debug_mode("default")
        assert [len(b[1]) for b in got] == [16, 16, 16, 16, 6]
        for (xb, yb), idx in zip(got, order.split(16), strict=True):
            assert xb.is_cuda and yb.is_cuda
            assert torch.equal(xb.cpu(), x[idx]) and torch.equal(yb.cpu(), y[idx])
