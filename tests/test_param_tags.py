"""A prepared model's notes on its parameters (policy, level, compute dtype, O3 masters)
survive what makes new Parameter objects: copy.deepcopy, load_state_dict(assign=True),
torch.save/torch.load of the whole model. Without them the optimizer of a copy would drop
float16 loss scaling, or give O3 weights float32 masters, silently."""

from __future__ import annotations

import copy
import io
import warnings

import pytest
import torch
from torch import nn

import mixprec as mp


def net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))


def scaler_of(model: nn.Module) -> str:
    opt = mp.LossScaleOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    return type(opt.loss_scaler).__name__


def masters_of(model: nn.Module) -> int:
    opt = mp.LossScaleOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    return len(opt.master_weights())


def reloaded(model: nn.Module) -> nn.Module:
    buffer = io.BytesIO()
    torch.save(model, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=False)


def through_a_process_pipe(obj: object) -> object:
    """What ``torch.multiprocessing`` (``spawn`` arguments, a ``Pool``, a ``Queue``) sends:
    its pickler rebuilds each parameter over shared memory, without its ``__dict__``."""
    import pickle
    from multiprocessing.reduction import ForkingPickler

    import torch.multiprocessing  # noqa: F401  (registers torch's reductions)

    return pickle.loads(ForkingPickler.dumps(obj))


@pytest.mark.parametrize(
    "make_copy", [copy.deepcopy, reloaded, through_a_process_pipe],
    ids=["deepcopy", "torch.save", "multiprocessing"],
)  # fmt: skip
def test_a_copy_of_a_float16_model_keeps_its_loss_scaling(make_copy):
    model = mp.auto_mixed_precision(net(), "mixed_float16", "O1")
    twin = make_copy(model)
    assert scaler_of(model) == scaler_of(twin) == "DynamicLossScaler"
    assert twin(torch.randn(2, 4)).dtype == torch.float32  # its region still runs
    island = mp.to_float(net(), torch.float16)
    assert scaler_of(copy.deepcopy(island)) == "DynamicLossScaler"


def test_a_model_and_optimizer_sent_to_another_process_train_as_in_this_one():
    """Sent with its optimizer before the first backward, an O3 float16 model was refused
    in the child ("built before the model was prepared"); a plain optimizer over an O2
    model there was not told it steps 16-bit weights without masters."""
    model = mp.auto_mixed_precision(net(), "mixed_float16", "O3")
    opt = mp.LossScaleOptimizer(mp.CompensatedAdamW(model.parameters(), lr=1e-3))
    child, child_opt = through_a_process_pipe((model, opt))  # type: ignore[misc]
    child_opt.backward(child(torch.randn(2, 4)).float().mean())
    assert child_opt.step().applied
    o2 = through_a_process_pipe(mp.auto_mixed_precision(net(), "mixed_bfloat16", "O2"))
    plain = torch.optim.SGD(o2.parameters(), lr=0.1)  # type: ignore[attr-defined]
    o2(torch.randn(2, 4)).float().sum().backward()  # type: ignore[operator]
    with pytest.warns(UserWarning, match="no float32 master"):
        plain.step()


def _first_master(model: nn.Module) -> torch.Tensor:
    opt = mp.LossScaleOptimizer(torch.optim.SGD(model.parameters(), 0.1))
    return next(iter(opt.master_params()))


def test_a_deep_copy_of_an_o2_model_keeps_the_float32_values_its_weights_stand_for(tmp_path):
    """``best = copy.deepcopy(model)``: ``Parameter.__deepcopy__`` dropped the kept float32
    values, and the live masters are the original's, so the copy's export and a new
    optimizer over it started from the bfloat16 roundings, unsaid (torch.save kept them)."""
    from safetensors.torch import load_file

    init = net()[0].weight.detach().clone()
    model = mp.auto_mixed_precision(net(), "mixed_bfloat16", "O2")
    assert torch.equal(_first_master(copy.deepcopy(model)), init)  # before training
    opt = mp.LossScaleOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-2))
    for _ in range(5):
        opt.zero_grad()
        opt.backward(model(torch.randn(8, 4)).square().mean())
        opt.step()
    master = opt.master_weights()[0][1].detach().clone()
    assert not torch.equal(master.to(torch.bfloat16).float(), master)  # digits to lose
    best = copy.deepcopy(model)
    mp.export_weights(best, tmp_path / "best.safetensors", "float32")
    assert torch.equal(load_file(tmp_path / "best.safetensors")["0.weight"], master)
    assert torch.equal(_first_master(best), master)
    # Copied with its optimizer, in either order: the copy's masters hold the values, and
    # no second float32 copy stays on its weights.
    from mixprec._float32_copies import FP32_COPY_ATTR

    for model_first in (True, False):
        twin, twin_opt = copy.deepcopy((model, opt))
        if not model_first:
            twin_opt, twin = copy.deepcopy((opt, model))
        assert torch.equal(twin_opt.master_weights()[0][1], master)
        assert not any(FP32_COPY_ATTR in p.__dict__ for p in twin.parameters())


