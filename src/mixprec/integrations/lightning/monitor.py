"""``LossScaleMonitor``: a Lightning callback that logs the loss scale and the skipped steps.

Lightning's monitoring is opt-in (``LearningRateMonitor``, ``DeviceStatsMonitor``):
``MixprecPrecision`` logs nothing by itself, so the metrics a ``LightningModule`` logs, and
those its loggers and checkpoint callbacks see, are the same with and without it. Add the
callback to log the scaler's state:

    trainer = L.Trainer(
        plugins=[MixprecPrecision("mixed_float16", level="O2")],
        callbacks=[LossScaleMonitor()],
    )
"""

from __future__ import annotations

from typing import Any, Literal

from mixprec._errors import ArgumentError, MisuseError
from mixprec.integrations.lightning._lightning import Callback, pl
from mixprec.integrations.lightning.plugin import MixprecPrecision

Interval = Literal["step", "epoch"]


class LossScaleMonitor(Callback):
    """Log ``loss_scale`` (the scale after the latest optimizer step) and ``skipped_steps``
    (optimizer steps skipped for an overflow since the start of training, checkpointed)
    through ``LightningModule.log``: every logger gets them, and so do
    ``trainer.logged_metrics`` and ``trainer.callback_metrics`` (so ``EarlyStopping`` or
    ``ModelCheckpoint`` can watch ``skipped_steps``).

    ``logging_interval``: ``"step"`` (default) logs after each training batch, on the steps
    Lightning writes to its loggers (``log_every_n_steps``; two ``log`` calls cost about
    1 ms of Python, so the others are not logged); ``"epoch"`` logs once, at the end of
    each training epoch. ``prog_bar``: show them in the progress bar too.

    Needs ``MixprecPrecision`` in ``Trainer(plugins=[...])``; training with another
    precision plugin fails at the start with an error that says so.
    """

    def __init__(self, logging_interval: Interval = "step", prog_bar: bool = False) -> None:
        if logging_interval not in ("step", "epoch"):
            raise ArgumentError(
                f"LossScaleMonitor(logging_interval={logging_interval!r}): expected 'step' or "
                "'epoch'"
            )
        if not isinstance(prog_bar, bool):
            raise ArgumentError(
                f"LossScaleMonitor(prog_bar={prog_bar!r}): expected True or False, got "
                f"{type(prog_bar).__name__}"
            )
        self.logging_interval: Interval = logging_interval
        self.prog_bar = prog_bar

    def _plugin(self, trainer: pl.Trainer) -> MixprecPrecision:
        plugin = trainer.precision_plugin
        if not isinstance(plugin, MixprecPrecision):
            raise MisuseError(
                "LossScaleMonitor logs the loss scale of MixprecPrecision; this Trainer's "
                f"precision plugin is {type(plugin).__name__}: pass "
                "Trainer(plugins=[MixprecPrecision(...)]), or remove the callback"
            )
        return plugin

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._plugin(trainer)  # fail before the first step, not after it

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any, **kwargs: Any
    ) -> None:
        if self.logging_interval != "step":
            return
        # The condition Lightning checks later in the same batch before it writes the logs
        # (a protected property of its logger connector, read the same way by
        # LearningRateMonitor); fast_dev_run writes every step.
        connector = getattr(trainer, "_logger_connector", None)
        fast_dev_run = getattr(trainer, "fast_dev_run", False)  # set by a connector, untyped
        if connector is not None and not (connector.should_update_logs or fast_dev_run):
            return
        self._log(trainer, pl_module, on_step=True)

    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.logging_interval == "epoch":
            self._log(trainer, pl_module, on_step=False)

    def _log(self, trainer: pl.Trainer, pl_module: pl.LightningModule, on_step: bool) -> None:
        state = self._plugin(trainer).loss_scaler.state
        # batch_size=1: one value per call, nothing to weigh (and no batch to infer it from).
        options: dict[str, Any] = {
            "on_step": on_step,
            "on_epoch": not on_step,
            "prog_bar": self.prog_bar,
            "batch_size": 1,
        }
        pl_module.log("loss_scale", float(state.scale), **options)
        pl_module.log("skipped_steps", float(state.skipped_steps), **options)
