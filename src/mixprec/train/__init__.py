"""The high-level training workflow: ``Trainer`` (``trainer``), one training step
(``step``), the data's batches (``batches``), callbacks (``callbacks``, ``loggers``,
``monitors``, ``schedules``), where a resumed ``fit`` starts (``resume``), metrics and
losses by name (``metrics``), optimizers by Keras name (``optimizers``) and warnings
located at the user's line (``warn``)."""

from mixprec.train.callbacks import Callback, History, LossMonitor, ProgressBar
from mixprec.train.loggers import CSVLogger, TensorBoard
from mixprec.train.monitors import EarlyStopping, ModelCheckpoint
from mixprec.train.schedules import EMA, LearningRateScheduler
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
