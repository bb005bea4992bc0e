"""MixprecPrecision: mixprec's numerics inside Lightning's Trainer, against float32 runs of
the same trainer. The helpers here (data, model, trainer) serve the other Lightning and
Fabric test files too."""

from __future__ import annotations

import copy
import csv
import math
import pickle
from typing import Any

import pytest

L = pytest.importorskip("lightning")

import torch  # noqa: E402
from torch import nn  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402

import mixprec as mp  # noqa: E402
from mixprec.integrations.lightning import LossScaleMonitor, MixprecPrecision  # noqa: E402

STEPS_PER_EPOCH = 8  # 128 samples, batches of 16

# Net defines validation_step for the validate() test; the other runs pass no val data.
pytestmark = pytest.mark.filterwarnings("ignore:You defined a `validation_step`:UserWarning")


def _data() -> DataLoader:
    """A learnable 4-class problem: labels from a fixed random teacher. Not shuffled, so
    every run (and a resumed one) sees the same batches."""
    g = torch.Generator().manual_seed(1)
    x = torch.randn(128, 16, generator=g)
    y = (x @ torch.randn(16, 4, generator=g)).argmax(1)
    return DataLoader(TensorDataset(x, y), batch_size=16)


def _mlp(seed: int) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))


class Net(L.LightningModule):
    """A tiny classifier; ``overflow_at``: the loss is multiplied by inf at that batch."""

    def __init__(self, seed: int = 0, scheduler: bool = False, overflow_at: int = -1) -> None:
        super().__init__()
        self.net = _mlp(seed)
        self.scheduler = scheduler
        self.overflow_at = overflow_at
        self.losses: list[torch.Tensor] = []

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = nn.functional.cross_entropy(self.net(x), y)
        self.losses.append(loss.detach())
        if batch_idx == self.overflow_at and self.current_epoch == 0:
            loss = loss * math.inf  # inf/NaN in every gradient
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        self.log("val_loss", nn.functional.cross_entropy(self.net(x), y))

    def configure_optimizers(self) -> Any:
        opt = torch.optim.AdamW(self.parameters(), lr=1e-2)
        if not self.scheduler:
            return opt
        sch = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 0.9**step)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sch, "interval": "step"}}


def _trainer(plugin: Any = None, **kwargs: Any) -> L.Trainer:
    options: dict[str, Any] = {
        "accelerator": "cpu",
        "devices": 1,
        "max_epochs": 1,
        "enable_progress_bar": False,
        "enable_model_summary": False,
        "enable_checkpointing": False,
        "logger": False,
        "num_sanity_val_steps": 0,
        **kwargs,
    }
    return L.Trainer(plugins=[plugin] if plugin is not None else None, **options)


def _losses(module: Net) -> torch.Tensor:
    return torch.stack(module.losses).float()


@pytest.fixture(scope="module")
def float32_losses() -> torch.Tensor:
    module = Net()
    _trainer(max_epochs=3).fit(module, _data())
    return _losses(module)


# -- training at O2 -----------------------------------------------------------------------------


@pytest.mark.parametrize("policy", ["mixed_bfloat16", "mixed_float16"])
def test_o2_tracks_the_float32_trainer(policy: str, float32_losses: torch.Tensor) -> None:
    module = Net()
    _trainer(MixprecPrecision(policy, level="O2"), max_epochs=3).fit(module, _data())
    losses = _losses(module)
    assert losses.shape == float32_losses.shape == (3 * STEPS_PER_EPOCH,)
    # 24 AdamW steps (lr 1e-2) with 16-bit compute and float32 masters: measured max |loss
    # difference| 0.0011 for bfloat16 (8 significand bits) and 0.00042 for float16 (11); pure
    # bfloat16 without masters (O3) measured 0.0015. Tolerances: about 4x the measurement.
    tolerance = 0.005 if policy == "mixed_bfloat16" else 0.002
    gap = (losses - float32_losses).abs().max().item()
    assert 0 < gap < tolerance  # > 0: the steps did run in 16 bits
    assert losses[-4:].mean() < 0.7 * losses[:4].mean()  # it learns (measured 0.53)


