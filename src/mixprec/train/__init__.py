"""The high-level training workflow: ``Trainer``, ``build_train_step`` and callbacks."""

from mixprec.train.callbacks import (
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
)
from mixprec.train.trainer import Trainer, TrainStep, build_train_step

__all__ = [
    "EMA",
    "CSVLogger",
    "Callback",
    "EarlyStopping",
    "History",
    "LearningRateScheduler",
    "LossMonitor",
    "ModelCheckpoint",
    "ProgressBar",
    "TensorBoard",
    "TrainStep",
    "Trainer",
    "build_train_step",
]
