"""Loss scaling: the pure schedule (``schedule``), the finiteness and unscaling kernels
(``finite``), the stateful scalers (``scalers``) and TensorFlow 1's and MindSpore's managers
(``compat``). ``health`` watches a scaler during training.

``checks_on_host`` is looked up at call time in ``mixprec.scaling.finite``: patch it there.
"""

from __future__ import annotations

from mixprec.scaling.compat import DynamicLossScaleManager, ExponentialUpdateLossScaleManager
from mixprec.scaling.finite import all_finite, checks_on_host, finite_on_cpu, unscale_grads_
from mixprec.scaling.scalers import (
    DynamicLossScaler,
    LossScaler,
    NoOpLossScaler,
    StaticLossScaler,
)
from mixprec.scaling.schedule import (
    SMALLEST_NORMAL_F32,
    Arithmetic,
    DynamicConfig,
    ScalerState,
    count_step,
    next_state,
    to_float32,
)

__all__ = [
    "SMALLEST_NORMAL_F32",
    "Arithmetic",
    "DynamicConfig",
    "DynamicLossScaleManager",
    "DynamicLossScaler",
    "ExponentialUpdateLossScaleManager",
    "LossScaler",
    "NoOpLossScaler",
    "ScalerState",
    "StaticLossScaler",
    "all_finite",
    "checks_on_host",
    "count_step",
    "finite_on_cpu",
    "next_state",
    "to_float32",
    "unscale_grads_",
]
