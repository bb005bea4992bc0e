"""MixprecFabricPrecision: mixprec's numerics inside Lightning Fabric, against float32 runs
of the same loop, and the inputs Fabric hands the model, against Fabric's own plugins."""

from __future__ import annotations

import linecache
import warnings
from typing import Any

import pytest

L = pytest.importorskip("lightning")

import torch  # noqa: E402
from lightning.fabric import Fabric  # noqa: E402
from lightning.fabric.plugins.precision import MixedPrecision  # noqa: E402
from torch import nn  # noqa: E402

import mixprec as mp  # noqa: E402
from mixprec._errors import MisuseError  # noqa: E402
from mixprec.integrations.lightning import MixprecFabricPrecision  # noqa: E402
from tests.integrations.test_lightning_plugin import _data, _mlp, _scaler  # noqa: E402


def _fabric_run(
    plugin: MixprecFabricPrecision | None,
    steps: int,
    seed: int = 0,
    load: Any = None,
    save: Any = None,
    start: int = 0,
) -> tuple[list[float], nn.Module, Any]:
    fabric = Fabric(accelerator="cpu", devices=1, plugins=[plugin] if plugin else None)
    model = _mlp(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, opt = fabric.setup(model, opt)
    state = {"model": model, "optimizer": opt, **({"mixprec": plugin} if plugin else {})}
    if load is not None:
        fabric.load(load, state)
    batches = list(_data()) * 4
    losses = []
    for x, y in batches[start : start + steps]:
        opt.zero_grad()
        loss = nn.functional.cross_entropy(model(x), y)
        fabric.backward(loss)
        fabric.clip_gradients(model, opt, max_norm=1.0, error_if_nonfinite=False)
        opt.step()
        losses.append(loss.item())
    if save is not None:
        fabric.save(save, state)
    return losses, model, opt  # the optimizer keeps its wrapper alive (the plugin: weakly)


@pytest.mark.parametrize("policy", ["mixed_bfloat16", "mixed_float16"])
def test_fabric_o2_tracks_float32(policy: str) -> None:
    reference, *_ = _fabric_run(None, steps=24)
    plugin = MixprecFabricPrecision(policy, level="O2")
    losses, model, _ = _fabric_run(plugin, steps=24)
    # The Trainer's model, data and steps, with clipping: measured max |loss difference|
    # 0.0011 (bfloat16) and 0.00042 (float16), the Trainer's figures to the last bit.
    tolerance = 0.005 if policy == "mixed_bfloat16" else 0.002
    gap = max(abs(a - b) for a, b in zip(losses, reference, strict=True))
    assert 0 < gap < tolerance
    assert losses[-1] < 0.8 * losses[0]  # measured 0.57
    assert {p.dtype for p in model.parameters()} == {plugin.policy.compute_dtype}
    (lso,) = plugin.optimizers
    assert all(p.dtype == torch.float32 for p in lso.master_params())
    # Released after each step: the user's zero_grad only reaches the masters.
    assert all(p.grad is None for p in model.parameters())
    assert plugin.last_step is not None and plugin.last_step.applied


def test_fabric_checkpoint_with_the_plugin_resumes_bitwise(tmp_path: Any) -> None:
    whole_plugin = MixprecFabricPrecision("mixed_float16", level="O2", loss_scaler=_scaler())
    whole, whole_model, _whole_opt = _fabric_run(whole_plugin, steps=12)
    path = tmp_path / "fabric.ckpt"
    first_plugin = MixprecFabricPrecision("mixed_float16", level="O2", loss_scaler=_scaler())
    _fabric_run(first_plugin, steps=6, save=path)
    assert first_plugin.loss_scaler.get_scale() != 2.0**10  # so restoring it is tested
    # Loaded before Fabric shows the plugin the optimizer: the masters wait for it.
    plugin = MixprecFabricPrecision("mixed_float16", level="O2", loss_scaler=_scaler())
    rest, model, _opt = _fabric_run(plugin, steps=6, seed=7, load=path, start=6)
    assert rest == whole[6:]
    assert all(
        torch.equal(a, b) for a, b in zip(model.parameters(), whole_model.parameters(), strict=True)
    )
    (lso,), (whole_lso,) = plugin.optimizers, whole_plugin.optimizers
    for (_, a), (_, b) in zip(lso.master_weights(), whole_lso.master_weights(), strict=True):
        assert torch.equal(a, b)
    assert plugin.loss_scaler.state == whole_plugin.loss_scaler.state


# -- inputs: Fabric's convert_input contract ----------------------------------------------------


class _Recorder(nn.Module):
    """An MLP that records the dtype it is called with (a forward pre-hook: what Fabric hands
    the module) and the dtype its own ``forward`` sees (after mixprec's region)."""

    def __init__(self) -> None:
        super().__init__()
        self.net = _mlp(0)
        self.called_with: list[torch.dtype] = []
        self.forward_saw: list[torch.dtype] = []
        self.returned: list[torch.dtype] = []  # what model(...) returned through Fabric
        self.register_forward_pre_hook(lambda _, args: self.called_with.append(args[0].dtype))

    def forward(self, x: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        self.forward_saw.append(x.dtype)
        assert labels.dtype == torch.int64  # integer inputs are never cast
        return self.net(x)


def _fabric_inputs(plugin: Any = None, precision: str | None = None) -> _Recorder:
    """Two steps of a Fabric loop fed float32 batches; the module's record."""
    fabric = Fabric(accelerator="cpu", devices=1, precision=precision, plugins=plugin)
    module = _Recorder()
    model, opt = fabric.setup(module, torch.optim.SGD(module.parameters(), lr=0.1))
    for x, y in list(_data())[:2]:
        assert x.dtype == torch.float32
        opt.zero_grad()
        out = model(x, labels=y)
        module.returned.append(out.dtype)
        fabric.backward(nn.functional.cross_entropy(out, y))
        opt.step()
    return module


@pytest.mark.parametrize(
    ("policy", "level", "native"),
    [
        ("mixed_bfloat16", "O2", {"precision": "bf16-mixed"}),
        ("mixed_float16", "O2", {"plugin": "16-mixed"}),
        ("bfloat16", "O3", {"precision": "bf16-true"}),
    ],
)
def test_fabric_casts_floating_inputs_as_its_own_plugins_do(
    policy: str, level: str, native: dict[str, str]
) -> None:
    if "plugin" in native:  # Fabric turns precision="16-mixed" into bf16 on a CPU
        reference = _fabric_inputs(plugin=MixedPrecision(native["plugin"], device="cpu"))
    else:
        reference = _fabric_inputs(precision=native["precision"])
    plugin = MixprecFabricPrecision(policy, level=level)
    module = _fabric_inputs(plugin=plugin)
    compute = plugin.policy.compute_dtype
    assert reference.called_with == reference.forward_saw == [compute] * 2
    assert module.called_with == module.forward_saw == [compute] * 2
    # Outputs: Fabric's plugins return torch's default dtype; mixprec the policy's output
    # dtype, float32 for the mixed policies, bfloat16 for the pure bfloat16 one.
    assert reference.returned == [torch.float32] * 2
    output = torch.bfloat16 if policy == "bfloat16" else torch.float32
    assert module.returned == [plugin.policy.output_dtype] * 2 == [output] * 2


def test_fabric_convert_input_casts_floating_tensors_in_any_collection() -> None:
    plugin = MixprecFabricPrecision("mixed_bfloat16", level="O2")
    assert plugin.convert_input(torch.ones(2)).dtype == torch.float32  # no model prepared yet
    plugin.convert_module(_mlp(0))
    ids = torch.arange(3)
    args, kwargs = plugin.convert_input(((torch.ones(2), ids), {"mask": torch.ones(2) > 0}))
    assert args[0].dtype == torch.bfloat16 and args[1] is ids
    assert kwargs["mask"].dtype == torch.bool


class _Wide(nn.Module):
    """Inputs beyond float16's range (65504) through a first layer that scales them down:
    kept in float32, it must see them as they are."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.first = nn.Linear(16, 32)
        with torch.no_grad():
            self.first.weight.mul_(1e-4)
        self.rest = nn.Sequential(nn.ReLU(), nn.Linear(32, 4))
        self.called_with: list[torch.dtype] = []
        self.first.register_forward_pre_hook(lambda _, a: self.called_with.append(a[0].dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.rest(self.first(x))


def test_fabric_o1_passes_inputs_as_given_so_float32_layers_see_them_unrounded() -> None:
    x = torch.randn(8, 16, generator=torch.Generator().manual_seed(0)) * 1e5
    assert x.abs().max() > torch.finfo(torch.float16).max

    def forward(plugin: Any, model: nn.Module) -> torch.Tensor:
        fabric = Fabric(accelerator="cpu", devices=1, plugins=plugin)
        return fabric.setup(model)(x)

    # Fabric's 16-mixed casts the batch to float16 first: inf before the first layer.
    native = _Wide()
    assert not forward(MixedPrecision("16-mixed", device="cpu"), native).isfinite().all()
    assert native.called_with == [torch.float16]
    # mixprec at O1: autocast decides per op, and the float32 first layer gets x as it is.
    module = _Wide()
    plugin = MixprecFabricPrecision("mixed_float16", level="O1", keep_float32=["first"])
    out = forward(plugin, module)
    assert module.called_with == [torch.float32]
    assert out.isfinite().all()
    assert module.rest[1].weight.dtype == torch.float32  # O1: float32 weights, autocast math
    # The Fabric argument cast follows the model: at O1 none, at O0 none (Fabric's 32-true).
    assert plugin.convert_input(x) is x
    o0 = MixprecFabricPrecision("mixed_bfloat16", level="O0")
    o0.convert_module(_mlp(0))
    assert o0.convert_input(x) is x


def test_fabric_model_kept_in_float32_gets_float32_inputs() -> None:
    # keep_float32 naming the model's own type keeps all of it: its region casts to float32.
    plugin = MixprecFabricPrecision("mixed_bfloat16", level="O2", keep_float32=[_Recorder])
    module = _fabric_inputs(plugin=plugin)
    assert module.called_with == module.forward_saw == [torch.float32] * 2


# -- checkpoints that lose the masters, and one optimizer set up twice ----------------------


def _one_step(plugin: MixprecFabricPrecision) -> tuple[Fabric, nn.Module, Any]:
    fabric = Fabric(accelerator="cpu", devices=1, plugins=[plugin])
    model = _mlp(0)
    model, opt = fabric.setup(model, torch.optim.AdamW(model.parameters(), lr=1e-2))
    x, y = next(iter(_data()))
    fabric.backward(nn.functional.cross_entropy(model(x), y))
    opt.step()
    return fabric, model, opt


def _saving(fabric: Fabric, path: Any, state: dict[str, Any]) -> list[tuple[str, str]]:
    """The warnings of ``fabric.save(path, state)``: (the line they point at, message)."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fabric.save(path, state)
    return [(linecache.getline(w.filename, w.lineno).strip(), str(w.message)) for w in caught]


def test_fabric_save_without_the_plugin_warns_once_what_it_loses(tmp_path: Any) -> None:
    plugin = MixprecFabricPrecision("mixed_float16", level="O2", loss_scaler=_scaler())
    fabric, model, opt = _one_step(plugin)
    ((line, warning),) = _saving(fabric, tmp_path / "a.ckpt", {"model": model, "optimizer": opt})
    assert line == "fabric.save(path, state)"  # the user's call
    assert warning.startswith("fabric.save() saves this mixprec model ")
    assert "without the float32 master weights and the loss scale, which " in warning
    assert 'MixprecFabricPrecision holds: add the plugin to the state, state["mixprec"]' in warning
    # Once per model: a training loop that saves every epoch is not flooded.
    assert _saving(fabric, tmp_path / "b.ckpt", {"model": model, "optimizer": opt}) == []


@pytest.mark.parametrize(
    ("policy", "level", "with_plugin"),
    [("mixed_float16", "O2", True), ("mixed_bfloat16", "O1", False)],
    ids=["plugin-in-the-state", "nothing-to-lose"],
)
def test_fabric_save_that_keeps_everything_does_not_warn(
    tmp_path: Any, policy: str, level: str, with_plugin: bool
) -> None:
    # O1 with bfloat16: no masters, no dynamic scale, so a state without the plugin loses
    # nothing.
    plugin = MixprecFabricPrecision(policy, level=level)
    fabric, model, opt = _one_step(plugin)
    state = {"model": model, "optimizer": opt, **({"mixprec": plugin} if with_plugin else {})}
    assert _saving(fabric, tmp_path / "a.ckpt", state) == []
    model.state_dict()  # outside a save: never a warning
    assert fabric.load(tmp_path / "a.ckpt", state) == {}


@pytest.mark.parametrize("clip", [False, True])
def test_fabric_same_optimizer_set_up_twice_is_named(clip: bool) -> None:
    """``fabric.setup(model, opt, opt)``: two wrappers of one optimizer; stepping (or clipping)
    both after one ``fabric.backward`` finds the gradients used by the first step."""
    plugin = MixprecFabricPrecision("mixed_bfloat16", level="O2")
    fabric = Fabric(accelerator="cpu", devices=1, plugins=[plugin])
    raw = _mlp(0)
    opt = torch.optim.AdamW(raw.parameters(), lr=1e-2)
    model, first, second = fabric.setup(raw, opt, opt)
    x, y = next(iter(_data()))

    def step(wrapper: Any) -> Any:
        if clip:
            fabric.clip_gradients(model, wrapper, max_norm=1.0)
        return wrapper.step()

    fabric.backward(nn.functional.cross_entropy(model(x), y))
    assert step(first).applied
    with pytest.raises(MisuseError, match=r"the same AdamW was set up twice with Fabric") as err:
        step(second)
    assert "loss.backward()" not in str(err.value)
    # Each wrapper stepping once per backward is a working loop (a set-up cell run again).
    for wrapper in (second, first):
        fabric.backward(nn.functional.cross_entropy(model(x), y))
        assert step(wrapper).applied


def test_fabric_a_backward_after_clipping_and_before_the_step_is_refused() -> None:
    """Clipping each micro-batch unscaled the first one's gradients: at O2 the later ones
    never reached the masters, at fp16 O1 they were applied still scaled (an update 40000x
    float32's). A backward after clip_gradients and before step() is refused."""
    for policy, level in (("mixed_bfloat16", "O2"), ("mixed_float16", "O1")):
        fabric = Fabric(accelerator="cpu", devices=1,
                        plugins=[MixprecFabricPrecision(policy, level=level)])  # fmt: skip
        model = _mlp(0)
        model, opt = fabric.setup(model, torch.optim.SGD(model.parameters(), lr=1.0))
        x, y = next(iter(_data()))
        fabric.backward(nn.functional.cross_entropy(model(x), y))
        opt.step()  # the first step wraps the optimizer
        fabric.backward(nn.functional.cross_entropy(model(x), y))
        fabric.clip_gradients(model, opt, max_norm=1e6)
        with pytest.raises(MisuseError, match=r"a backward after clip_gradients and before"):
            fabric.backward(nn.functional.cross_entropy(model(x), y))


def test_fabric_two_optimizers_first_step_unscale_by_the_scale_their_backward_used() -> None:
    """Before an optimizer is wrapped (its first step), the scale of the backward was not
    kept: when the other's first step overflowed and halved the shared scale, the second
    optimizer's gradients came out 2x too large."""
    updates = {}
    for first in ("a", "b"):
        plugin = MixprecFabricPrecision("mixed_float16", level="O2")
        fabric = Fabric(accelerator="cpu", devices=1, plugins=[plugin])
        torch.manual_seed(0)
        a, b = nn.Linear(4, 4), nn.Linear(4, 4)
        start = b.weight.detach().clone()
        a, opt_a = fabric.setup(a, torch.optim.SGD(a.parameters(), lr=0.1))
        b, opt_b = fabric.setup(b, torch.optim.SGD(b.parameters(), lr=0.1))
        x = torch.randn(8, 4)
        overflowing = a(x).float().pow(2).mean() * 1e30  # a's gradients overflow float16
        fabric.backward(overflowing + b(x).float().pow(2).mean())
        for opt in (opt_a, opt_b) if first == "a" else (opt_b, opt_a):
            opt.step()
        updates[first] = (b.weight.detach().float() - start.float()).norm().item()
    assert updates["a"] == pytest.approx(updates["b"], rel=1e-3)


class _Two(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b = nn.Linear(16, 4), nn.Linear(16, 4)

    def forward(self, x: torch.Tensor, use_a: bool) -> torch.Tensor:
        return (self.a(x).pow(2).mean() if use_a else 0) + 2 * self.b(x).pow(2).mean()


def _two_optimizers(
    plugin: Any, iterations: range, load: Any = None, save: Any = None, discard: bool = False
) -> Any:
    """``a`` steps on even iterations, ``b`` on every one; both zero_grad every iteration.
    ``discard``: ``a`` takes part in every backward, so its odd iterations' gradients are
    discarded (else it takes part in the even ones only)."""
    fabric = Fabric(accelerator="cpu", devices=1, plugins=[plugin] if plugin else None)
    model = _Two()
    opt_a = torch.optim.SGD(model.a.parameters(), lr=0.1, momentum=0.9)
    opt_b = torch.optim.SGD(model.b.parameters(), lr=0.1, momentum=0.9)
    model, opt_a, opt_b = fabric.setup(model, opt_a, opt_b)
    state = {"model": model, "a": opt_a, "b": opt_b, **({"mixprec": plugin} if plugin else {})}
    if load is not None:
        fabric.load(load, state)
    for i in iterations:
        x = torch.randn(8, 16, generator=torch.Generator().manual_seed(i))
        fabric.backward(model(x, use_a=discard or i % 2 == 0))
        if i % 2 == 0:
            opt_a.step()
        opt_b.step()
        opt_a.zero_grad()
        opt_b.zero_grad()
    if save is not None:
        fabric.save(save, state)
    return model


def test_fabric_zero_grad_clears_the_16bit_gradients_of_a_backward_not_stepped() -> None:
    # The torch optimizer's own zero_grad reached the masters alone: a's discarded
    # gradients stayed on its bfloat16 weights and went into its next step (2.8e-2 off).
    plain = _two_optimizers(None, range(6), discard=True)
    plugin = MixprecFabricPrecision("mixed_bfloat16", level="O2")
    mixed = _two_optimizers(plugin, range(6), discard=True)
    assert torch.allclose(mixed.a.weight.float(), plain.a.weight, atol=2e-3, rtol=0)
    assert mixed.a.weight.grad is None


def test_fabric_resume_gives_each_optimizer_its_own_saved_state(tmp_path: Any) -> None:
    # Saved a, b; after the cut at 3 b steps first: it took a's masters and momentum.
    plugin = lambda: MixprecFabricPrecision("mixed_bfloat16", level="O2")  # noqa: E731
    whole = _two_optimizers(plugin(), range(6))
    path = tmp_path / "two.ckpt"
    _two_optimizers(plugin(), range(3), save=path)
    resumed = _two_optimizers(plugin(), range(3, 6), load=path)
    for mine, theirs in zip(resumed.parameters(), whole.parameters(), strict=True):
        assert torch.equal(mine, theirs)


class _Timed(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.saw: dict[str, torch.dtype] = {}

    def forward(self, x: torch.Tensor, t: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        self.saw = {"x": x.dtype, "t": t.dtype, "labels": labels.dtype}
        return self.fc(x)


def test_fabric_leaves_labels_and_keep_inputs_as_given() -> None:
    """Fabric casts the model's arguments before the model: ``labels`` and ``keep_inputs``,
    which the model's boundary leaves alone, were rounded there all the same."""
    fabric = Fabric(
        accelerator="cpu", devices=1, plugins=MixprecFabricPrecision("mixed_bfloat16", level="O2")
    )
    module = mp.auto_mixed_precision(_Timed(), "mixed_bfloat16", "O2", keep_inputs=("t",))
    model = fabric.setup(module)
    t, labels = torch.tensor([997.0, 998.0]), torch.tensor([1000.3, 1001.7])
    model(torch.randn(2, 4), t, labels=labels)
    assert module.saw == {"x": torch.bfloat16, "t": torch.float32, "labels": torch.float32}


class _Filler(nn.Module):
    """Sets an entry of the dict it is given, as a KV cache or a carried state is set."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor, state: dict[str, Any]) -> torch.Tensor:
        state["h"] = self.fc(x).detach()
        return self.fc(x)


@pytest.mark.parametrize("models", [1, 2])
def test_what_a_model_sets_in_a_dict_it_is_given_reaches_the_caller(models: int) -> None:
    """With two models set up (a GAN's G and D), Fabric's convert_input rebuilt a dict
    holding a float tensor, and the entry the model set went to the copy."""
    fabric = Fabric(accelerator="cpu", devices=1,
                    plugins=MixprecFabricPrecision("mixed_bfloat16", level="O2"))  # fmt: skip
    model = fabric.setup(_Filler())
    if models == 2:
        fabric.setup(_Filler())
    given = torch.zeros(2, 4)
    state = {"prev": given}
    model(torch.randn(2, 4), state)
    assert sorted(state) == ["h", "prev"] and state["prev"] is given


def test_fabric_reused_for_a_sweep_holds_only_the_live_trials_optimizers() -> None:
    """One Fabric across trials (a sweep, a notebook): the plugin kept every trial's
    wrapper, masters and state (+15.7 MB a trial for a 4.5 MB model) and saved them all."""
    import gc

    plugin = MixprecFabricPrecision("mixed_bfloat16", level="O2")
    fabric = Fabric(accelerator="cpu", devices=1, plugins=[plugin])
    for trial in range(3):
        model = fabric.setup(_mlp(trial))
        opt = fabric.setup_optimizers(torch.optim.AdamW(model.parameters(), lr=1e-2))
        x, y = next(iter(_data()))
        fabric.backward(nn.functional.cross_entropy(model(x), y))
        opt.step()
        assert len(plugin.optimizers) == 1
        assert len(plugin.state_dict()["optimizers"]) == 1
        del model, opt
        gc.collect()
    assert plugin.optimizers == []
