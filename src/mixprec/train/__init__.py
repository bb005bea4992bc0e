"""The high-level training workflow: ``Trainer`` (``trainer``), one training step
(``step``), the data's batches (``batches``), callbacks (``callbacks``), metrics and
losses by name (``metrics``), optimizers by Keras name (``optimizers``) and warnings
located at the user's line (``warn``)."""

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
from mixprec.train.step import TrainStep, build_train_step
from mixprec.train.trainer import Trainer

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
