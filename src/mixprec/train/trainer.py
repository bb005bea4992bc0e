"""``Trainer``: Keras ``fit``/``evaluate``/``predict`` and MindSpore ``Model.train``.

Composition only: the step is ``build_train_step`` (``auto_mixed_precision`` and
``LossScaleOptimizer``), the data and its batches come from ``batches``, the loss scaler's
health from ``ScalerHealth``, and everything around the loop (logs, checkpoints, schedulers)
is a callback.
"""

from __future__ import annotations

import copy
import functools
import os
import time
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import torch
from torch import nn

from mixprec import distributed
from mixprec._compile import CompileOption, compile_options
from mixprec._device import resolve_device
from mixprec._errors import ArgumentError, check_module
from mixprec._plan_apply import PlanLike
from mixprec.levels import applied
from mixprec.optim import StepResult
from mixprec.policy import PolicyLike
from mixprec.scaling import LossScaler
from mixprec.scaling.health import ScalerHealth, scale_floor
from mixprec.trace import Overflow, OverflowTracer
from mixprec.train import batches, evaluation, resume
from mixprec.train.batch_end import finish_batch, finish_raised_step, step_checkpoint_due
from mixprec.train.batches import Batch
from mixprec.train.callbacks import (
    Callback,
    CallbackList,
    History,
    Logs,
    ProgressBar,
    given_callbacks,
)
from mixprec.train.interrupts import GroupStart, HeldInterrupt
from mixprec.train.label_errors import raise_if_about_labels
from mixprec.train.meter import EpochMeter
from mixprec.train.metrics import (
    LossFn,
    Metric,
    get_loss,
    get_metrics,
    say_if_probabilities,
    weigh_for,
)
from mixprec.train.read_ahead import ReadAhead, first_read_under
from mixprec.train.step import build_train_step
from mixprec.train.validation import split_validation
from mixprec.train.warn import warn


def _gather_rank_rng(trainer: Trainer, batch_logs: Logs | None) -> None:
    """Under torchrun, before the checkpoint writers of an epoch's end (``None``) or of a
    step checkpoint's step: every rank's RNG states as they are then, so that a resume
    gives each rank its own."""
    if batch_logs is None or step_checkpoint_due(trainer, batch_logs["applied"]):
        ahead = trainer._ahead.before_next if trainer._ahead is not None else None
        trainer._rank_rng.gather(_position(trainer), trainer._epoch_rng, ahead)


def _position(trainer: Trainer) -> tuple[int, ...]:
    """Where training stands, as ``resume_state`` says it."""
    t = trainer
    return (t.global_step, t._epoch, t._step_in_epoch, int(t._epoch_done))


def _check_arguments(model: Any, fp32_allreduce: Any, device: Any) -> None:
    """What the Trainer's constructor refuses before it changes anything."""
    check_module("Trainer", model)
    # (torch's own error, later: "Cannot access accelerator device when none is available")
    cuda = device != "auto" and resolve_device(device).type == "cuda"
    if cuda and not torch.cuda.is_available():
        raise ArgumentError(f"device={device!r} is invalid here: no CUDA GPU is available")
    if not isinstance(fp32_allreduce, bool):
        raise ArgumentError(f"fp32_allreduce must be True or False, got {fp32_allreduce!r}")


def _check_state(state: Any) -> None:
    """What ``Trainer.load_state_dict`` refuses before it loads anything: a state without
    the keys ``state_dict`` writes (``{}`` raised a bare KeyError: 'model')."""
    keys = ("model", "optimizer", "global_step")
    missing = [k for k in keys if k not in state] if isinstance(state, dict) else list(keys)
    if missing:
        raise ArgumentError(
            f"Trainer.load_state_dict: not a Trainer state (from trainer.state_dict()); "
            f"missing {', '.join(missing)}"
        )


