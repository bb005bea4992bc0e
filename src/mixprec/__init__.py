"""mixprec: mixed precision training for PyTorch.

Policies, O0-O3 levels, loss scaling and master weights in one library.
"""

from mixprec import data, distributed, losses, models
from mixprec._errors import ArgumentError, MisuseError
from mixprec._float32_copies import release_float32_copies
from mixprec._version import __version__
from mixprec.autotune import Plan, autotune
from mixprec.casting import cast_floating
from mixprec.checkpoint import (
    CheckpointError,
    LoadReport,
    convert_checkpoint,
    export_weights,
    load_checkpoint,
    read_checkpoint,
    save_checkpoint,
)
from mixprec.doctor import ModuleReport, Report, diagnose
from mixprec.doctor.float8 import Float8LayerReport, Float8Report, diagnose_float8
from mixprec.dtype_table import describe, module_dtypes
from mixprec.float8 import Float8Options
from mixprec.grad_scaler import GradScaler
from mixprec.levels import LEVELS, auto_mixed_precision
from mixprec.losses import cross_entropy
from mixprec.optim import LossScaleOptimizer, StepResult, split_embedding_parameters
from mixprec.optim.compensated import CompensatedAdamW, stochastic_round
from mixprec.policy import Policy, get_policy, global_policy, policy_scope, set_global_policy
from mixprec.recompute import activation_checkpoint, checkpoint_context
from mixprec.region import to_float
from mixprec.scaling import (
    DynamicLossScaleManager,
    DynamicLossScaler,
    ExponentialUpdateLossScaleManager,
    LossScaler,
    NoOpLossScaler,
    ScalerState,
    StaticLossScaler,
    all_finite,
)
from mixprec.scaling.health import ScalerHealth
from mixprec.trace import Overflow
from mixprec.train import (
    EMA,
    Callback,
    CSVLogger,
    EarlyStopping,
    History,
    LearningRateScheduler,
    LossMonitor,
    ModelCheckpoint,
    ProgressBar,
    TensorBoard,
    Trainer,
    TrainStep,
    build_train_step,
)

__all__ = [
    "EMA",
    "LEVELS",
    "ArgumentError",
    "CSVLogger",
    "Callback",
    "CheckpointError",
    "CompensatedAdamW",
    "DynamicLossScaleManager",
    "DynamicLossScaler",
    "EarlyStopping",
    "ExponentialUpdateLossScaleManager",
    "Float8LayerReport",
    "Float8Options",
    "Float8Report",
    "GradScaler",
    "History",
    "LearningRateScheduler",
    "LoadReport",
    "LossMonitor",
    "LossScaleOptimizer",
    "LossScaler",
    "MisuseError",
    "ModelCheckpoint",
    "ModuleReport",
    "NoOpLossScaler",
    "Overflow",
    "Plan",
    "Policy",
    "ProgressBar",
    "Report",
    "ScalerHealth",
    "ScalerState",
    "StaticLossScaler",
    "StepResult",
    "TensorBoard",
    "TrainStep",
    "Trainer",
    "__version__",
    "activation_checkpoint",
    "all_finite",
    "auto_mixed_precision",
    "autotune",
    "build_train_step",
    "cast_floating",
    "checkpoint_context",
    "convert_checkpoint",
    "cross_entropy",
    "data",
    "describe",
    "diagnose",
    "diagnose_float8",
    "distributed",
    "export_weights",
    "get_policy",
    "global_policy",
    "load_checkpoint",
    "losses",
    "models",
    "module_dtypes",
    "policy_scope",
    "read_checkpoint",
    "release_float32_copies",
    "save_checkpoint",
    "set_global_policy",
    "split_embedding_parameters",
    "stochastic_round",
    "to_float",
]