def test_accumulation_and_value_clipping_track_float32() -> None:
    runs = {}
    for name, plugin in (("f32", None), ("bf16", MixprecPrecision("mixed_bfloat16"))):
        module = Net(scheduler=True)
        trainer = _trainer(
            plugin,
            max_epochs=2,
            accumulate_grad_batches=2,
            gradient_clip_val=0.5,
            gradient_clip_algorithm="value",
        )
        trainer.fit(module, _data())
        runs[name] = _losses(module)
        assert trainer.lr_scheduler_configs[0].scheduler.last_epoch == STEPS_PER_EPOCH
    # 8 updates of 2 micro-batches each: measured max |loss difference| 0.00058.
    assert 0 < (runs["bf16"] - runs["f32"]).abs().max().item() < 0.003


def test_o2_stores_16bit_weights_with_float32_masters() -> None:
    module = Net()
    plugin = MixprecPrecision("mixed_float16", level="O2")
    trainer = _trainer(plugin, limit_train_batches=2)
    trainer.fit(module, _data())
    assert trainer.precision == plugin.precision == "16-mixed"
    assert plugin.device == "cpu"
    weights = [p for p in module.parameters()]
    assert {p.dtype for p in weights} == {torch.float16}
    (lso,) = trainer.optimizers
    assert isinstance(lso, mp.LossScaleOptimizer) and plugin.optimizers == [lso]
    assert isinstance(lso.optimizer, torch.optim.AdamW)
    assert all(p.dtype == torch.float32 for p in lso.master_params())
    pairs = lso.master_weights()
    assert [id(half) for half, _ in pairs] == [id(p) for p in weights]
    for half, master in pairs:  # each 16-bit weight is its master rounded
        assert torch.equal(half, master.to(torch.float16))
    assert any(not torch.equal(m, m.half().float()) for _, m in pairs)  # masters are wider
    # The optimizer's moments live beside the masters, in float32.
    assert {v.dtype for s in lso.state.values() for v in s.values() if v.dim()} == {torch.float32}
    assert isinstance(plugin.loss_scaler, mp.DynamicLossScaler)
    # Lightning prepares the model again at validate(): the plugin leaves it as it is.
    (metrics,) = trainer.validate(module, _data(), verbose=False)
    assert math.isfinite(metrics["val_loss"])
    assert trainer.optimizers == [lso]


def test_manual_optimization_steps_through_the_wrapper() -> None:
    class Manual(Net):
        def __init__(self) -> None:
            super().__init__()
            self.automatic_optimization = False
            self.results: list[mp.StepResult] = []

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            opt = self.optimizers()
            opt.zero_grad()
            x, y = batch
            loss = nn.functional.cross_entropy(self.net(x), y)
            self.losses.append(loss.detach())
            self.manual_backward(loss)
            # Before opt.step(): the plugin unscales first, so the clip acts on true gradients.
            self.clip_gradients(opt, gradient_clip_val=0.01, gradient_clip_algorithm="norm")
            self.results.append(opt.step())
            return loss

        def on_train_start(self) -> None:
            def pre_step(inner: torch.optim.Optimizer, *_: Any) -> None:
                grads = [p.grad for g in inner.param_groups for p in g["params"]]
                self.norms.append(torch.stack([g.norm() for g in grads]).norm().item())

            self.norms: list[float] = []
            self.trainer.optimizers[0].register_step_pre_hook(pre_step)

    module = Manual()
    _trainer(MixprecPrecision("mixed_float16", level="O2")).fit(module, _data())
    assert len(module.results) == STEPS_PER_EPOCH
    assert all(isinstance(r, mp.StepResult) and r.applied for r in module.results)
    assert module.results[0].scale == 2.0**16
    assert module.norms == pytest.approx([0.01] * STEPS_PER_EPOCH, rel=1e-5)
    assert _losses(module)[-1] < _losses(module)[0]


# -- overflow, schedulers, logging --------------------------------------------------------------


class _Snapshots(L.Callback):
    def __init__(self) -> None:
        self.weights: list[list[torch.Tensor]] = []
        self.lrs: list[float] = []

    def on_train_batch_end(self, trainer: L.Trainer, module: Any, *args: Any) -> None:
        self.weights.append([p.detach().clone() for p in module.parameters()])
        self.lrs.append(trainer.optimizers[0].param_groups[0]["lr"])


