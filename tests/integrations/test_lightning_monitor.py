"""LossScaleMonitor: the loss scale and the skipped steps logged on request only, as
Lightning's own monitors; without it the logged metrics are the same as without mixprec."""

from __future__ import annotations

import csv
from pathlib import Path
from typing import Any

import pytest

L = pytest.importorskip("lightning")

import torch  # noqa: E402

from mixprec.integrations.lightning import LossScaleMonitor, MixprecPrecision  # noqa: E402
from tests.integrations.test_lightning_plugin import (  # noqa: E402
    STEPS_PER_EPOCH,
    Net,
    _data,
    _trainer,
)

pytestmark = pytest.mark.filterwarnings("ignore:You defined a `validation_step`:UserWarning")


class Logging(Net):
    """Logs its own ``train_loss`` and asserts, as a user's module does, which keys are
    logged; ``expected`` is the set of keys it expects."""

    def __init__(self, expected: set[str], overflow_at: int = -1) -> None:
        super().__init__(overflow_at=overflow_at)
        self.expected = expected

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss = super().training_step(batch, batch_idx)
        self.log("train_loss", self.losses[-1])
        return loss

    def on_train_epoch_end(self) -> None:
        assert set(self.trainer.logged_metrics) == self.expected
        assert set(self.trainer.callback_metrics) == self.expected


def _csv(path: Path) -> list[dict[str, str]]:
    with open(path / "run" / "version_0" / "metrics.csv") as f:
        return list(csv.DictReader(f))


def _fit(tmp_path: Path, module: Net, plugin: Any = None, **kwargs: Any) -> L.Trainer:
    logger = L.pytorch.loggers.CSVLogger(tmp_path, name="run", version=0)
    trainer = _trainer(plugin, logger=logger, **{"log_every_n_steps": 1, **kwargs})
    trainer.fit(module, _data())
    return trainer


@pytest.mark.parametrize(
    "plugin",
    [
        None,
        MixprecPrecision("mixed_bfloat16", level="O2"),
        MixprecPrecision("mixed_float16", level="O2"),
        MixprecPrecision("mixed_bfloat16", level="O1"),
    ],
    ids=["float32", "bf16-O2", "f16-O2", "bf16-O1"],
)
def test_the_plugin_leaves_the_logged_metrics_as_they_are(
    plugin: MixprecPrecision | None, tmp_path: Path
) -> None:
    trainer = _fit(tmp_path, Logging(expected={"train_loss"}), plugin)
    assert set(trainer.logged_metrics) == set(trainer.callback_metrics) == {"train_loss"}
    assert trainer.progress_bar_metrics == {}
    rows = _csv(tmp_path)
    assert set(rows[0]) == {"epoch", "step", "train_loss"}
    assert len(rows) == STEPS_PER_EPOCH


def test_monitor_logs_the_scale_after_each_step_and_the_skips(tmp_path: Path) -> None:
    k = 3
    plugin = MixprecPrecision("mixed_float16", level="O2")
    seen: list[tuple[float, float, float, int]] = []

    class Check(L.Callback):  # runs after the monitor: compares with the scaler's state
        def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
            metrics, state = trainer.callback_metrics, plugin.loss_scaler.state
            seen.append(
                (
                    metrics["loss_scale"].item(),
                    state.scale,
                    metrics["skipped_steps"].item(),
                    state.skipped_steps,
                )
            )

    keys = {"train_loss", "loss_scale", "skipped_steps"}
    module = Logging(expected=keys, overflow_at=k)
    trainer = _fit(tmp_path, module, plugin, callbacks=[LossScaleMonitor(), Check()])
    assert set(trainer.logged_metrics) == set(trainer.callback_metrics) == keys
    assert trainer.progress_bar_metrics == {}
    assert [(a, c) for a, b, c, d in seen] == [(b, d) for a, b, c, d in seen]
    rows = _csv(tmp_path)
    assert len(rows) == STEPS_PER_EPOCH
    assert [float(r["skipped_steps"]) for r in rows] == [0.0] * k + [1.0] * (STEPS_PER_EPOCH - k)
    # float16 from 2**16: one overflow halves the scale, growth needs 2000 finite steps.
    scales = [float(r["loss_scale"]) for r in rows]
    assert scales == [2.0**16] * k + [2.0**15] * (STEPS_PER_EPOCH - k)
    assert trainer.logged_metrics["loss_scale"] == plugin.loss_scaler.get_scale() == 2.0**15


def test_monitor_logs_only_on_the_steps_lightning_writes(tmp_path: Path) -> None:
    plugin = MixprecPrecision("mixed_bfloat16", level="O2")
    _fit(tmp_path, Net(), plugin, log_every_n_steps=4, callbacks=[LossScaleMonitor()])
    rows = [r for r in _csv(tmp_path) if r.get("loss_scale")]
    assert [int(r["step"]) for r in rows] == [3, 7]
    assert {float(r["loss_scale"]) for r in rows} == {1.0}  # bfloat16: no scaling


def test_monitor_at_the_epoch_interval_with_the_progress_bar(tmp_path: Path) -> None:
    plugin = MixprecPrecision("mixed_float16", level="O2")
    module = Net(overflow_at=2)  # the first epoch only: one skip in all
    monitor = LossScaleMonitor(logging_interval="epoch", prog_bar=True)
    trainer = _fit(tmp_path, module, plugin, max_epochs=2, callbacks=[monitor])
    rows = [r for r in _csv(tmp_path) if r.get("loss_scale")]
    assert [int(r["epoch"]) for r in rows] == [0, 1]
    assert [float(r["skipped_steps"]) for r in rows] == [1.0, 1.0]
    assert [float(r["loss_scale"]) for r in rows] == [2.0**15, 2.0**15]
    assert set(trainer.progress_bar_metrics) == {"loss_scale", "skipped_steps"}


def test_monitor_needs_the_mixprec_plugin() -> None:
    trainer = _trainer(callbacks=[LossScaleMonitor()], limit_train_batches=2)
    with pytest.raises(
        RuntimeError,
        match=r"LossScaleMonitor logs the loss scale of MixprecPrecision; this Trainer's "
        r"precision plugin is Precision: pass Trainer\(plugins=\[MixprecPrecision\(\.\.\.\)\]\)",
    ):
        trainer.fit(Net(), _data())


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"logging_interval": "batch"},
         r"LossScaleMonitor\(logging_interval='batch'\): expected 'step' or 'epoch'"),
        ({"prog_bar": "yes"},
         r"LossScaleMonitor\(prog_bar='yes'\): expected True or False, got str"),
    ],
)  # fmt: skip
def test_monitor_bad_arguments(kwargs: dict[str, Any], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        LossScaleMonitor(**kwargs)


def test_monitor_logs_nothing_outside_training(tmp_path: Path) -> None:
    plugin = MixprecPrecision("mixed_bfloat16", level="O2")
    module = Net()
    trainer = _fit(tmp_path, module, plugin, limit_train_batches=2, callbacks=[LossScaleMonitor()])
    (metrics,) = trainer.validate(module, _data(), verbose=False)
    assert set(metrics) == {"val_loss"}
