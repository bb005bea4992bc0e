"""Numerics doctor: the overflowing layer is named (report and provenance), keeping it in
float32 fixes training, underflow gets the loss scale that fixes it, healthy models get a
clean report, and the scaler health warnings."""

from __future__ import annotations

import copy
import json
import warnings

import pytest
import torch
from torch import nn

import mixprec as mp
from mixprec.doctor import ScalerHealth
from mixprec.scaling import ScalerState

CE = nn.functional.cross_entropy


class Scale(nn.Module):
    def __init__(self, factor: float) -> None:
        super().__init__()
        self.factor = factor

    def forward(self, x):
        return x * self.factor


def overflowing(seed: int = 0) -> nn.Module:
    """Multiplies by 1e5 right before a float16 matmul."""
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Linear(16, 32), nn.ReLU(), Scale(1e5), nn.Linear(32, 32), nn.LayerNorm(32),
        nn.ReLU(), nn.Linear(32, 4),
    )  # fmt: skip


def healthy(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 64), nn.LayerNorm(64), nn.ReLU(),
        nn.Linear(64, 4),
    )  # fmt: skip


def batch(seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(64, 16, generator=g), torch.randint(0, 4, (64,), generator=g)


def test_overflowing_layer_is_named_first_and_keeping_it_float32_fixes_training():
    x, y = batch()
    report = mp.diagnose(overflowing(), x, y, CE, policy="mixed_float16")
    culprits = report.culprits()
    assert culprits[0].name == "2" and culprits[0].kind == "Scale"
    assert "becomes inf/NaN here first" in culprits[0].reasons[0]
    # The scale and its consumer, then the LayerNorm that receives values beyond float16.
    assert report.recommended_keep_float32 == ["2", "3", "4"]
    assert report.bfloat16_would_help
    assert "keep_float32=['2', '3', '4']" in str(report)

    # Provenance during training names the same module.
    model = mp.auto_mixed_precision(overflowing(), "mixed_float16", "O2")
    opt = mp.LossScaleOptimizer(torch.optim.SGD(model.parameters(), lr=0.05),
                                trace_overflow=True)  # fmt: skip
    opt.backward(CE(model(x), y))
    result = opt.step()
    assert not result.applied
    assert result.overflow is not None and result.overflow.module == "2"
    assert result.overflow.phase == "forward" and result.overflow.dtype == "float16"
    assert result.overflow.nonfinite > 0

    # With the recommendation applied, no step is skipped.
    fixed = mp.auto_mixed_precision(overflowing(), "mixed_float16", "O2",
                                    keep_float32=report.recommended_keep_float32)  # fmt: skip
    opt = mp.LossScaleOptimizer(torch.optim.SGD(fixed.parameters(), lr=0.05))
    losses = []
    for _ in range(30):
        opt.zero_grad()
        loss = CE(fixed(x), y)
        opt.backward(loss)
        assert opt.step().applied
        losses.append(loss.item())
    assert opt.loss_scaler.state.skipped_steps == 0 and losses[-1] < losses[0]


def test_underflowing_gradients_get_the_loss_scale_that_fixes_them():
    x, y = batch()
    tiny = lambda out, target: CE(out, target) * 1e-9  # noqa: E731 - gradients ~1e-12
    report = mp.diagnose(healthy(), x, y, tiny, policy="mixed_float16")
    assert report.culprits(), "underflow must be flagged"
    assert any("flush to zero" in r for m in report.culprits() for r in m.reasons)
    scale = report.suggested_loss_scale
    low, high = report.loss_scale_range
    assert low <= scale <= high and scale == 2.0 ** round(torch.tensor(scale).log2().item())
    assert any(f"StaticLossScaler({scale:g})" in a for a in report.advice)

    reference = healthy()
    tiny(reference(x), y).backward()
    errors = {}
    for name, scaler in (("default", mp.DynamicLossScaler()),
                         ("suggested", mp.StaticLossScaler(scale))):  # fmt: skip
        model = mp.auto_mixed_precision(healthy(), "mixed_float16", "O2")
        opt = mp.LossScaleOptimizer(torch.optim.SGD(model.parameters(), 0.1), loss_scaler=scaler)
        opt.backward(tiny(model(x), y))
        opt.unscale_()
        errors[name] = max(
            float((m.grad - p.grad).norm() / p.grad.norm())
            for m, p in zip(opt.master_params(), reference.parameters(), strict=True)
        )
    assert errors["default"] > 0.3  # most of the gradient is lost at 2**16
    assert errors["suggested"] < 0.05  # float16 rounding only


@pytest.mark.parametrize("policy", ["mixed_float16", "mixed_bfloat16"])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_healthy_model_gets_a_clean_report(policy, seed):
    x, y = batch(seed)
    report = mp.diagnose(healthy(seed), x, y, CE, policy=policy)
    assert report.healthy, str(report)
    assert report.recommended_keep_float32 == [] and report.advice == []
    assert abs(report.loss_mixed - report.loss_float32) < 0.02


def test_report_json_and_plot(tmp_path):
    x, y = batch()
    report = mp.diagnose(overflowing(), x, y, CE)
    data = json.loads(report.to_json())
    assert data["culprits"][0] == "2" and data["policy"] == "mixed_float16"
    assert {m["name"] for m in data["modules"]} >= {"0", "1", "2", "3", "(model)"}
    report.plot(str(tmp_path / "ranges.png"))
    assert (tmp_path / "ranges.png").read_bytes()[:4] == b"\x89PNG"


def test_diagnose_bad_input():
    x, y = batch()
    with pytest.raises(TypeError, match="needs an nn.Module, got str"):
        mp.diagnose("mlp", x, y, CE)  # type: ignore[arg-type]
    prepared = mp.auto_mixed_precision(healthy(), "mixed_float16")
    with pytest.raises(ValueError, match="needs the float32 model"):
        mp.diagnose(prepared, x, y, CE)
    with pytest.raises(ValueError, match="loss_scale=0 is invalid"):
        mp.diagnose(healthy(), x, y, CE, loss_scale=0)


def test_scaler_health_warns_once_per_kind():
    health = ScalerHealth(max_consecutive_skips=3, window=10, max_skip_rate=0.3)
    state = ScalerState(scale=2.0**10)
    assert health.observe(state, False) is None
    low = ScalerState(scale=0.25, consecutive_skips=1)
    message = health.observe(low, True, culprit="2 (Scale) forward")
    assert "fell to 0.25 < 1" in message and "mixed_bfloat16" in message and "2 (Scale)" in message
    assert health.observe(low, True) is None  # once
    streak = ScalerState(scale=4.0, consecutive_skips=3)
    assert "3 steps in a row were skipped" in health.observe(streak, True)
    health = ScalerHealth(max_consecutive_skips=100, window=10, max_skip_rate=0.3)
    for i in range(9):
        assert health.observe(state, i % 2 == 0) is None
    assert "of the last 10 steps were skipped" in health.observe(state, True)


def test_trainer_traces_and_warns(recwarn):
    x, y = batch()
    model = overflowing()
    trainer = mp.Trainer(model, "cross_entropy", torch.optim.SGD(model.parameters(), lr=0.05),
                         policy="mixed_float16", device="cpu", trace_overflow=True)  # fmt: skip
    events = []

    class Spy(mp.Callback):
        def on_train_batch_end(self, step, logs):
            events.append(logs["overflow"])

    with pytest.warns(UserWarning, match=r"steps in a row were skipped.*came from 2 \(Scale\)"):
        trainer.fit(x.repeat(4, 1), y.repeat(4), batch_size=16, epochs=1, verbose=0,
                    callbacks=[Spy()])  # fmt: skip
    assert events[0].startswith("2 (Scale) forward")


def test_tracing_off_installs_nothing():
    model = mp.auto_mixed_precision(healthy(), "mixed_float16", "O2")
    hooks_before = sum(len(m._forward_hooks) for m in model.modules())
    mp.LossScaleOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    assert sum(len(m._forward_hooks) for m in model.modules()) == hooks_before
    mp.LossScaleOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), trace_overflow=model)
    assert sum(len(m._forward_hooks) for m in model.modules()) > hooks_before
    plain = healthy()
    with pytest.raises(ValueError, match="pass the model"):
        mp.LossScaleOptimizer(torch.optim.SGD(plain.parameters(), lr=0.1), trace_overflow=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        copy.deepcopy(model)