@pytest.mark.parametrize("policy", ["mixed_bfloat16", "mixed_float16"])
def test_overflow_skips_the_step_and_holds_the_scheduler(
    policy: str, tmp_path: Any, caplog: pytest.LogCaptureFixture
) -> None:
    k = 3
    module = Net(scheduler=True, overflow_at=k)
    plugin = MixprecPrecision(policy, level="O2", trace_overflow=True)
    snaps = _Snapshots()
    logger = L.pytorch.loggers.CSVLogger(tmp_path, name="run", version=0)
    callbacks = [snaps, LossScaleMonitor()]
    trainer = _trainer(plugin, logger=logger, log_every_n_steps=1, callbacks=callbacks)
    trainer.fit(module, _data())

    unchanged = zip(snaps.weights[k], snaps.weights[k - 1], strict=True)
    assert all(torch.equal(a, b) for a, b in unchanged)
    changed = zip(snaps.weights[k + 1], snaps.weights[k], strict=True)
    assert all(not torch.equal(a, b) for a, b in changed)
    # The scheduler stayed where it was at the skipped step, and only there.
    assert snaps.lrs[k] == snaps.lrs[k - 1]
    assert all(snaps.lrs[i + 1] < snaps.lrs[i] for i in range(len(snaps.lrs) - 1) if i != k - 1)
    held = trainer.lr_scheduler_configs[0].scheduler
    assert isinstance(held, torch.optim.lr_scheduler.LambdaLR)  # user hooks still see its type
    assert held.last_epoch == STEPS_PER_EPOCH - 1  # applied steps, not Lightning's 8
    assert copy.deepcopy(held).last_epoch == held.last_epoch

    state = plugin.loss_scaler.state
    assert state.skipped_steps == 1 and state.last_overflow_step == k
    expected_scale = 1.0 if policy == "mixed_bfloat16" else 2.0**15  # float16: backed off once
    assert plugin.loss_scaler.get_scale() == expected_scale

    with open(tmp_path / "run" / "version_0" / "metrics.csv") as f:
        rows = [r for r in csv.DictReader(f) if r.get("skipped_steps")]
    assert [float(r["skipped_steps"]) for r in rows] == [0.0] * k + [1.0] * (STEPS_PER_EPOCH - k)
    scales = [float(r["loss_scale"]) for r in rows]
    assert scales[-1] == expected_scale and scales[0] == (2.0**16 if expected_scale > 1 else 1.0)
    # trace_overflow: the loss was made inf after the model, so the first non-finite value is
    # the gradient arriving at the model's last layer.
    assert "step skipped: overflow first in net" in caplog.text
    assert "backward" in caplog.text


def test_gradient_clipping_acts_on_unscaled_float32_masters() -> None:
    clip = 1e-3

    class Recording(Net):
        def __init__(self) -> None:
            super().__init__()
            self.before_clip: list[float] = []
            self.at_step: list[float] = []

        def on_train_start(self) -> None:
            opt = self.trainer.optimizers[0]
            if not isinstance(opt, mp.LossScaleOptimizer):
                return  # float32: torch's step runs the closure after its pre-hooks

            def pre_step(inner: torch.optim.Optimizer, *_: Any) -> None:
                grads = [p.grad for g in inner.param_groups for p in g["params"]]
                self.at_step.append(torch.stack([g.norm() for g in grads]).norm().item())

            opt.register_step_pre_hook(pre_step)

        def on_before_optimizer_step(self, optimizer: Any) -> None:
            params = list(self.trainer.precision_plugin.main_params(optimizer))
            norm = torch.stack([p.grad.norm() for p in params]).norm()
            self.before_clip.append(norm.item())

    results = {}
    for name, plugin in (("f32", None), ("f16", MixprecPrecision("mixed_float16", level="O2"))):
        module = Recording()
        _trainer(plugin, gradient_clip_val=clip, limit_train_batches=3).fit(module, _data())
        results[name] = module
    f16 = results["f16"]
    # What the hooks see is unscaled: the float32 run's first gradient norm up to float16
    # rounding (measured 7e-5 relative); scaled, it would be 65536 times larger.
    assert f16.before_clip[0] == pytest.approx(results["f32"].before_clip[0], rel=1e-2)
    assert min(f16.before_clip) > 100 * clip  # so the clip is active at every step
    # What the optimizer applies is the clipped master gradient: total norm == clip.
    assert f16.at_step == pytest.approx([clip] * 3, rel=1e-5)