def test_a_copy_of_an_o3_model_gets_no_masters():
    model = mp.auto_mixed_precision(net(), "bfloat16", "O3")
    assert masters_of(model) == masters_of(copy.deepcopy(model)) == 0


def test_parameters_loaded_with_assign_keep_the_notes():
    model = mp.auto_mixed_precision(net(), "mixed_float16", "O1")
    state = {k: v.clone() for k, v in model.state_dict().items()}
    model.load_state_dict(state, assign=True)
    assert scaler_of(model) == "DynamicLossScaler"


def test_a_copy_traces_its_own_overflows():
    model = copy.deepcopy(mp.auto_mixed_precision(net(), "mixed_float16", "O2"))
    opt = mp.LossScaleOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), trace_overflow=True)
    opt.zero_grad()
    opt.backward(model(torch.full((2, 4), float("inf"))).float().sum())
    result = opt.step()
    assert not result.applied and result.overflow is not None
    assert "0" in str(result.overflow)  # the first Linear, by its name in the copy


def test_a_load_that_replaces_o2_weights_held_by_an_optimizer_says_so():
    # assign=True made float32 parameters in place of the O2 bfloat16 ones, and the optimizer
    # built before kept stepping the old ones: the model never moved, with no word but a
    # "did zero_grad() run" hint.
    float32_state = {k: v.clone() for k, v in net().state_dict().items()}
    model = mp.auto_mixed_precision(net(), "mixed_bfloat16", "O2")
    opt = mp.LossScaleOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    with pytest.warns(UserWarning) as got:
        model.load_state_dict(float32_state, assign=True)
    said = [str(w.message) for w in got if "assign=True" in str(w.message)]
    assert len(said) == 1, said
    assert "replaced 4 parameters of a model prepared by mixprec, and 4 changed dtype " in said[0]
    assert "('0.weight': bfloat16 -> float32)" in said[0]
    assert got[0].filename == __file__  # at the user's load line
    assert len(opt.master_weights()) == 4  # still the old ones: the warning is the news


def test_a_load_into_the_weights_or_of_their_own_dtype_is_quiet(recwarn):
    model = mp.auto_mixed_precision(net(), "mixed_bfloat16", "O2")
    model.load_state_dict({k: v.clone() for k, v in net().state_dict().items()})  # copies in
    # Its own 16-bit values, assigned while a forward's graph still holds the old ones (a
    # trials loop that resets the model): nothing changes dtype, nothing to say.
    out = model(torch.randn(2, 4))
    model.load_state_dict({k: v.clone() for k, v in model.state_dict().items()}, assign=True)
    assert out.requires_grad
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())
    # Prepared on the meta device, then given its bfloat16 values: nothing held, no change.
    with torch.device("meta"):
        empty = net()
    empty = mp.auto_mixed_precision(empty, "mixed_bfloat16", "O2")
    state = {k: v.to(torch.bfloat16) for k, v in net().state_dict().items()}
    empty.load_state_dict(state, assign=True)
    assert empty[0].weight.device.type == "cpu" and empty[0].weight.dtype == torch.bfloat16
    assert not [w for w in recwarn if "assign=True" in str(w.message)]


