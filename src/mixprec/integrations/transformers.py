"""``MixprecTrainer``: mixprec's mixed precision inside Hugging Face ``transformers.Trainer``.

``MixprecTrainer(model, args, policy="mixed_bfloat16", level="auto")`` prepares the model with
``auto_mixed_precision`` and wraps the Trainer's optimizer in a ``LossScaleOptimizer``: float32
master weights behind 16-bit storage (O2), loss scaling, and steps skipped on overflow. The
Trainer keeps everything else: data, gradient accumulation (its loss normalisation included),
logging, evaluation, checkpoints.

Where the Trainer's loop is joined (transformers 5.23):

- ``training_step`` (public): the loop's ``accelerator.backward(loss)`` scales the loss with
  ``accelerator.scaler`` when there is one; during the step it is lent an object whose
  ``scale`` is ``LossScaleOptimizer.get_scaled_loss``.
- ``_clip_grad_norm`` and ``_get_grad_norm`` (private, the only ones overridden): the Trainer
  clips and logs the norm of the model's gradients, which are scaled and 16-bit here; these
  unscale into the float32 masters and clip or measure those.
- ``create_optimizer`` / ``create_scheduler`` (public): wrap the optimizer, and the scheduler
  so that it advances on applied steps only (the loop asks ``accelerator.
  optimizer_step_was_skipped``, which only accelerate's own GradScaler sets).
- ``log`` (public): adds ``loss_scale`` and ``skipped_steps``.
- ``_save`` (private): ``save_model`` and checkpoints write the float32 masters in place of
  the 16-bit weights (``save_masters=True``), as ``export_weights`` does, with a config whose
  ``dtype`` is float32, so that ``from_pretrained`` gives back what training reached.

Checkpoints need nothing more: ``optimizer.pt`` holds the ``LossScaleOptimizer`` state, that is
the inner optimizer's, the float32 masters and the loss scaler's (scale and counters).
"""

from __future__ import annotations

import copy
from collections.abc import Iterable
from typing import Any

import torch
from torch import nn
from transformers import Trainer, TrainerCallback, TrainingArguments
from transformers.optimization import GreedyLR

from mixprec._errors import ArgumentError, MisuseError
from mixprec._save_guard import quiet_saves
from mixprec.checkpoint import masters_in_place
from mixprec.integrations._hf_arguments import refuse_second_mixed_precision
from mixprec.integrations._hf_prepare import float32_from_checkpoint, is_prepared_as
from mixprec.levels import KeepEntry, auto_mixed_precision, keep_list, resolve_level
from mixprec.optim import LossScaleOptimizer
from mixprec.policy import Policy, PolicyLike, get_policy
from mixprec.recompute import checkpoint_like_the_forward
from mixprec.scaling import LossScaler
from mixprec.train.step import check_optimizer_covers

__all__ = ["MixprecTrainer"]

#: Private Trainer methods overridden here. Without them the Trainer would clip and log the
#: scaled 16-bit gradients, so their absence (another transformers version) is an error.
_PRIVATE_OVERRIDES = (
    "_clip_grad_norm",
    "_get_grad_norm",
    "_load_best_model",
    "_load_from_checkpoint",
    "_save",
)
_missing = [name for name in _PRIVATE_OVERRIDES if not callable(getattr(Trainer, name, None))]
if _missing:  # pragma: no cover - depends on the installed transformers
    import transformers as _tf

    raise ImportError(
        f"mixprec's MixprecTrainer overrides transformers.Trainer.{', .'.join(_missing)}, which "
        f"transformers {_tf.__version__} does not have; install transformers>=5.23"
    )