# -- the batch -----------------------------------------------------------------------------------


class _Regression(L.LightningModule):
    """Float targets, a training_step that calls a submodule; records what the step is
    handed."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Linear(16, 1)
        self.batches: list[tuple[torch.Tensor, torch.Tensor]] = []

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        self.batches.append((x, y))
        return nn.functional.mse_loss(self.net(x).float().squeeze(1), y.float())

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=1e-3)


def test_the_trainer_hands_the_batch_over_as_given_float_targets_too() -> None:
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(32, 16, generator=g), torch.randn(32, generator=g) * 1000 + 0.1
    data = DataLoader(TensorDataset(x, y), batch_size=16)
    native = _Regression()  # Lightning's bf16-true casts the whole batch, targets included
    _trainer(precision="bf16-true").fit(native, data)
    assert {(a.dtype, b.dtype) for a, b in native.batches} == {(torch.bfloat16,) * 2}
    assert not torch.equal(native.batches[0][1].float(), y[:16])
    module = _Regression()  # mixprec at O3 (reported as "bf16-true"): the batch as it came
    plugin = MixprecPrecision("bfloat16", level="O3")
    _trainer(plugin).fit(module, data)
    assert plugin.precision == "bf16-true" and module.net.weight.dtype == torch.bfloat16
    assert torch.equal(module.batches[0][0], x[:16]) and torch.equal(module.batches[0][1], y[:16])


# -- checkpoints ---------------------------------------------------------------------------------


def _scaler() -> mp.DynamicLossScaler:
    # Small and quick to grow, so the scale changes during the run and must be restored.
    return mp.DynamicLossScaler(init_scale=2.0**10, growth_interval=3)


def test_resume_from_a_lightning_checkpoint_equals_an_uninterrupted_run(tmp_path: Any) -> None:
    whole = Net(scheduler=True)
    whole_plugin = MixprecPrecision("mixed_float16", level="O2", loss_scaler=_scaler())
    whole_trainer = _trainer(whole_plugin, max_epochs=2)
    whole_trainer.fit(whole, _data())

    first = Net(scheduler=True)
    first_plugin = MixprecPrecision("mixed_float16", level="O2", loss_scaler=_scaler())
    first_trainer = _trainer(first_plugin, max_epochs=1)
    first_trainer.fit(first, _data())
    path = tmp_path / "epoch1.ckpt"
    first_trainer.save_checkpoint(path)
    saved_scale = first_plugin.loss_scaler.get_scale()
    assert saved_scale != 2.0**10

    class Resumed(Net):
        def on_train_start(self) -> None:
            self.scale_at_start = self.trainer.precision_plugin.loss_scaler.get_scale()

    resumed = Resumed(seed=7, scheduler=True)  # other initial weights: all must come back
    plugin = MixprecPrecision("mixed_float16", level="O2", loss_scaler=_scaler())
    trainer = _trainer(plugin, max_epochs=2)
    trainer.fit(resumed, _data(), ckpt_path=path)

    assert resumed.scale_at_start == saved_scale
    assert torch.equal(_losses(resumed), _losses(whole)[STEPS_PER_EPOCH:])
    for a, b in zip(resumed.parameters(), whole.parameters(), strict=True):
        assert a.dtype == torch.float16 and torch.equal(a, b)
    for (_, a), (_, b) in zip(
        trainer.optimizers[0].master_weights(),
        whole_trainer.optimizers[0].master_weights(),
        strict=True,
    ):
        assert torch.equal(a, b)
    assert plugin.loss_scaler.state == whole_plugin.loss_scaler.state
    assert trainer.lr_scheduler_configs[0].scheduler.last_epoch == 2 * STEPS_PER_EPOCH


# -- arguments and pickling ----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"policy": "mixed_bfloat"}, ValueError,
         r"MixprecPrecision: policy='mixed_bfloat' is not a known policy; valid names: .*"
         r"\(closest: 'mixed_bfloat16'\)"),
        ({"policy": 16}, TypeError, r"MixprecPrecision: policy must be a str or Policy, got int"),
        ({"level": "O5"}, ValueError,
         r"MixprecPrecision: level='O5' is not a known level; valid: O0, O1, O2, O3, auto"),
        ({"level": 2}, TypeError, r"MixprecPrecision: level=2 is invalid; valid: O0, O1, O2"),
        ({"loss_scaler": torch.amp.GradScaler("cpu")}, TypeError,
         r"MixprecPrecision\(loss_scaler=.*\): expected None \(the policy's default\) or a "
         r"mixprec NoOpLossScaler, StaticLossScaler or DynamicLossScaler, got GradScaler"),
        ({"keep_float32": [nn.Linear, 3]}, TypeError,
         r"MixprecPrecision\(keep_float32=...\): entry 3 \(int\) is not an nn.Module subclass"),
        ({"keep_float32": 3}, TypeError, r"MixprecPrecision\(keep_float32=3\): expected module"),
        ({"trace_overflow": "yes"}, TypeError,
         r"MixprecPrecision\(trace_overflow='yes'\): expected True or False, got str"),
    ],
)  # fmt: skip
def test_bad_arguments_name_the_argument_and_what_is_valid(
    kwargs: dict[str, Any], error: type[Exception], match: str
) -> None:
    with pytest.raises(error, match=match):
        MixprecPrecision(**kwargs)


def test_bad_keep_float32_name_fails_at_setup_with_the_closest_name() -> None:
    trainer = _trainer(MixprecPrecision(keep_float32=["net.3"]))
    with pytest.raises(ValueError, match=r"'net.3' matches no module .*closest: 'net.2'"):
        trainer.fit(Net(), _data())


@pytest.mark.parametrize(
    ("make", "match"),
    [
        (lambda p: mp.LossScaleOptimizer(torch.optim.SGD(p, lr=0.1)),
         r"already a LossScaleOptimizer; return the plain torch optimizer"),
        (lambda p: torch.optim.LBFGS(p), r"LBFGS re-evaluates its closure"),
    ],
)  # fmt: skip
def test_optimizers_it_cannot_wrap_are_refused(make: Any, match: str) -> None:
    class Custom(Net):
        def configure_optimizers(self) -> Any:
            return make(self.parameters())

    with pytest.raises(TypeError, match=match):
        _trainer(MixprecPrecision()).fit(Custom(), _data())


def test_a_model_prepared_otherwise_is_refused_and_the_same_way_is_kept() -> None:
    plugin = MixprecPrecision("mixed_float16", level="O2", keep_float32=["2"])
    model = _mlp(0)
    assert plugin.convert_module(model) is model  # prepared here
    weight = model[0].weight
    assert weight.dtype == torch.float16
    MixprecPrecision("mixed_float16", level="O2").convert_module(model)  # the same: kept
    assert model[0].weight is weight
    with pytest.raises(
        mp.ArgumentError,
        match=r"^MixprecPrecision\(policy='mixed_bfloat16', level='O2'\): the model was already "
        r"prepared with policy mixed_float16, level O2; a model is prepared once: pass "
        r"policy='mixed_float16', level='O2' to use it as it is, or build the model again$",
    ):
        MixprecPrecision("mixed_bfloat16", level="O2").convert_module(model)
    with pytest.raises(mp.ArgumentError, match=r"keeping \['2'\] in float32, and keep_float32 "
                       r"asks for \['0', '2'\]"):  # fmt: skip
        MixprecPrecision("mixed_float16", level="O2", keep_float32=["0", "2"]).convert_module(model)


def test_the_same_plugin_reuses_its_module_after_lightning_swaps_layers() -> None:
    """DDP's sync_batchnorm swaps BatchNorm for SyncBatchNorm before fit's convert_module
    only: validate, then fit, must not refuse the module the plugin itself prepared."""
    plugin = MixprecPrecision("mixed_bfloat16", level="O3", keep_float32=[nn.BatchNorm1d])
    model = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.Linear(8, 2))
    assert plugin.convert_module(model) is model  # validate: prepared here
    assert model[1].weight.dtype == torch.float32 and model[0].weight.dtype == torch.bfloat16
    swapped = nn.SyncBatchNorm.convert_sync_batchnorm(model)  # what DDP's setup does
    assert plugin.convert_module(swapped) is swapped  # fit: the same preparation, kept
    assert swapped[0].weight.dtype == torch.bfloat16


def test_a_checkpoint_of_another_level_is_refused() -> None:
    saved = MixprecPrecision("mixed_bfloat16", level="O2")
    saved.convert_module(_mlp(0))
    state = saved.state_dict()
    assert state["level"] == "O2" and state["loss_scaler"]["type"] == "NoOpLossScaler"
    other = MixprecPrecision("mixed_bfloat16", level="O1")
    other.convert_module(_mlp(0))
    with pytest.raises(ValueError, match=r"trained at level 'O2' .*this plugin runs level 'O1'"):
        other.load_state_dict(state)


def test_plugin_pickles_before_and_after_a_run() -> None:
    plugin = MixprecPrecision("mixed_float16", level="O2", keep_float32=[nn.ReLU])
    copy = pickle.loads(pickle.dumps(plugin))  # what ddp_spawn does before setup
    assert (copy.policy, copy.level, copy.precision) == (plugin.policy, "O2", "16-mixed")
    _trainer(plugin, limit_train_batches=2).fit(Net(), _data())
    after = pickle.loads(pickle.dumps(plugin))
    assert after.optimizers == [] and after.loss_scaler.state == plugin.loss_scaler.state


class _SkipsOne(Net):
    """``training_step`` returns None at one batch (Lightning's way to skip it); records
    whether the first layer changed after each batch."""

    def __init__(self, skip_at: int) -> None:
        super().__init__()
        self.skip_at = skip_at
        self.changed: list[bool] = []
        self._last: torch.Tensor | None = None

    def training_step(self, batch: Any, batch_idx: int) -> Any:
        return None if batch_idx == self.skip_at else super().training_step(batch, batch_idx)

    def on_train_batch_end(self, *args: Any) -> None:
        now = self.net[0].weight.detach().float().clone()
        if self._last is not None:
            self.changed.append(not torch.equal(now, self._last))
        self._last = now


@pytest.mark.parametrize(("accumulate", "skip_at"), [(1, 2), (2, 3)])
def test_a_skipped_batch_with_clipping_steps_as_the_float32_trainer(accumulate, skip_at) -> None:
    """Clipping on a skipped batch unscaled with no backward: a MisuseError without
    accumulation, and with it a stale unscaled state that dropped the next window."""
    runs = []
    for plugin in (None, MixprecPrecision("mixed_bfloat16", level="O2")):
        module = _SkipsOne(skip_at)
        _trainer(plugin, gradient_clip_val=1.0, accumulate_grad_batches=accumulate).fit(
            module, _data()
        )
        runs.append(module.changed)
    float32, mixed = runs
    if accumulate == 1:
        assert mixed == float32
    else:  # as Lightning's own AMP plugin, the window holding the skipped batch steps not
        assert mixed == [c and i != skip_at - 1 for i, c in enumerate(float32)]
        assert mixed[skip_at + 1]  # the next window steps


class _TwoOptimizers(L.LightningModule):
    """Manual optimization, GAN-style: backward both losses, then step both. ``overflow_at``:
    G's loss is multiplied by inf there (an overflow in G's gradients only)."""

    def __init__(self, overflow_at: int = -1) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.g, self.d = nn.Linear(16, 4), nn.Linear(16, 4)
        self.automatic_optimization = False
        self.overflow_at = overflow_at
        self.d_weights: list[torch.Tensor] = []

    def training_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        opt_g, opt_d = self.optimizers()
        opt_g.zero_grad()
        opt_d.zero_grad()
        loss_g = nn.functional.cross_entropy(self.g(x), y)
        if batch_idx == self.overflow_at:
            loss_g = loss_g * math.inf
        self.manual_backward(loss_g)
        self.manual_backward(nn.functional.cross_entropy(self.d(x), y))
        opt_g.step()
        opt_d.step()
        self.d_weights.append(self.d.weight.detach().float().clone())

    def configure_optimizers(self) -> Any:
        return (torch.optim.SGD(self.g.parameters(), lr=0.1),
                torch.optim.SGD(self.d.parameters(), lr=0.1))  # fmt: skip


def test_an_optimizer_stepped_after_anothers_scale_update_unscales_with_its_own_scale() -> None:
    """G's overflow halves the shared scale at G's step; D's gradients were scaled by the
    old scale, and D's update must be float32's, not twice it."""
    reference = _TwoOptimizers()
    _trainer(max_steps=4).fit(reference, _data())
    mixed = _TwoOptimizers(overflow_at=1)
    _trainer(MixprecPrecision("mixed_float16", level="O1"), max_steps=4).fit(mixed, _data())
    for ours, theirs in zip(mixed.d_weights, reference.d_weights, strict=True):
        torch.testing.assert_close(ours, theirs, rtol=0, atol=2e-3)


class _NoneAfterOverflow(Net):
    """Overflows at batch 2; ``training_step`` returns None at ``none_at``."""

    def __init__(self, none_at: int) -> None:
        super().__init__(scheduler=True, overflow_at=2)
        self.none_at = none_at

    def training_step(self, batch: Any, batch_idx: int) -> Any:
        return None if batch_idx == self.none_at else super().training_step(batch, batch_idx)


@pytest.mark.parametrize("none_at", [3, 5])
def test_a_batch_returning_none_after_a_skipped_step_steps_its_scheduler(none_at: int) -> None:
    """Lightning steps the scheduler on a batch that returned None; right after an overflow
    the stale 'skipped' flag held it too, one step fewer than float32's count less one."""
    steps = []
    for plugin in (None, MixprecPrecision("mixed_float16", level="O2")):
        trainer = _trainer(plugin)
        trainer.fit(_NoneAfterOverflow(none_at), _data())
        steps.append(trainer.lr_scheduler_configs[0].scheduler.last_epoch)
    float32, mixed = steps
    assert mixed == float32 - 1  # the overflowed step alone holds it