class _HealthWatch:
    """The loss scaler's health over the run, fed after every optimizer step, and the tracer
    it asks for: installed for one step when the run is stuck without a module named (not
    under compile, where module hooks do nothing)."""

    def __init__(self, health: ScalerHealth, model: nn.Module, can_trace: bool) -> None:
        self.health = health
        self.model = model
        self.can_trace = can_trace
        self._stuck_tracer: OverflowTracer | None = None

    def observe(self, result: StepResult, scaler: LossScaler, loss: float) -> None:
        """Warn when the health check says so; trace the next step when it asks."""
        traced = self._stuck_tracer is not None  # read before culprit() removes it
        warning = self.health.observe(
            scaler.state,
            bool(result.found_inf),
            self.culprit(result),
            scale_floor(scaler),
            loss,
            traced=traced,
        )
        if warning:
            warn(warning)
        if self.health.needs_trace and self.can_trace:
            self._stuck_tracer = OverflowTracer(self.model)  # for the next step only

    def culprit(self, result: StepResult | None) -> Overflow | None:
        """The step's first non-finite module: from ``trace_overflow``, or from the tracer
        the health check asked for (installed after the previous step, removed now)."""
        tracer, self._stuck_tracer = self._stuck_tracer, None
        found = None if result is None else result.overflow
        if tracer is not None:
            if found is None and result is not None and result.found_inf:
                found = tracer.first_overflow()
            tracer.remove()
        return found