class MixprecTrainer(Trainer):
    """A ``transformers.Trainer`` whose mixed precision is mixprec's.

    ``policy``: a mixprec ``Policy`` or name (``"mixed_bfloat16"``, ``"mixed_float16"``,
    ``"bfloat16"`` for pure 16-bit, ``"auto"``...). ``level``: ``"O0"``-``"O3"`` or ``"auto"``
    (O2 for a mixed policy). ``keep_float32``: module types, name patterns or modules kept in
    float32. ``loss_scaler``: a mixprec scaler (default: dynamic for float16 compute, none
    otherwise; steps with inf/NaN gradients are skipped either way). ``trace_overflow``: name
    the first module whose output or gradient overflowed when a step is skipped (adds hooks).
    Every other argument is ``transformers.Trainer``'s.

    The model passed (or each one ``model_init`` returns) is prepared in place when it is
    float32. One already prepared with the same policy and level (by an earlier
    ``MixprecTrainer``: resuming with other arguments, a Trainer for evaluation) is used as
    it is, and its optimizer starts from the latest float32 masters of the model (those of
    the last ``MixprecTrainer`` that trained it, while the weights are still their
    rounding); a conflicting policy, level or ``keep_float32`` is refused.
    ``TrainingArguments`` must not ask for accelerate's mixed precision as well
    (``bf16``, ``fp16``, ``ACCELERATE_MIXED_PRECISION``). ``max_grad_norm`` clips the unscaled
    float32 master gradients; the learning-rate scheduler advances on applied steps only;
    ``global_step`` counts skipped steps too, as with ``fp16=True``. The logs carry
    ``loss_scale`` and ``skipped_steps`` (skipped since the start of training, checkpointed).

    ``save_model()`` (and each checkpoint) writes the float32 master weights in place of the
    16-bit ones, and a config whose ``dtype`` is float32: ``from_pretrained`` then loads the
    values training reached, not their 16-bit rounding. ``save_masters=False`` writes the
    weights as the prepared model stores them. Before ``train()`` there are no masters yet.
    """

    def __init__(
        self,
        model: nn.Module | None = None,
        args: TrainingArguments | None = None,
        *trainer_args: Any,
        policy: PolicyLike = "mixed_bfloat16",
        level: str = "auto",
        loss_scaler: LossScaler | None = None,
        keep_float32: Iterable[KeepEntry] = (),
        trace_overflow: bool = False,
        save_masters: bool = True,
        **trainer_kwargs: Any,
    ) -> None:
        # Checked before Trainer.__init__, which builds the Accelerator from the arguments.
        self.policy: Policy = get_policy(policy)
        self.level: str = resolve_level(level, self.policy)
        if loss_scaler is not None and not isinstance(loss_scaler, LossScaler):
            raise ArgumentError(
                "loss_scaler must be a mixprec NoOpLossScaler, StaticLossScaler or "
                f"DynamicLossScaler (or None), got {type(loss_scaler).__name__}: {loss_scaler!r}"
            )
        for name, flag in (("trace_overflow", trace_overflow), ("save_masters", save_masters)):
            if not isinstance(flag, bool):
                raise ArgumentError(f"{name} must be True or False, got {flag!r}")
        if args is not None and not isinstance(args, TrainingArguments):
            raise ArgumentError(
                f"args must be a transformers.TrainingArguments, got {type(args).__name__}"
            )
        keep = keep_list(keep_float32)
        # A model prepared with this policy and level (by an earlier MixprecTrainer) is used
        # as it is; a conflicting preparation is refused.
        prepared = model is not None and is_prepared_as(model, self.policy, self.level, keep)
        refuse_second_mixed_precision(args, self.policy)
        self._loss_scaler = loss_scaler
        self._keep_float32 = keep
        self._trace_overflow = trace_overflow
        self.save_masters = save_masters
        self._mixprec_optimizer: LossScaleOptimizer | None = None
        optimizers = trainer_kwargs.get("optimizers")
        if optimizers and isinstance(optimizers[0], LossScaleOptimizer):
            raise ArgumentError(
                "optimizers=(LossScaleOptimizer(...), ...): pass the inner optimizer; "
                "MixprecTrainer wraps it (configure the scaling with loss_scaler=)"
            )
        if model is not None and optimizers and optimizers[0] is not None:
            _check_optimizer_covers(model, optimizers[0])

        super().__init__(model, args, *trainer_args, **trainer_kwargs)

        if model is not None and not prepared:
            # After Trainer.__init__: the model is on its device, so the float32 values
            # kept for the master weights are too.
            self._prepare(model)
        self.add_callback(_FreeMasterGrads())
        self.add_callback(_CheckpointLikeTheForward())

    # -- model and optimizer ----------------------------------------------------------------

    def _prepare(self, model: nn.Module) -> nn.Module:
        return auto_mixed_precision(model, self.policy, self.level, self._keep_float32)

    def call_model_init(self, trial: Any = None) -> nn.Module:
        model = super().call_model_init(trial)
        if is_prepared_as(model, self.policy, self.level, self._keep_float32, "model_init()"):
            return model
        return self._prepare(model)

    @property
    def loss_scale_optimizer(self) -> LossScaleOptimizer | None:
        """The ``LossScaleOptimizer`` around the Trainer's optimizer (``None`` before
        ``train()`` creates it): its ``loss_scaler.state`` has the scale and the counters."""
        return self._mixprec_optimizer

    def create_optimizer(self, model: nn.Module | None = None) -> torch.optim.Optimizer:
        optimizer = super().create_optimizer(model)
        found = _find_loss_scale_optimizer(optimizer)
        if found is None:
            # A model trained by an earlier Trainer starts from its latest float32 masters
            # (LossScaleOptimizer finds them while that Trainer's optimizer lives).
            # The Trainer handles gradient accumulation (it divides the loss, or normalises it
            # by the batch's token count) and clipping (in _clip_grad_norm below), so the
            # wrapper only scales, skips and keeps the masters: accumulation_steps=1 and no
            # max_grad_norm of its own.
            found = LossScaleOptimizer(
                optimizer,
                # Each train() (a model_init trial) starts from the scaler as given, not from
                # the scale and counters an earlier trial left in it.
                loss_scaler=copy.deepcopy(self._loss_scaler),
                trace_overflow=self._trace_overflow,
            )
            # accelerate wraps it here by design: the methods above take the StepResult
            # and clipping out of the wrapper's hands, so the optimizer does not refuse it.
            found._managed_by = "MixprecTrainer"
            self.optimizer = found
        self._mixprec_optimizer = found
        return self.optimizer  # type: ignore[return-value]  # set just above or by Trainer

    def create_scheduler(
        self, num_training_steps: int, optimizer: torch.optim.Optimizer | None = None
    ) -> Any:
        scheduler = super().create_scheduler(num_training_steps, optimizer)
        # ReduceLROnPlateau (and transformers' GreedyLR) step on evaluation metrics, not after
        # optimizer steps, and the loop tells them apart by type: they stay as they are.
        metric_driven = (torch.optim.lr_scheduler.ReduceLROnPlateau, GreedyLR)
        if not isinstance(scheduler, (_AppliedStepsScheduler, *metric_driven)):
            # Not an LRScheduler: it forwards to one (the Trainer types the attribute LambdaLR).
            self.lr_scheduler = _AppliedStepsScheduler(scheduler, self._optimizer())  # type: ignore[assignment]
        return self.lr_scheduler

    def _optimizer(self) -> LossScaleOptimizer:
        if self._mixprec_optimizer is None:
            raise MisuseError(
                "MixprecTrainer: no LossScaleOptimizer yet; create_optimizer() makes it "
                "(train() calls it)"
            )
        return self._mixprec_optimizer

    # -- the step ---------------------------------------------------------------------------

    def training_step(
        self,
        model: nn.Module,
        inputs: dict[str, torch.Tensor | Any],
        num_items_in_batch: torch.Tensor | int | None = None,
    ) -> torch.Tensor:
        # Trainer.training_step ends with accelerator.backward(loss), which calls
        # accelerator.scaler.scale(loss).backward() when a scaler is set: lend it one that
        # scales with the LossScaleOptimizer. The returned (logged) loss stays unscaled.
        accelerator = self.accelerator
        if accelerator.scaler is not None:
            raise MisuseError(
                "MixprecTrainer.training_step: accelerate has a GradScaler of its own "
                f"({type(accelerator.scaler).__name__}); its mixed precision must be off"
            )
        accelerator.scaler = _ScaleWith(self._optimizer())
        try:
            loss: torch.Tensor = super().training_step(model, inputs, num_items_in_batch)
        finally:
            accelerator.scaler = None
        return loss

    def _unscaled_masters(self) -> list[torch.Tensor]:
        """Unscale the accumulated gradients into the float32 masters (once per step: the
        optimizer's step does not unscale again); the masters with dense gradients."""
        optimizer = self._optimizer()
        optimizer.unscale_()
        return [p for p in optimizer.master_params() if p.grad is not None and not p.grad.is_sparse]

    # Private override (transformers 5.23: Trainer._clip_grad_norm(model), called when
    # max_grad_norm > 0, returns the norm before clipping).
    def _clip_grad_norm(self, model: nn.Module) -> torch.Tensor:
        # The norm stays a tensor: the Trainer reads it only when it logs, so the step keeps
        # its one host synchronisation (in LossScaleOptimizer.step). A non-finite norm (an
        # overflow) makes the clipped gradients NaN, but that step is skipped anyway.
        return nn.utils.clip_grad_norm_(
            self._unscaled_masters(), self.args.max_grad_norm, foreach=True
        )

    # Private override (transformers 5.23: Trainer._get_grad_norm(model, grad_norm=None),
    # called every step with _clip_grad_norm's result or None; the result is logged).
    def _get_grad_norm(
        self, model: nn.Module, grad_norm: torch.Tensor | float | None = None
    ) -> torch.Tensor | float | None:
        if grad_norm is None:
            grads = [p.grad for p in self._unscaled_masters() if p.grad is not None]
            grad_norm = nn.utils.get_total_norm(grads, foreach=True) if grads else None
        return grad_norm

    # -- saving ---------------------------------------------------------------------------

    # Private override (transformers 5.23: Trainer._save(output_dir, state_dict=None), called
    # by save_model and for checkpoints; it writes the weights with save_pretrained).
    def _save(
        self, output_dir: str | None = None, state_dict: dict[str, Any] | None = None
    ) -> None:
        masters = self._float32_state_dict() if state_dict is None and self.save_masters else None
        if masters is None:  # no masters (O0, O1, O3, before train()) or a given state dict
            with quiet_saves():  # or save_masters=False: the 16-bit weights, as asked
                super()._save(output_dir, state_dict)
            return
        config = getattr(self.model, "config", None)
        before = getattr(config, "dtype", None)
        super()._save(output_dir, masters)
        if config is not None and self.args.should_save:
            # save_pretrained wrote the dtype of the model's first weight (16-bit at O2), which
            # from_pretrained would load the float32 masters in.
            config.dtype = "float32"
            try:
                config.save_pretrained(output_dir or self.args.output_dir)
            finally:
                config.dtype = before

    # Private override (transformers 5.23: Trainer._load_best_model(), at the end of train()
    # with load_best_model_at_end; it loads the best checkpoint's weights into the model).
    def _load_best_model(self) -> None:
        super()._load_best_model()
        # The 16-bit weights now hold the best checkpoint's rounded values; the checkpoint
        # holds the float32 masters themselves (_save): kept on every weight they round to,
        # and the masters follow the load with those.
        if self.model is not None:
            float32_from_checkpoint(self.model, self.state.best_model_checkpoint)
        if self._mixprec_optimizer is not None:
            self._mixprec_optimizer._weights.follow_external_writes()

    # Private override (transformers 5.23: Trainer._load_from_checkpoint(resume_from_checkpoint,
    # model=None), train()'s resume, before the optimizer exists): the 16-bit weights then
    # hold the checkpoint's rounded values; the weights no optimizer holds (frozen ones) take
    # back the float32 values the checkpoint has, which their saves write.
    def _load_from_checkpoint(self, resume_from_checkpoint: str, model: Any = None) -> None:
        super()._load_from_checkpoint(resume_from_checkpoint, model)
        if self.model is not None:
            float32_from_checkpoint(self.model, resume_from_checkpoint)

    def _float32_state_dict(self) -> dict[str, torch.Tensor] | None:
        """The model's state dict with each 16-bit weight's float32 master in its place (a
        tied weight's names all get the same master); ``None`` without masters."""
        # Every key, on the model's device: save_pretrained drops tied duplicates itself.
        model = self.model
        return None if model is None else masters_in_place(model, [self._mixprec_optimizer])

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        # Training logs ("loss" every logging_steps, "train_loss" in the final metrics, which
        # train() also returns) get the scaler's state; evaluation logs do not.
        optimizer = self._mixprec_optimizer
        if optimizer is not None and ("loss" in logs or "train_loss" in logs):
            state = optimizer.loss_scaler.state
            logs["loss_scale"] = state.scale
            logs["skipped_steps"] = state.skipped_steps
        super().log(logs, start_time)


