"""``Trainer`` (Keras ``fit``/``evaluate``/``predict``, MindSpore ``Model.train``) and
``build_train_step`` (MindSpore ``build_train_network``).

Composition only: the numerics are ``auto_mixed_precision`` and ``LossScaleOptimizer``.
"""

from __future__ import annotations

import contextlib
import copy
import itertools
import os
import statistics
import time
import warnings
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

import torch
from torch import nn

from mixprec import distributed
from mixprec._calling import call
from mixprec._compile import CompileOption, compile_options, compile_step
from mixprec.checkpoint import load_checkpoint
from mixprec.data import validate_classification
from mixprec.levels import applied, auto_mixed_precision, resolve_level
from mixprec.optim import LossScaleOptimizer, StepResult
from mixprec.policy import PolicyLike, get_policy
from mixprec.scaling import LossScaler
from mixprec.scaling.health import ScalerHealth, scale_floor
from mixprec.trace import Overflow, OverflowTracer
from mixprec.train.callbacks import Callback, CallbackList, History, Logs, ProgressBar
from mixprec.train.metrics import LossFn, Metric, get_loss, get_metric

Batch = tuple[Any, torch.Tensor]


def _to(value: Any, device: torch.device) -> Any:
    if isinstance(value, torch.Tensor):
        return value.to(device, non_blocking=True)
    if isinstance(value, (tuple, list)):
        return type(value)(_to(v, device) for v in value)
    return value