def test_a_checkpoint_of_another_policy_is_refused() -> None:
    saved = MixprecPrecision("mixed_float16", level="O2", loss_scaler=mp.DynamicLossScaler())
    saved.convert_module(_mlp(0))
    other = MixprecPrecision("mixed_bfloat16", level="O2", loss_scaler=mp.DynamicLossScaler())
    other.convert_module(_mlp(0))
    said = r"trained with policy 'params=float32,compute=float16,output=float32'; this plugin"
    with pytest.raises(ValueError, match=said):
        other.load_state_dict(saved.state_dict())


class _ToggledGan(L.LightningModule):
    """Lightning's GAN pattern: G's loss goes through D with D toggled off, then D's own
    step; each optimizer zeroes its gradients after its step. ``watched`` records a
    layer's weight after each step."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.g, self.d = nn.Linear(16, 16), nn.Linear(16, 4)
        self.automatic_optimization = False
        self.weights: list[torch.Tensor] = []

    def trunk(self, x: torch.Tensor) -> torch.Tensor:
        return x

    def watched(self) -> nn.Linear:
        return self.d

    def training_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        opt_g, opt_d = self.optimizers()
        self.toggle_optimizer(opt_g)
        self.manual_backward(
            nn.functional.cross_entropy(self.d(self.g(self.trunk(x))), (y + 1) % 4)
        )
        opt_g.step()
        opt_g.zero_grad()
        self.untoggle_optimizer(opt_g)
        self.toggle_optimizer(opt_d)
        self.manual_backward(nn.functional.cross_entropy(self.d(self.trunk(x)), y))
        opt_d.step()
        opt_d.zero_grad()
        self.untoggle_optimizer(opt_d)
        self.weights.append(self.watched().weight.detach().float().clone())

    def configure_optimizers(self) -> Any:
        return (torch.optim.SGD(self.g.parameters(), lr=0.5),
                torch.optim.SGD(self.d.parameters(), lr=0.5))  # fmt: skip


class _SharedTrunk(_ToggledGan):
    """G and D share a first layer, listed in both optimizers (each has its own master)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(1)
        self.s = nn.Linear(16, 16)

    def trunk(self, x: torch.Tensor) -> torch.Tensor:
        return self.s(x)

    def watched(self) -> nn.Linear:
        return self.s

    def configure_optimizers(self) -> Any:
        shared = list(self.s.parameters())
        return (torch.optim.SGD([*shared, *self.g.parameters()], lr=0.5),
                torch.optim.SGD([*shared, *self.d.parameters()], lr=0.5))  # fmt: skip