class _ScaleWith:
    """What ``Accelerator.backward`` uses of a GradScaler: ``scale(loss)``."""

    def __init__(self, optimizer: LossScaleOptimizer) -> None:
        self._optimizer = optimizer

    def scale(self, loss: torch.Tensor) -> torch.Tensor:
        return self._optimizer.get_scaled_loss(loss)


class _AppliedStepsScheduler:
    """The Trainer's LR scheduler, advanced only after applied optimizer steps.

    The loss scaler counts skipped steps in a row (``consecutive_skips``), zero after an
    applied one. Everything else (``get_last_lr``, ``state_dict``, ...) is the scheduler's,
    so ``scheduler.pt`` is what the plain Trainer writes."""

    def __init__(self, scheduler: Any, optimizer: LossScaleOptimizer) -> None:
        self.scheduler = scheduler
        self._optimizer = optimizer

    def step(self, *args: Any, **kwargs: Any) -> None:
        if self._optimizer.loss_scaler.state.consecutive_skips == 0:
            self.scheduler.step(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        if name in ("scheduler", "_optimizer"):  # not set yet (copy, unpickling)
            raise AttributeError(name)
        return getattr(self.scheduler, name)

    def __repr__(self) -> str:
        return f"_AppliedStepsScheduler({self.scheduler!r})"


class _CheckpointLikeTheForward(TrainerCallback):
    """Activation checkpointing (``activation_checkpointing=True``, which ``train()`` turns
    on before this hook): each layer's checkpointing function becomes
    ``mp.activation_checkpoint`` with the same arguments, so that its recompute computes
    as its forward did; torch's recompute failed in the backward on the float32
    functions' dtypes. The arguments are left as given (a function in them would not go
    to JSON, and under ``torch_compile`` torch takes a ``context_fn`` for its own use)."""

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        model = kwargs.get("model")
        if isinstance(model, nn.Module):
            checkpoint_like_the_forward(model)


class _FreeMasterGrads(TrainerCallback):
    """Drop the gradients, float32 masters' included, right after the optimizer step.

    The Trainer clears only the model's (16-bit) gradients; kept, the masters' float32
    gradients would sit beside the next forward's activations (4 bytes a parameter at the
    peak), which float32 training does not pay."""

    def on_optimizer_step(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        optimizer = kwargs.get("optimizer")
        if optimizer is not None:
            optimizer.zero_grad(set_to_none=True)


def _find_loss_scale_optimizer(optimizer: Any) -> LossScaleOptimizer | None:
    """The ``LossScaleOptimizer`` inside accelerate's ``AcceleratedOptimizer`` wrappers (a
    second ``train()`` finds the optimizer already prepared)."""
    for _ in range(8):
        if isinstance(optimizer, LossScaleOptimizer):
            return optimizer
        optimizer = getattr(optimizer, "optimizer", None)
        if optimizer is None:
            break
    return None


def _check_optimizer_covers(model: nn.Module, optimizer: Any) -> None:
    """``optimizers=(optimizer, ...)`` built over another model's parameters would train
    nothing (every step applied, grad_norm 0): refused, naming both counts; one holding only
    some of them warns (``check_optimizer_covers``, as ``Trainer`` does)."""
    try:
        check_optimizer_covers(model, optimizer)
    except ArgumentError:
        trainable = sum(p.requires_grad for p in model.parameters())
        held = sum(len(group["params"]) for group in optimizer.param_groups)
        raise ArgumentError(
            f"MixprecTrainer(optimizers=({type(optimizer).__name__}, ...)): the optimizer "
            f"holds {held} parameters and none of the model's {trainable} trainable ones (was "
            "it built over another model?): training would change nothing; build it over "
            "this model's parameters, e.g. torch.optim.AdamW(model.parameters())"
        ) from None