class TrainStep:
    """One training step: zero grads, forward, loss, scaled backward, step.

    ``step(x, y) -> (loss, StepResult)``; the loss is detached and ``last_output`` holds the
    detached model output (for metrics). With ``compile``, the forward and the loss run as one
    ``torch.compile``'d function (so inductor fuses the output's upcast into the loss); the
    loss scaling and the optimizer step run outside the graph, so a new scale, a skipped step
    or an accumulation micro-step compile nothing new."""

    def __init__(
        self,
        model: nn.Module,
        optimizer: LossScaleOptimizer,
        loss_fn: LossFn,
        compile: CompileOption = False,
    ) -> None:
        self.model = model
        self.optimizer = optimizer
        self.loss_fn = loss_fn
        self.last_output: torch.Tensor | None = None
        options = compile_options(compile)
        self._forward_loss = (
            self._forward_and_loss
            if options is None
            else compile_step(self._forward_and_loss, options, model)
        )
        # Under CUDA graphs (reduce-overhead, max-autotune, the cudagraphs backend, inductor's
        # global or environment setting) the next replay overwrites this step's loss, and
        # torch raises where a caller kept it (a list of losses). Which options record graphs
        # is not all in `compile`: every compiled step copies its loss out (one value).
        self._copy_loss = options is not None

    def _forward_and_loss(self, x: Any, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        output = call(self.model, x)
        return self.loss_fn(output, y), output

    def __call__(self, x: Any, y: torch.Tensor) -> tuple[torch.Tensor, StepResult]:
        self.optimizer.zero_grad()
        loss, output = self._forward_loss(x, y)
        self.optimizer.backward(loss)
        result = self.optimizer.step()
        self.last_output = output.detach()
        return (loss.detach().clone() if self._copy_loss else loss.detach()), result


def build_train_step(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    loss_fn: str | LossFn,
    policy: PolicyLike = None,
    level: str = "auto",
    loss_scaler: LossScaler | None = None,
    max_grad_norm: float | None = None,
    accumulation_steps: int = 1,
    trace_overflow: bool = False,
    compile: CompileOption = False,
) -> TrainStep:
    """Prepare ``model`` (unless ``auto_mixed_precision`` was already applied) and wrap
    ``optimizer`` (unless it is a ``LossScaleOptimizer``); return the step callable.

    ``compile``: ``True`` or a dict of ``torch.compile`` options compiles the forward and
    the loss together (see ``TrainStep``)."""
    compile_options(compile)  # a bad value fails before the model is changed
    done = applied(model)
    if done is None:
        auto_mixed_precision(model, policy, level)
    elif (policy is not None and get_policy(policy) != done.policy) or (
        level != "auto" and resolve_level(level, done.policy) != done.level
    ):
        raise ValueError(
            f"the model was already prepared with policy {done.policy.name}, level "
            f"{done.level}; build_train_step(policy={policy!r}, level={level!r}) cannot change "
            "that: build the model again, or leave policy=None and level='auto'"
        )
    if not isinstance(optimizer, LossScaleOptimizer):
        optimizer = LossScaleOptimizer(
            optimizer, loss_scaler, max_grad_norm, accumulation_steps, trace_overflow
        )
    return TrainStep(model, optimizer, get_loss(loss_fn), compile)


def _device(device: str | torch.device) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def _length(data: Any) -> int:
    """``len(data)``: a tensor's or array's samples, a loader's batches; -1 where there is
    none (an iterable dataset's loader has ``__len__`` but raises ``TypeError``)."""
    try:
        return len(data)
    except TypeError:
        return -1


def _as_tensor(value: Any, name: str) -> torch.Tensor:
    if isinstance(value, torch.Tensor):
        return value
    try:
        return torch.as_tensor(value)
    except (TypeError, ValueError, RuntimeError) as err:
        raise TypeError(f"{name} must be a tensor or an array, got {type(value).__name__}") from err


class Trainer:
    """Train a float32-built model and optimizer in mixed precision.

    ``Trainer(model, loss, optimizer, policy="mixed_bfloat16")`` applies the policy and level
    to ``model`` (in place) and wraps ``optimizer`` in a ``LossScaleOptimizer``. ``compile``
    (``True`` or a dict of ``torch.compile`` options) compiles each training step's forward
    and loss; evaluation and prediction run the model as it is.
    """

    def __init__(
        self,
        model: nn.Module,
        loss: str | LossFn,
        optimizer: torch.optim.Optimizer,
        policy: PolicyLike = None,
        level: str = "auto",
        loss_scaler: LossScaler | None = None,
        metrics: Sequence[str | Metric] = ("accuracy",),
        device: str | torch.device = "auto",
        max_grad_norm: float | None = None,
        accumulation_steps: int = 1,
        trace_overflow: bool = False,
        fp32_allreduce: bool = False,
        compile: CompileOption = False,
    ) -> None:
        if not isinstance(model, nn.Module):
            raise TypeError(f"Trainer(model=...) needs an nn.Module, got {type(model).__name__}")
        self.device = _device(device)
        model.to(self.device)  # before the dtype changes, so kept float32 copies live there too
        self.loss_fn = get_loss(loss)
        self.metrics: dict[str, Metric] = dict(get_metric(m) for m in metrics)
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
        )
        self.health = ScalerHealth()
        # A tracer for one step, installed when the health check finds the run stuck without
        # a module named (not under compile, where module hooks do nothing).
        self._stuck_tracer: OverflowTracer | None = None
        self._can_trace = compile_options(compile) is None
        self.model = model  # the module itself; under torchrun the step runs it through DDP
        # Under torchrun: the process group from the environment, DDP around the prepared
        # model, every rank starting from rank 0's weights and float32 masters.
        self.distributed = distributed.init_from_env()  # False outside torchrun (WORLD_SIZE 1)
        self.optimizer = self.step.optimizer
        if self.distributed:
            self.step.model = distributed.distributed_data_parallel(
                model, self.optimizer, fp32_allreduce=fp32_allreduce
            )
        self.global_step = 0  # applied optimizer steps
        self.stop_training = False
        self._epoch, self._step_in_epoch = 0, 0
        self._epoch_rng = torch.get_rng_state()

    @property
    def policy(self) -> Any:
        done = applied(self.model)
        return done.policy if done else None

    # -- data -------------------------------------------------------------------------------

    def _batches(
        self, x: Any, y: Any, batch_size: int, shuffle: bool, split: bool = True
    ) -> tuple[Callable[[], Iterable[Batch]], int, int]:
        """A function giving one epoch of batches, the number of batches and of samples.

        With ``split`` (training) under torchrun, ``batch_size`` is the global batch and
        each rank gets its share of rank 0's order."""
        if y is None:  # an iterable of (inputs, targets) batches, e.g. a DataLoader
            if isinstance(x, torch.Tensor):
                raise ValueError("fit(x, y): y is missing; pass targets or a loader of batches")
            steps = max(_length(x), 0)
            # iter() now: a shuffling DataLoader draws its order from the RNG at this point.
            return (lambda: iter(x)), steps, 0
        if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
            raise ValueError(f"batch_size={batch_size!r} is invalid; it must be an int >= 1")
        xt, yt = _as_tensor(x, "x"), _as_tensor(y, "y")
        n = len(xt)
        split = split and distributed.world_size() > 1
        local = distributed.check_batch(batch_size) if split else batch_size

        def epoch() -> Iterable[Batch]:
            # The order is drawn now, not when iteration starts, so that resuming can
            # replay it from the RNG state saved at the start of the epoch.
            order = torch.randperm(n) if shuffle else torch.arange(n)
            # Every rank uses rank 0's order and takes its share, as DistributedSampler.
            if split:
                # Without shuffling the order is arange on every rank: nothing to broadcast.
                order = distributed.broadcast_(order) if shuffle else order
                order = distributed.shard(order, pad=shuffle)
            return ((xt[idx], yt[idx]) for idx in order.split(local))

        per_rank = -(-n // distributed.world_size()) if split else n
        return epoch, -(-per_rank // local), n

    @staticmethod
    def _check_ranks_agree(
        x: Any, y: Any, batch_size: int, epochs: int, validation_data: Any
    ) -> None:
        """Under torchrun every rank must pass the same data sizes: ranks with different
        numbers of steps would run different collectives and die in the backend's raw
        "collective mismatch" abort, on one rank and after a timeout."""
        if distributed.world_size() == 1:
            return
        # Samples (tensors and arrays, checked by _validate) or a loader's batches.
        sizes = {
            "samples_or_batches": _length(x),
            "batch_size": -1 if y is None else batch_size,
            "epochs": epochs,
            "validation_samples": -1 if validation_data is None else _length(validation_data[0]),
        }
        distributed.check_same_on_every_rank(
            "fit()'s data sizes",
            sizes,
            "every rank must pass the same global data, batch_size and epochs (the Trainer "
            "deals each rank its share), or loaders of the same length",
        )

    def _validate(self, x: Any, y: Any) -> None:
        if y is None:
            return
        xt, yt = _as_tensor(x, "x"), _as_tensor(y, "y")
        classes = None
        if self.loss_fn is get_loss("cross_entropy") and len(xt) > 0:
            # One sample in eval mode tells the number of classes (train mode would update
            # BatchNorm statistics and reject a batch of one).
            with torch.no_grad(), self._eval_mode():
                classes = int(call(self.model, _to(xt[:2], self.device)).shape[-1])
        if self.loss_fn is get_loss("cross_entropy") or not yt.is_floating_point():
            validate_classification(xt, yt, classes)
        elif len(xt) == 0:
            raise ValueError("data is empty: 0 samples")

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
        uninterrupted run. Returns the ``History`` of the epochs run now."""
        if isinstance(epochs, bool) or not isinstance(epochs, int) or epochs < 0:
            raise ValueError(f"epochs={epochs!r} is invalid; it must be an int >= 0")
        if not 0.0 <= validation_split < 1.0:
            raise ValueError(f"validation_split={validation_split!r} is invalid; use [0, 1)")
        if validation_split and y is None:
            raise ValueError("validation_split needs tensors or arrays (x, y), not a loader")
        if validation_split:
            xt, yt = _as_tensor(x, "x"), _as_tensor(y, "y")
            cut = len(xt) - int(len(xt) * validation_split)
            x, y, validation_data = xt[:cut], yt[:cut], (xt[cut:], yt[cut:])
        self._validate(x, y)
        if validation_data is not None:
            self._validate(*validation_data)
        self._check_ranks_agree(x, y, batch_size, epochs, validation_data)
        epoch_batches, steps, _ = self._batches(x, y, batch_size, shuffle)
        start_epoch, skip, replay = 0, 0, None
        if resume_from is not None:
            state = load_checkpoint(
                resume_from, self.model, self.optimizer, restore_rng=True
            ).trainer_state
            self.global_step = int(state.get("global_step", 0))
            start_epoch, skip = int(state.get("epoch", 0)), int(state.get("step_in_epoch", 0))
            replay = state.get("epoch_rng")
            if replay is None or (steps and skip >= steps):  # saved at the end of an epoch
                start_epoch, skip, replay = start_epoch + (skip > 0), 0, None

        history = History()
        extra = [ProgressBar()] if verbose else []
        chosen = [history, *extra, *callbacks]
        if not distributed.is_main_process():  # bars, logs and checkpoints on rank 0 only
            chosen = [cb for cb in chosen if not getattr(cb, "rank_zero_only", False)]
        cbs = CallbackList(chosen)
        cbs.set_trainer(self)
        self.stop_training = False
        cbs.on_train_begin({"epochs": epochs, "steps": steps})
        for epoch in range(start_epoch, epochs):
            cbs.on_epoch_begin(epoch, {"steps": steps})
            if replay is not None:  # the interrupted epoch: same order, then same RNG stream
                now = torch.get_rng_state()
                torch.set_rng_state(replay)
                self._epoch_rng = replay
                batches: Iterable[Batch] = itertools.islice(epoch_batches(), skip, None)
                torch.set_rng_state(now)
                replay = None
            else:
                self._epoch_rng = torch.get_rng_state()
                batches, skip = epoch_batches(), 0
            logs = self._run_epoch(epoch, batches, cbs, first_step=skip)
            if validation_data is not None:
                val = self.evaluate(*validation_data, batch_size=batch_size)
                logs.update({f"val_{k}": v for k, v in val.items()})
            cbs.on_epoch_end(epoch, logs)
            if self.stop_training:
                break
        cbs.on_train_end({})
        return history

    def _run_epoch(
        self, epoch: int, batches: Iterable[Batch], cbs: Callback, first_step: int = 0
    ) -> Logs:
        self.model.train()
        self._epoch = epoch
        loss_sum, samples, skipped = 0.0, 0, 0
        # Metric sums stay device tensors: reading them per batch would add host syncs to the
        # step; they are read once, at the end of the epoch.
        metric_sums: dict[str, torch.Tensor | float] = dict.fromkeys(self.metrics, 0.0)
        times: list[float] = []
        start_epoch = time.perf_counter()
        try:
            for step, batch in enumerate(batches, start=first_step):
                self._step_in_epoch = step + 1
                xb, yb = _to(batch[0], self.device), _to(batch[1], self.device)
                if _is_empty(yb):
                    # Its mean loss is NaN and it would count as a step: not a batch to train on.
                    if distributed.world_size() > 1:
                        raise ValueError(
                            f"epoch {epoch + 1}, batch {step + 1} is empty on rank "
                            f"{distributed.rank()}; "
                            "every rank must get a non-empty batch at every step"
                        )
                    warnings.warn(
                        f"epoch {epoch + 1}, batch {step + 1} is empty: skipped (not a step)",
                        UserWarning,
                        stacklevel=2,
                    )
                    continue
                start = time.perf_counter()
                try:
                    loss, result = self.step(xb, yb)
                except IndexError as err:
                    # A loader's labels are seen only here; tensors are checked up front
                    # (_validate) with a ValueError, so a loader's get one too.
                    if "out of bounds" not in str(err):
                        raise
                    raise ValueError(
                        f"epoch {epoch + 1}, batch {step + 1}: {err} (class labels must be in "
                        "[0, number of classes), or the loss's ignore_index)"
                    ) from err
                loss_value = loss.item()  # after the step's own sync: no extra stall
                elapsed = time.perf_counter() - start
                size = len(yb)
                if not result.accumulating:
                    times.append(elapsed)
                if result.applied:
                    self.global_step += 1
                skipped += int(result.found_inf)
                if not result.accumulating:
                    scaler = self.optimizer.loss_scaler
                    warning = self.health.observe(
                        scaler.state,
                        result.found_inf,
                        self._culprit(result),
                        scale_floor(scaler),
                        loss_value,
                    )
                    if warning:
                        warnings.warn(warning, UserWarning, stacklevel=2)
                    if self.health.needs_trace and self._can_trace:
                        self._stuck_tracer = OverflowTracer(self.model)  # for the next step only
                loss_sum += loss_value * size
                samples += size
                output = self.step.last_output
                if output is not None:
                    with torch.no_grad():
                        for name, fn in self.metrics.items():
                            metric_sums[name] = metric_sums[name] + fn(output.float(), yb) * size
                cbs.on_train_batch_end(
                    step,
                    {
                        "epoch": epoch,
                        "loss": loss_value,
                        "applied": result.applied,
                        "found_inf": result.found_inf,
                        "loss_scale": result.scale,
                        "step_ms": 1000 * elapsed,
                        "size": size,
                        "global_step": self.global_step,
                        "overflow": str(result.overflow) if result.overflow else None,
                    },
                )
        finally:
            # A tracer left for a next step: no hooks outlive the epoch, also when a
            # step raises (the scaler's max_consecutive_skips, Ctrl-C, a callback).
            self._culprit(None)
        if samples == 0:
            raise ValueError("the training data produced no batches")
        # Means over every rank's samples.
        sums = distributed.all_reduce_sum(
            [loss_sum, samples, *(float(v) for v in metric_sums.values())]
        )
        loss_sum, samples = sums[0], int(sums[1])
        metric_sums = dict(zip(metric_sums, sums[2:], strict=True))
        total = time.perf_counter() - start_epoch
        return {
            "loss": loss_sum / samples,
            **{name: value / samples for name, value in metric_sums.items()},
            "ms_per_step": 1000 * statistics.median(times) if times else float("nan"),
            "samples_per_s": samples / total,
            "loss_scale": self.optimizer.loss_scaler.get_scale(),
            "skipped_steps": skipped,
        }

    def _culprit(self, result: StepResult | None) -> Overflow | None:
        """The step's first non-finite module: from ``trace_overflow``, or from the tracer
        the health check asked for (installed after the previous step, removed now)."""
        tracer, self._stuck_tracer = self._stuck_tracer, None
        found = None if result is None else result.overflow
        if tracer is not None:
            if found is None and result is not None and result.found_inf:
                found = tracer.first_overflow()
            tracer.remove()
        return found

    # -- evaluate / predict -----------------------------------------------------------------

    @contextlib.contextmanager
    def _eval_mode(self) -> Iterator[None]:
        """Evaluation mode, then the mode the model was in: ``evaluate`` called from a
        callback mid-epoch must not leave dropout off for the rest of the epoch."""
        was_training = self.model.training
        self.model.eval()
        try:
            yield
        finally:
            self.model.train(was_training)

    def evaluate(self, x: Any, y: Any = None, batch_size: int = 32) -> dict[str, float]:
        """Mean loss and metrics over ``(x, y)`` or an iterable of batches."""
        self._validate(x, y)
        if y is not None and distributed.world_size() > 1:  # each rank evaluates its share
            xt, yt = _as_tensor(x, "x"), _as_tensor(y, "y")
            mine = distributed.shard(torch.arange(len(xt)), pad=False)
            x, y = xt[mine], yt[mine]
        epoch_batches, _, _ = self._batches(x, y, batch_size, shuffle=False, split=False)
        sums = dict.fromkeys(["loss", *self.metrics], 0.0)
        samples = 0
        with torch.no_grad(), self._eval_mode():
            for batch in epoch_batches():
                xb, yb = _to(batch[0], self.device), _to(batch[1], self.device)
                output = call(self.model, xb).float()
                size = len(yb)
                sums["loss"] += float(self.loss_fn(output, yb)) * size
                for name, fn in self.metrics.items():
                    sums[name] += float(fn(output, yb)) * size
                samples += size
        totals = distributed.all_reduce_sum([float(samples), *sums.values()])
        if totals[0] == 0:
            raise ValueError("evaluate: the data is empty (0 samples)")
        return {k: v / totals[0] for k, v in zip(sums, totals[1:], strict=True)}

    def predict(self, x: Any, batch_size: int = 32) -> torch.Tensor:
        """The model's outputs in float32, on the CPU, for tensors/arrays or batches."""
        outputs = []
        if isinstance(x, torch.Tensor) or not isinstance(x, Iterable):
            xt = _as_tensor(x, "x")
            chunks: Iterable[Any] = xt.split(batch_size)
        else:
            chunks = (b[0] if isinstance(b, (tuple, list)) else b for b in x)
        with torch.no_grad(), self._eval_mode():
            for chunk in chunks:
                outputs.append(call(self.model, _to(chunk, self.device)).float().cpu())
        return torch.cat(outputs) if outputs else torch.empty(0)

    # -- MindSpore style --------------------------------------------------------------------

    def train(
        self, epoch: int, train_dataset: Iterable[Batch], callbacks: Iterable[Callback] = ()
    ) -> History:
        """MindSpore's ``Model.train(epoch, train_dataset, callbacks=[LossMonitor()])``."""
        return self.fit(train_dataset, epochs=epoch, callbacks=callbacks, verbose=0)

    # -- state ------------------------------------------------------------------------------

    def resume_state(self) -> dict[str, Any]:
        """Where training stands: applied steps, epoch, batches done in it, and the RNG
        state the epoch's order was drawn from (for ``fit(resume_from=...)``)."""
        return {
            "global_step": self.global_step,
            "epoch": self._epoch,
            "step_in_epoch": self._step_in_epoch,
            "epoch_rng": self._epoch_rng,
        }

    def state_dict(self) -> dict[str, Any]:
        """Model, optimizer (inner states, float32 masters, loss scaler) and step counter."""
        return {
            "model": {k: v.detach().clone() for k, v in self.model.state_dict().items()},
            "optimizer": copy.deepcopy(self.optimizer.state_dict()),
            "global_step": self.global_step,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.global_step = int(state["global_step"])


def _is_empty(targets: Any) -> bool:
    return isinstance(targets, torch.Tensor) and targets.dim() > 0 and targets.shape[0] == 0