@pytest.mark.parametrize("module", [_ToggledGan, _SharedTrunk], ids=["gan", "shared-trunk"])
def test_toggle_optimizer_at_o2_trains_as_float32(module: type[_ToggledGan]) -> None:
    """toggle_optimizer turns off requires_grad on the optimizer's parameters: at O2 those
    are the float32 masters, and D's 16-bit weights took G's gradients (its next step
    applied them: 0.08 off float32 after 4 steps). They now take none. A layer shared by
    both optimizers has a master in each, one off and one on: its weight keeps the
    gradient, as in float32 (a first version of the fix gave it none: 0.07 off)."""
    reference = module()
    _trainer(max_steps=4).fit(reference, _data())
    mixed = module()
    _trainer(MixprecPrecision("mixed_float16", level="O2"), max_steps=4).fit(mixed, _data())
    for ours, theirs in zip(mixed.weights, reference.weights, strict=True):
        torch.testing.assert_close(ours, theirs, rtol=0, atol=2e-3)
    assert all(p.requires_grad for p in mixed.parameters())  # restored after each backward


def test_a_full_checkpoint_holds_the_masters_and_a_weights_only_one_warns(tmp_path: Any) -> None:
    # The state_dict held the 16-bit rounding (load_from_checkpoint gave weights up to 1e-3
    # off the masters), and a weights-only checkpoint dropped the masters without a word.
    import warnings

    module = Net()
    plugin = MixprecPrecision("mixed_bfloat16", level="O2")
    trainer = _trainer(plugin, max_epochs=1)
    trainer.fit(module, _data())
    masters = {id(half): master for half, master in plugin.optimizers[0].master_weights()}
    trainer.save_checkpoint(tmp_path / "full.ckpt")
    state = torch.load(tmp_path / "full.ckpt", weights_only=False)["state_dict"]
    for name, param in module.named_parameters():
        expected = masters.get(id(param), param)
        assert state[name].dtype == torch.float32 and torch.equal(state[name], expected.float())
    # The masters' keys alone are written: the others keep what the strategy put there.
    marked = {"state_dict": {k: torch.full_like(v, 7) for k, v in module.state_dict().items()}}
    plugin.on_save_checkpoint(marked)
    written = {k for k, v in marked["state_dict"].items() if not bool((v == 7).all())}
    assert written == {n for n, p in module.named_parameters() if id(p) in masters}
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        trainer.save_checkpoint(tmp_path / "weights.ckpt", weights_only=True)
        trainer.save_checkpoint(tmp_path / "again.ckpt", weights_only=True)  # said once
    said = [w for w in seen if "weights-only Lightning checkpoint" in str(w.message)]
    assert len(said) == 1 and "float32 master weights" in str(said[0].message)


