"""PyTorch Lightning: ``MixprecPrecision`` for ``lightning.pytorch.Trainer`` (``plugin``) and
``MixprecFabricPrecision`` for ``lightning.fabric.Fabric`` (``fabric``), thin adapters over
the shared precision logic (``precision``) and the schedulers held on skipped steps
(``schedulers``).

    trainer = L.Trainer(plugins=[MixprecPrecision("mixed_float16", level="O2")])

Importing this package imports Lightning (``pip install 'mixprec[lightning]'``);
``import mixprec`` does not.
"""

from mixprec.integrations.lightning.fabric import MixprecFabricPrecision
from mixprec.integrations.lightning.plugin import MixprecPrecision

__all__ = ["MixprecFabricPrecision", "MixprecPrecision"]
