"""PyTorch Lightning: ``MixprecPrecision`` for ``lightning.pytorch.Trainer`` (``plugin``) and
``MixprecFabricPrecision`` for ``lightning.fabric.Fabric`` (``fabric``), thin adapters over
the shared precision logic (``precision``) and the schedulers held on skipped steps
(``schedulers``); ``LossScaleMonitor`` (``monitor``), the opt-in callback that logs the loss
scale and the skipped steps.

    trainer = L.Trainer(
        plugins=[MixprecPrecision("mixed_float16", level="O2")],
        callbacks=[LossScaleMonitor()],  # optional: log loss_scale and skipped_steps
    )

Importing this package imports Lightning (``pip install 'mixprec[lightning]'``);
``import mixprec`` does not.
"""

from mixprec.integrations.lightning.fabric import MixprecFabricPrecision
from mixprec.integrations.lightning.monitor import LossScaleMonitor
from mixprec.integrations.lightning.plugin import MixprecPrecision

__all__ = ["LossScaleMonitor", "MixprecFabricPrecision", "MixprecPrecision"]