class _AccumulatedD(L.LightningModule):
    """Lightning's manual accumulation: G steps every batch, D every second one; G's step
    moves the shared scale between D's two backwards."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.g, self.d = nn.Linear(16, 8), nn.Linear(16, 1)
        self.automatic_optimization = False

    def training_step(self, batch: Any, batch_idx: int) -> None:
        x, _ = batch
        opt_g, opt_d = self.optimizers()
        self.manual_backward(self.g(x).pow(2).mean())
        opt_g.step()
        opt_g.zero_grad()
        self.manual_backward(self.d(x).pow(2).mean())
        if batch_idx % 2 == 1:
            opt_d.step()
            opt_d.zero_grad()

    def configure_optimizers(self) -> Any:
        return (torch.optim.SGD(self.g.parameters(), lr=0.1),
                torch.optim.SGD(self.d.parameters(), lr=0.1))  # fmt: skip


def test_gradients_accumulated_across_a_scale_change_unscale_by_their_own_scales() -> None:
    # The unscale used the last backward's scale for both: D's first micro-batch came out
    # times scale_then / scale_now (D's update 0.89x 32-true's with a growing scale).
    reference = _AccumulatedD()
    _trainer(max_epochs=1, limit_train_batches=4).fit(reference, _data())
    plugin = MixprecPrecision("float32", level="O0", loss_scaler=mp.DynamicLossScaler(
        init_scale=16.0, growth_interval=1))  # fmt: skip
    mixed = _AccumulatedD()
    _trainer(plugin, max_epochs=1, limit_train_batches=4).fit(mixed, _data())
    assert plugin.loss_scaler.get_scale() > 16.0  # it moved
    torch.testing.assert_close(mixed.d.weight, reference.d.weight, rtol=0, atol=1e-6)
