"""Callbacks that record training: ``CSVLogger`` (a row per epoch) and ``TensorBoard``
(scalars per step and per epoch). A resumed ``fit`` continues their records rather than
starting them over."""

from __future__ import annotations

import csv
import os
from pathlib import Path
from typing import Any

from mixprec._errors import ArgumentError, check_path
from mixprec.train.callbacks import Callback, Logs

__all__ = ["CSVLogger", "TensorBoard"]


class CSVLogger(Callback):
    """One CSV row per epoch: ``epoch`` and every epoch log. A new ``fit`` starts the file
    afresh unless ``append`` (Keras' keyword); a resumed one (``fit(resume_from=...)``)
    keeps the rows of the epochs before the one it resumes in, and adds its own."""

    rank_zero_only = True  # under torchrun, only rank 0 prints and writes

    def __init__(
        self, filename: str | os.PathLike[str], separator: str = ",", append: bool = False
    ) -> None:
        check_path("CSVLogger", "filename", filename, "file")
        if not (isinstance(separator, str) and len(separator) == 1):  # as csv requires
            raise ArgumentError(
                f"CSVLogger(separator={separator!r}) is invalid; valid: one character"
            )
        if not isinstance(append, bool):
            raise ArgumentError(f"CSVLogger(append={append!r}) is invalid; valid: True or False")
        self.filename = Path(filename)
        self.separator = separator
        self.append = append
        self._keys: list[str] | None = None

    def on_train_begin(self, logs: Logs) -> None:
        self._keys = None
        self.filename.parent.mkdir(parents=True, exist_ok=True)
        resumed_at = int(logs.get("initial_epoch", 0))
        rows: list[list[str]] = []
        if (self.append or resumed_at) and self.filename.exists():
            with self.filename.open(newline="") as f:
                rows = list(csv.reader(f, delimiter=self.separator))
        if rows and resumed_at:
            # Rows of the epoch resumed in and after it (written after the checkpoint) go:
            # the resumed run writes them again.
            rows = rows[:1] + [
                r for r in rows[1:] if r and r[0].isdigit() and int(r[0]) < resumed_at
            ]
        with self.filename.open("w", newline="") as f:
            csv.writer(f, delimiter=self.separator).writerows(rows)
        if rows:
            self._keys = [k for k in rows[0] if k != "epoch"]

    def on_epoch_end(self, epoch: int, logs: Logs) -> None:
        with self.filename.open("a", newline="") as f:
            writer = csv.writer(f, delimiter=self.separator)
            if self._keys is None:
                self._keys = [k for k in logs if k != "epoch"]
                writer.writerow(["epoch", *self._keys])
            writer.writerow([epoch, *(logs.get(k, "") for k in self._keys)])


class TensorBoard(Callback):
    """Scalars for TensorBoard: per step loss, loss scale, skipped steps (inf/NaN; not
    accumulation micro-steps) and step time; per epoch every epoch log. A resumed ``fit``
    continues the step axis and the skip count. Needs the ``tensorboard`` package
    (``mixprec[tensorboard]``)."""

    rank_zero_only = True  # under torchrun, only rank 0 prints and writes

    def __init__(self, log_dir: str | os.PathLike[str] = "runs") -> None:
        check_path("TensorBoard", "log_dir", log_dir, "folder")  # None made ./None
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError as err:  # pragma: no cover - depends on the environment
            raise ImportError(
                "TensorBoard callback needs the tensorboard package: "
                'pip install "mixprec[tensorboard]"'
            ) from err
        self._writer_cls = SummaryWriter
        self.log_dir = str(log_dir)
        self._writer: Any = None
        self._step = 0
        self._skipped = 0

    def on_train_begin(self, logs: Logs) -> None:
        # A fit that raised (Ctrl-C in a notebook) never reached on_train_end: its writer,
        # and the writer's thread, would outlive it, one more at each such fit.
        self.on_train_end({})
        self._writer = self._writer_cls(self.log_dir)

    def on_train_batch_end(self, step: int, logs: Logs) -> None:
        self._step += 1
        self._skipped += int(bool(logs["found_inf"]))
        for key, value in (
            ("train/loss", logs["loss"]),
            ("train/loss_scale", logs["loss_scale"]),
            ("train/skipped_steps", self._skipped),
            ("train/step_ms", logs["step_ms"]),
        ):
            self._writer.add_scalar(key, value, self._step)

    def on_epoch_end(self, epoch: int, logs: Logs) -> None:
        for key, value in logs.items():
            if isinstance(value, (int, float)) and key != "epoch":
                self._writer.add_scalar(f"epoch/{key}", value, epoch)
        self._writer.flush()

    def on_train_end(self, logs: Logs) -> None:
        if self._writer is not None:
            self._writer.close()
            self._writer = None

    def state_dict(self) -> dict[str, Any]:
        return {"step": self._step, "skipped": self._skipped}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._step, self._skipped = int(state["step"]), int(state["skipped"])
