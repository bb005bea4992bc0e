"""mixprec: mixed precision training for PyTorch.

Policies, O0-O3 levels, loss scaling and master weights in one library.
"""

from mixprec._errors import ArgumentError, MisuseError
from mixprec.casting import cast_floating, to_float
from mixprec.grad_scaler import GradScaler
from mixprec.levels import LEVELS, auto_mixed_precision, describe, module_dtypes
from mixprec.optim import LossScaleOptimizer, StepResult, split_embedding_parameters
from mixprec.policy import Policy, get_policy, global_policy, policy_scope, set_global_policy
from mixprec.scaling import (
    DynamicLossScaler,
    ExponentialUpdateLossScaleManager,
    LossScaler,
    NoOpLossScaler,
    ScalerState,
    StaticLossScaler,
    all_finite,
)

__version__ = "0.1.0"

__all__ = [
    "LEVELS",
    "ArgumentError",
    "DynamicLossScaler",
    "ExponentialUpdateLossScaleManager",
    "GradScaler",
    "LossScaleOptimizer",
    "LossScaler",
    "MisuseError",
    "NoOpLossScaler",
    "Policy",
    "ScalerState",
    "StaticLossScaler",
    "StepResult",
    "__version__",
    "all_finite",
    "auto_mixed_precision",
    "cast_floating",
    "describe",
    "get_policy",
    "global_policy",
    "module_dtypes",
    "policy_scope",
    "set_global_policy",
    "split_embedding_parameters",
    "to_float",
]
