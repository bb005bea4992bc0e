"""The Lightning names this package uses, imported in one place, with the install hint
where Lightning is missing."""

from __future__ import annotations

try:
    import lightning.pytorch as pl
    from lightning.fabric.plugins import Precision as FabricPrecision
    from lightning.pytorch.callbacks import Callback
    from lightning.pytorch.core.optimizer import LightningOptimizer
    from lightning.pytorch.plugins.precision import Precision
    from lightning.pytorch.utilities import GradClipAlgorithmType
except ImportError as err:  # pragma: no cover - exercised only without the extra
    raise ImportError(
        "mixprec.integrations.lightning needs Lightning: pip install 'mixprec[lightning]'"
    ) from err

__all__ = [
    "Callback",
    "FabricPrecision",
    "GradClipAlgorithmType",
    "LightningOptimizer",
    "Precision",
    "pl",
]