class Trainer:
    """Train a float32-built model and optimizer in mixed precision.

    ``Trainer(model, loss, optimizer, policy="mixed_bfloat16")`` applies the policy and level
    to ``model`` (in place) and wraps ``optimizer`` in a ``LossScaleOptimizer``. ``optimizer``
    may be a Keras name (``"adam"``, ``"sgd"``...) with Keras' defaults; ``amp_level`` is
    MindSpore's keyword for the level, as ``auto_mixed_precision`` takes it; ``plan`` an
    ``mp.autotune`` plan in their place. ``compile``
    (``True`` or a dict of ``torch.compile`` options) compiles each training step's forward
    and loss; evaluation and prediction run the model as it is. With ``accumulation_steps``,
    the last micro-steps of an epoch are applied at its end, as their mean.
    """

    def __init__(
        self,
        model: nn.Module,
        loss: str | LossFn,
        optimizer: torch.optim.Optimizer | str,
        policy: PolicyLike = None,
        level: str = "auto",
        loss_scaler: LossScaler | None = None,
        metrics: Sequence[str | Metric] | Mapping[str, str | Metric] = ("accuracy",),
        device: str | torch.device = "auto",
        max_grad_norm: float | None = None,
        accumulation_steps: int = 1,
        trace_overflow: bool = False,
        fp32_allreduce: bool = False,
        compile: CompileOption = False,
        *,
        amp_level: str | None = None,
        plan: PlanLike | None = None,
    ) -> None:
        _check_arguments(model, fp32_allreduce, device)
        # torchrun's process group first: it picks this rank's GPU (False outside torchrun).
        self.distributed = distributed.init_from_env()
        self.device = resolve_device(device)
        model.to(self.device)  # before the dtype changes, so kept float32 copies live there too
        self.loss_fn = get_loss(loss)
        say_if_probabilities(model, self.loss_fn, loss)
        self.metrics: dict[str, Metric] = get_metrics(metrics, self.loss_fn)
        self.step = build_train_step(
            model,
            optimizer,
            self.loss_fn,
            policy,
            level,
            loss_scaler,
            max_grad_norm,
            accumulation_steps,
            trace_overflow,
            compile,
            amp_level=amp_level,
            plan=plan,
        )
        self.health = ScalerHealth()
        self._watch = _HealthWatch(self.health, model, compile_options(compile) is None)
        self.model = model  # the module itself; under torchrun the step runs it through DDP
        self.optimizer = self.step.optimizer
        # The Trainer watches the scale itself (with a traced culprit and the loss): one warning.
        self.optimizer.health = None
        if self.distributed:  # DDP; every rank starts from rank 0's weights and masters
            self.step.model = distributed.distributed_data_parallel(
                model, self.optimizer, fp32_allreduce=fp32_allreduce
            )
        self.global_step = 0  # applied optimizer steps
        self.stop_training = False
        self._epoch, self._step_in_epoch, self._epoch_done = 0, 0, False
        self._epoch_rng = torch.get_rng_state()
        self._rank_rng = resume.RankRng()  # under torchrun, for checkpoints
        self._meter: EpochMeter | None = None  # the running epoch's
        self._ahead: ReadAhead | None = None  # its reader, with accumulation
        self._callbacks: dict[str, Callback] = {}  # this fit's, by key (resume.keyed)
        self._data: dict[str, Any] = {}  # this fit's epoch shape (resume.data_shape)

    @property
    def policy(self) -> Any:
        done = applied(self.model)
        return done.policy if done else None

    def _validate(self, x: Any, y: Any) -> None:
        batches.validate(x, y, self.loss_fn, functools.partial(evaluation.count_classes, self))

    # -- fit --------------------------------------------------------------------------------

    def fit(
        self,
        x: Any,
        y: Any = None,
        batch_size: int = 32,
        epochs: int = 1,
        validation_split: float = 0.0,
        validation_data: tuple[Any, Any] | None = None,
        shuffle: bool = True,
        callbacks: Iterable[Callback] = (),
        verbose: int = 1,
        resume_from: str | os.PathLike[str] | None = None,
    ) -> History:
        """Train for ``epochs`` on tensors/arrays ``(x, y)`` or an iterable of batches ``x``.

        ``validation_split`` holds out the last fraction of ``(x, y)`` before shuffling, as
        Keras does. ``resume_from`` loads a checkpoint written by ``ModelCheckpoint`` or
        ``save_checkpoint(..., trainer_state=trainer.resume_state())`` and continues where it
        stopped, up to ``epochs`` in all, with the same batches and random numbers as an
        uninterrupted run: the batch order, the epoch's sums so far and the callbacks'
        state (``Callback.state_dict``). Returns the ``History`` of the epochs run now.
        ``validation_data`` overrides ``validation_split``, as in Keras (said in a warning)."""
        if isinstance(epochs, bool) or not isinstance(epochs, int) or epochs < 0:
            raise ArgumentError(f"epochs={epochs!r} is invalid; it must be an int >= 0")
        x, y, validation_data = split_validation(x, y, validation_split, validation_data)
        self._validate(x, y)
        self._weigh = weigh_for(self.loss_fn, None if y is None else batches.as_tensor(y, "y"))
        if validation_data is not None:
            self._validate(*validation_data)
        batches.check_ranks_agree(x, y, batch_size, epochs, validation_data, resume_from)
        batches.drop_unfinished_group(self.optimizer)
        one_epoch, steps, _ = batches.epoch_batches(x, y, batch_size, shuffle, device=self.device)
        self._data = resume.data_shape(x, y, batch_size, shuffle, steps)
        point = resume.ResumePoint(self.global_step, 0)
        if resume_from is not None:
            point = resume.read(resume_from, self.model, self.optimizer, self._data)
            self.global_step = point.global_step
            self.step.resumed_at(self.optimizer.loss_scaler.state.steps)  # skipped too
            resume.check_ranks_resumed_alike(point, self.model)

        history = History()
        chosen = [history, *([ProgressBar()] if verbose else []), *given_callbacks(callbacks)]
        self._callbacks = resume.keyed(chosen)
        self._sync_cadences = resume.ranks_sync_sums(self._callbacks)
        if not distributed.is_main_process():  # bars, logs and checkpoints on rank 0 only
            chosen = [cb for cb in chosen if not getattr(cb, "rank_zero_only", False)]
        cbs = CallbackList(chosen)
        if self.distributed:  # no call per batch outside torchrun
            cbs.before_writers = functools.partial(_gather_rank_rng, self)
        cbs.set_trainer(self)
        self.stop_training = False
        cbs.on_train_begin({"epochs": epochs, "steps": steps, "initial_epoch": point.epoch})
        if resume_from is not None:
            resume.restore_callbacks(self._callbacks, chosen, point.callbacks)
        last = point.epoch if self.stop_training else epochs  # resumed into an early stop
        for epoch in range(point.epoch, last):
            skip = point.skip if point.replay is not None else 0  # batches done before
            cbs.on_epoch_begin(epoch, {"steps": steps, "initial_step": skip})
            if point.replay is not None:  # the interrupted epoch: its order, its sums
                self._epoch_rng = point.replay
                batches.set_sampler_epoch(x, epoch)
                replayed = resume.replay_epoch(one_epoch, point.replay, point.skip, x, epoch)
                epoch_data = first_read_under(replayed, point.ahead)  # read ahead: as it was
                meter, point.replay = point.meter, None
            else:
                self._epoch_rng, meter = torch.get_rng_state(), None
                batches.set_sampler_epoch(x, epoch)
                epoch_data = iter(one_epoch())
            logs = self._run_epoch(epoch, epoch_data, cbs, skip, meter)
            if validation_data is not None:
                val = self.evaluate(*validation_data, batch_size=batch_size)
                logs.update({f"val_{k}": v for k, v in val.items()})
            # From here a checkpoint resumes in the next epoch; a state taken before (the
            # validation interrupted) resumes into this epoch's end, which then runs again.
            self._epoch_done = True
            cbs.on_epoch_end(epoch, logs)
            if self._agreed_stop():
                break
        cbs.on_train_end({})
        distributed.barrier()  # rank 0's checkpoints are written when any rank returns
        return history

    def _run_epoch(
        self,
        epoch: int,
        epoch_data: Iterable[Batch],
        cbs: Callback,
        first_step: int = 0,
        sums: dict[str, Any] | None = None,
    ) -> Logs:
        self.model.train()
        self._epoch, self._step_in_epoch, self._epoch_done = epoch, first_step, False
        meter = self._meter = EpochMeter(self.metrics, self._weigh)
        if sums is not None:  # a resumed epoch: its logs cover the batches before too
            meter.load_state_dict(sums)
        accumulates = self.optimizer.accumulation_steps > 1  # last batch ends the group
        ahead = self._ahead = ReadAhead(epoch_data, batches.is_empty) if accumulates else None
        marked = ahead if ahead is not None else ((batch, False) for batch in epoch_data)
        group, held = GroupStart(self.optimizer), HeldInterrupt()
        try:
            held.install()  # Ctrl-C over a batch's bookkeeping waits (interrupts.py)
            for step, (batch, last) in enumerate(marked, start=first_step):
                xb, yb = batches.xy(batch, self.device)
                if batches.skip_empty(yb, epoch, step):
                    self._step_in_epoch = step + 1
                    continue
                group.note(step, meter)
                where = (epoch, step, time.perf_counter())
                try:
                    loss, result = self.step(xb, yb, flush=last)
                except BaseException as err:
                    # A step that went in before it raised is done, with its bookkeeping;
                    # else its accumulation group goes whole (rewound).
                    if not finish_raised_step(self, cbs, meter, where, yb):
                        self._step_in_epoch = group.rewind(step, meter)
                        raise_if_about_labels(err, yb, epoch, step)  # first seen here: named
                    raise
                # Done once it returned (resumed at this batch if it raised); from here to
                # the batch's callbacks, Ctrl-C waits (interrupts.HeldInterrupt).
                held.hold()
                finish_batch(self, cbs, meter, where, loss, result, yb)
                held.release(group.rewind_pending, self, step, meter)
                # Asked by a callback (Keras: after this batch); an accumulation group ends
                # first, or its gradients would be left for the next fit to add to.
                if self._agreed_stop() and not self.optimizer.pending_micro_steps:
                    break
        finally:
            held.uninstall()  # also where a callback raised: its error goes on
            # A tracer left for a next step: no hooks outlive the epoch, also when a
            # step raises (the scaler's max_consecutive_skips, Ctrl-C, a callback).
            self._watch.culprit(None)
        return meter.logs(self.optimizer.loss_scaler.get_scale())

    def _agreed_stop(self) -> bool:
        """``stop_training``, agreed by every rank under torchrun (one small all-reduce): a
        rank that stopped alone left the others in DDP's all-reduce, a raw gloo abort or a
        hang (a callback's own condition, or a monitor of a rank's own timings)."""
        if self.distributed:
            self.stop_training = distributed.all_reduce_sum([float(self.stop_training)])[0] > 0
        return self.stop_training

    # -- evaluate / predict -----------------------------------------------------------------

    def evaluate(self, x: Any, y: Any = None, batch_size: int = 32) -> dict[str, float]:
        """Mean loss and metrics over ``(x, y)`` or an iterable of batches."""
        self._validate(x, y)
        return evaluation.evaluate(self, x, y, batch_size)

    def predict(self, x: Any, batch_size: int = 32) -> torch.Tensor:
        """The model's outputs in float32, on the CPU, for tensors/arrays or batches."""
        return evaluation.predict(self.model, self.device, x, batch_size)

    # -- MindSpore style --------------------------------------------------------------------

    def train(
        self, epoch: int, train_dataset: Iterable[Batch], callbacks: Iterable[Callback] = ()
    ) -> History:
        """MindSpore's ``Model.train(epoch, train_dataset, callbacks=[LossMonitor()])``."""
        return self.fit(train_dataset, epochs=epoch, callbacks=callbacks, verbose=0)

    # -- state ------------------------------------------------------------------------------

    def resume_state(self) -> dict[str, Any]:
        """Where training stands, for ``fit(resume_from=...)``: applied steps, epoch,
        batches done and whether it ended, the RNG states its order was drawn from and
        from before the batch read ahead (``read_ahead``), its sums so far, this ``fit``'s
        callbacks' states; under torchrun every rank's RNG states where ranks differ
        (``rank_rng``), where ``ModelCheckpoint`` writes (epoch ends, ``every_n_steps``)."""
        running = self._meter is not None and not self._epoch_done
        return {
            "ahead_rng": self._ahead.before_next if running and self._ahead else None,
            "global_step": self.global_step,
            "epoch": self._epoch,
            "step_in_epoch": self._step_in_epoch,
            "epoch_done": self._epoch_done,
            "epoch_rng": self._epoch_rng,
            "meter": self._meter.state_dict() if running else None,  # type: ignore[union-attr]
            "callbacks": resume.callback_states(self._callbacks),
            "rank_rng": self._rank_rng.at(_position(self)),  # None: rank 0's stands
            "data": self._data,  # what step_in_epoch counts batches of
        }

    def state_dict(self) -> dict[str, Any]:
        """Model, optimizer (inner states, float32 masters, loss scaler) and step counter."""
        return {
            "model": {k: v.detach().clone() for k, v in self.model.state_dict().items()},
            "optimizer": copy.deepcopy(self.optimizer.state_dict()),
            "global_step": self.global_step,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """All or nothing: a state whose model or optimizer part does not fit leaves the
        model as it was (torch's load had replaced the tensors before the bad one, or the
        whole model before the optimizer's part was refused, unsaid)."""
        _check_state(state)
        step = int(state["global_step"])
        kept = {k: v.detach().clone() for k, v in self.model.state_dict().items()}
        try:
            self.model.load_state_dict(state["model"])
            self.optimizer.load_state_dict(state["optimizer"])
        except BaseException:
            # The 16-bit weights back as their masters' rounding: the masters keep theirs.
            self.model.load_state_dict(kept)
            raise
        self.global_step = step