class _Adapter(nn.Module):
    """A LoRA-style adapter around a prepared Linear, added after preparation."""

    def __init__(self, base: nn.Linear, rank: int = 2) -> None:
        super().__init__()
        self.base = base
        self.down = nn.Linear(base.in_features, rank, bias=False)
        self.up = nn.Linear(rank, base.out_features, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base(x) + self.up(self.down(x))


def test_parameters_added_after_preparation_join_the_models_policy():
    """An optimizer over adapters added to a float16 model took them for a float32 model's
    parameters: no loss scaling, and 98.8% of an adapter's gradients were 0 (unsaid)."""
    model = mp.auto_mixed_precision(net(), "mixed_float16", "O2")
    for p in model.parameters():
        p.requires_grad_(False)
    model[0] = _Adapter(model[0])
    adapters = [model[0].down.weight, model[0].up.weight]
    assert scaler_of_params(adapters) == "DynamicLossScaler"
    # Their notes are the model's now, and its copies keep them.
    assert all(getattr(p, "_mixprec_level", None) == "O2" for p in adapters)
    twin = copy.deepcopy(model)
    assert scaler_of_params([twin[0].down.weight]) == "DynamicLossScaler"
    # At O3 they join before masters are decided: none for a 16-bit head, as for the rest.
    o3 = mp.auto_mixed_precision(net(), "bfloat16", "O3")
    o3.append(nn.Linear(2, 2).to(torch.bfloat16))
    assert masters_of(o3) == 0
    # A plain float32 model's parameters stay untagged.
    assert scaler_of_params(list(net().parameters())) == "NoOpLossScaler"


def scaler_of_params(params: list[torch.Tensor]) -> str:
    opt = mp.LossScaleOptimizer(torch.optim.SGD(params, lr=0.1))
    return type(opt.loss_scaler).__name__


def test_a_whole_model_from_torch_load_is_known_as_prepared():
    """After ``torch.load`` of a whole float16 model, a new head was found in no prepared
    model: no loss scaling, and 97.6% of its gradients were 0, unsaid. And O2's kept
    float32 values looked stale (rebuilding a parameter bumps its version), so masters
    started 2.4e-4 off them."""
    original = net()
    model = reloaded(mp.auto_mixed_precision(copy.deepcopy(original), "mixed_float16", "O2"))
    for p in model.parameters():
        p.requires_grad_(False)
    model[2] = nn.Linear(8, 2)
    assert scaler_of_params(list(model[2].parameters())) == "DynamicLossScaler"
    bf16 = reloaded(mp.auto_mixed_precision(copy.deepcopy(original), "mixed_bfloat16", "O2"))
    opt = mp.LossScaleOptimizer(torch.optim.SGD(bf16.parameters(), lr=0.1))
    masters = [m for _, m in opt.master_weights()]
    assert all(torch.equal(m, p) for m, p in zip(masters, original.parameters(), strict=True))


def test_a_pickled_optimizer_keeps_its_guards():
    """``pickle`` of model and optimizer together: the wrapped optimizer's own ``step()``
    was accepted again (it moved nothing), and its ``zero_grad()`` reached the masters
    alone."""
    import pickle

    model = mp.auto_mixed_precision(net(), "mixed_bfloat16", "O2")
    inner = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = pickle.loads(pickle.dumps((model, mp.LossScaleOptimizer(inner))))
    opt.backward(model(torch.randn(4, 4)).float().sum())
    with pytest.raises(mp.MisuseError, match=r"SGD.step\(\) was called on the optimizer"):
        opt.optimizer.step()
    opt.optimizer.zero_grad()
    assert all(p.grad is None for p in model.parameters())
    copied = copy.deepcopy(opt)  # a copy of the optimizer alone keeps its own guard too
    with pytest.raises(mp.MisuseError, match=r"SGD.step\(\) was called on the optimizer"):
        copied.optimizer.step()


@pytest.mark.parametrize("level", ["O1", "O2", "O3"])
def test_a_model_prepared_on_the_meta_device_keeps_its_notes_through_to_empty(level):
    """Prepared on the meta device, then ``to_empty()`` and an init: new parameters
    without the policy, so the optimizer chose no loss scaling for a float16 model (the
    first layer's gradients all 0, its weights unmoved), unsaid. It trains as the same
    model made on the CPU does."""
    x = torch.randn(256, 32, generator=torch.Generator().manual_seed(1))
    y = 1e-3 * torch.randn(256, 1, generator=torch.Generator().manual_seed(2))

    def build() -> nn.Module:
        return nn.Sequential(nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 1))

    def trained(meta: bool) -> tuple[torch.Tensor, mp.LossScaleOptimizer]:
        with torch.device("meta" if meta else "cpu"):
            model = build()
        model = mp.auto_mixed_precision(model, "mixed_float16", level)
        if meta:
            model.to_empty(device="cpu")
        torch.manual_seed(0)
        for module in model.modules():
            if isinstance(module, nn.Linear):
                module.reset_parameters()
        with torch.no_grad():
            model[2].weight.mul_(0.01)
        opt = mp.LossScaleOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))
        for _ in range(5):
            opt.zero_grad()
            opt.backward(nn.functional.mse_loss(model(x).float(), y))
            opt.step()
        return model[0].weight.detach().float(), opt

    on_cpu, _ = trained(False)
    with warnings.catch_warnings():  # at O3 its own weights were taken for a copy's
        warnings.simplefilter("error")
        from_meta, opt = trained(True)
    assert isinstance(opt.loss_scaler, mp.DynamicLossScaler)
    assert torch.equal(from_meta, on_cpu)


def test_a_keeper_whose_module_is_not_whole_yet_waits_for_the_next_call():
    """torch.load of a whole model in another thread, half way: a keeper was taken
    before its module's state was set, raised AttributeError '_parameters' in an
    unrelated optimizer's step, and its registration was lost."""
    import pickle

    from mixprec import _param_tags

    model = mp.auto_mixed_precision(nn.Sequential(nn.Linear(2, 2)), "mixed_float16", "O1")
    keeper = _param_tags.keeper_of(model)
    half_built = nn.Module.__new__(nn.Module)  # as the unpickler holds it before __setstate__
    state = dict(keeper.__dict__, module=half_built)
    waiting = _param_tags.TagKeeper.__new__(_param_tags.TagKeeper)
    waiting.__setstate__(state)
    _param_tags.unpickled_keepers()  # raised AttributeError
    assert any(ref() is waiting for ref in _param_tags._UNPICKLED)
    loaded = pickle.loads(pickle.dumps(model))
    half_built.__setstate__(dict(loaded.__dict__))  # now whole
    _param_tags.unpickled_keepers()
    assert not any(ref() is waiting for ref in _param_tags._UNPICKLED)
