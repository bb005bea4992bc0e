"""PyTorch Lightning: ``MixprecPrecision`` for ``lightning.pytorch.Trainer`` and
``MixprecFabricPrecision`` for ``lightning.fabric.Fabric``.

    trainer = L.Trainer(plugins=[MixprecPrecision("mixed_float16", level="O2")])

Thin adapters, no numerics of their own: ``convert_module`` prepares the model with
``auto_mixed_precision`` and every optimizer is wrapped in a ``LossScaleOptimizer`` (float32
masters for 16-bit weights, loss scaling, skip on overflow), so a Lightning run steps exactly
as mixprec's own ``Trainer`` does. All optimizers of a plugin share one loss scaler: Lightning's
manual ``manual_backward(loss)`` and Fabric's ``backward(loss)`` do not say which optimizer
the gradients are for, so the loss must be scaled by a scale they all use.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Callable, Generator, Iterable, Iterator
from dataclasses import dataclass
from typing import Any, Literal

import torch
from torch import nn

try:
    import lightning.pytorch as pl
    from lightning.fabric.plugins import Precision as FabricPrecision
    from lightning.pytorch.core.optimizer import LightningOptimizer
    from lightning.pytorch.plugins.precision import Precision
    from lightning.pytorch.utilities import GradClipAlgorithmType
except ImportError as err:  # pragma: no cover - exercised only without the extra
    raise ImportError(
        "mixprec.integrations.lightning needs Lightning: pip install 'mixprec[lightning]'"
    ) from err

from mixprec._errors import ArgumentError, MisuseError
from mixprec.casting import Float32Functions, cast_floating
from mixprec.levels import KeepEntry, applied, auto_mixed_precision, keep_list, resolve_level
from mixprec.optim import LossScaleOptimizer, StepResult, _needs_scaling
from mixprec.policy import Policy, PolicyLike, get_policy
from mixprec.scaling import DynamicLossScaler, LossScaler, NoOpLossScaler

__all__ = ["MixprecFabricPrecision", "MixprecPrecision"]

PrecisionName = Literal["32-true", "bf16-mixed", "16-mixed", "bf16-true", "16-true"]


def _precision_name(policy: Policy, level: str) -> PrecisionName:
    """Lightning's name for what the run computes in, so that code reading
    ``trainer.precision`` (ThroughputMonitor, model summary) sees a value it knows."""
    if level == "O0" or not policy.is_mixed:
        return "32-true"
    if policy.compute_dtype == torch.bfloat16:
        return "bf16-true" if level == "O3" else "bf16-mixed"
    return "16-true" if level == "O3" else "16-mixed"


def _keep_entries(owner: str, keep_float32: Any) -> tuple[KeepEntry, ...]:
    """Check the entries' types now; names are matched against the model in convert_module."""
    try:
        entries = keep_list(keep_float32)
    except TypeError:
        raise TypeError(
            f"{owner}(keep_float32={keep_float32!r}): expected module types, module name "
            "patterns (str) or modules, or a sequence of them"
        ) from None
    for entry in entries:
        if not (
            isinstance(entry, (str, nn.Module))
            or (isinstance(entry, type) and issubclass(entry, nn.Module))
        ):
            raise TypeError(
                f"{owner}(keep_float32=...): entry {entry!r} ({type(entry).__name__}) is not "
                "an nn.Module subclass, a module name pattern (str) or a module"
            )
    return entries


@dataclass
class _Record:
    """Per wrapped optimizer, between Lightning's calls."""

    skipped: bool = False  # its last step was skipped for an overflow: hold its schedulers
    unscaled: bool = False  # this step's gradients are unscaled already (by clipping)


class _MixprecPlugin:
    """What both plugins share: the options, the model's preparation, the loss scaler, and
    the wrapped optimizers' steps. Placed before Lightning's base class in the bases."""

    def __init__(
        self,
        policy: PolicyLike = "mixed_bfloat16",
        level: str = "auto",
        loss_scaler: LossScaler | None = None,
        keep_float32: KeepEntry | Iterable[KeepEntry] = (),
        trace_overflow: bool = False,
    ) -> None:
        owner = type(self).__name__
        try:
            resolved = get_policy(policy)
            lvl = resolve_level(level, resolved)
        except ValueError as err:
            raise ArgumentError(f"{owner}: {err}") from None
        except TypeError as err:
            raise TypeError(f"{owner}: {err}") from None
        if loss_scaler is not None and not isinstance(loss_scaler, LossScaler):
            raise TypeError(
                f"{owner}(loss_scaler={loss_scaler!r}): expected None (the policy's default) "
                "or a mixprec NoOpLossScaler, StaticLossScaler or DynamicLossScaler, got "
                f"{type(loss_scaler).__name__}"
            )
        if not isinstance(trace_overflow, bool):
            raise TypeError(
                f"{owner}(trace_overflow={trace_overflow!r}): expected True or False, got "
                f"{type(trace_overflow).__name__}"
            )
        self.policy: Policy = resolved
        self.level: str = lvl
        self.keep_float32: tuple[KeepEntry, ...] = _keep_entries(owner, keep_float32)
        self.trace_overflow = trace_overflow
        self.precision: PrecisionName = _precision_name(resolved, lvl)
        self._scaler: LossScaler | None = loss_scaler
        self._step_context = lvl != "O0" and resolved.is_mixed
        self._reset_run()

    def _reset_run(self) -> None:
        """State that belongs to one run (not pickled: see __getstate__)."""
        self._module: weakref.ref[nn.Module] | None = None
        self._lsos: list[LossScaleOptimizer] = []  # in the order Lightning gave them
        self._records: dict[int, _Record] = {}  # id(LossScaleOptimizer) -> record
        #: What the last optimizer step did (``None`` before the first).
        self.last_step: StepResult | None = None

    def __getstate__(self) -> dict[str, Any]:
        # ddp_spawn pickles the plugin into its workers before setup. A plugin that already ran
        # holds hooks and weak references: what goes across is the configuration and the scaler.
        state = self.__dict__.copy()
        for key in ("_module", "_lsos", "_records", "last_step"):
            state.pop(key, None)
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._reset_run()

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(policy={self.policy.name!r}, level={self.level!r}, "
            f"loss_scaler={self._scaler!r}, precision={self.precision!r})"
        )

    # -- what Lightning reads ---------------------------------------------------------------

    @property
    def loss_scaler(self) -> LossScaler:
        """The loss scaler every wrapped optimizer uses (its state has ``skipped_steps``)."""
        if self._scaler is None:
            raise MisuseError(
                f"{type(self).__name__}.loss_scaler is chosen when the model is prepared "
                "(convert_module, run by Trainer.fit / Fabric.setup); pass loss_scaler= to fix it"
            )
        return self._scaler

    @property
    def device(self) -> str:
        """The device type that autocast runs on: the prepared model's."""
        module = self._module() if self._module is not None else None
        param = next(module.parameters(), None) if module is not None else None
        if param is not None:
            return param.device.type
        return "cuda" if torch.cuda.is_available() else "cpu"

    @property
    def optimizers(self) -> list[LossScaleOptimizer]:
        """The ``LossScaleOptimizer``\\ s this plugin made, in Lightning's order."""
        return list(self._lsos)

    # -- the model --------------------------------------------------------------------------

    def convert_module(self, module: nn.Module) -> nn.Module:
        """``auto_mixed_precision(module, policy, level, keep_float32)``, once per model.

        Lightning calls this at every ``fit``/``validate``/``test``; a model already prepared
        the same way is left as it is."""
        done = applied(module)
        if done is None:
            auto_mixed_precision(module, self.policy, self.level, keep_float32=self.keep_float32)
        elif done.policy != self.policy or done.level != self.level:
            raise ValueError(
                f"{type(self).__name__}(policy={self.policy.name!r}, level={self.level!r}): "
                f"the model was already prepared with policy {done.policy.name!r}, level "
                f"{done.level!r}; build it again, or use a plugin with the same options"
            )
        self._module = weakref.ref(module)
        if self._scaler is None:
            # mixprec's one rule for the default: float16 math (from the policy, or a
            # to_float(..., float16) inside the model) needs dynamic scaling, nothing else does.
            needs = _needs_scaling(list(module.parameters()))
            self._scaler = DynamicLossScaler() if needs else NoOpLossScaler()
        return module

    @contextlib.contextmanager
    def forward_context(self) -> Generator[None, None, None]:
        """The step runs as the model's own region does: autocast in the compute dtype and,
        off CUDA (whose autocast already does it), softmax, losses and norms in float32.

        So a ``training_step`` that calls submodules directly (``self.encoder(x)``, not
        ``self(x)``) still gets 16-bit matmuls and a float32 loss; at O2 it is what lets a
        float32 batch meet 16-bit weights. The autocast cache is off, as in Lightning's own
        ``MixedPrecision``: a weight cast under ``no_grad`` must not be reused with grad."""
        if not self._step_context:
            yield
            return
        device = self.device
        mode = Float32Functions() if device != "cuda" else contextlib.nullcontext()
        with (
            torch.autocast(device, dtype=self.policy.compute_dtype, cache_enabled=False),
            mode,
        ):
            yield

    def convert_input(self, data: Any) -> Any:
        """Inputs pass as they are: the model's region casts floating inputs once at its
        boundary (O2, O3), and casting the whole batch would also round float targets."""
        return data

    def convert_output(self, data: Any) -> Any:
        """Floating outputs in the policy's ``output_dtype`` (what the model's region already
        returns; this covers methods Fabric routes around ``forward``)."""
        if not self._step_context:
            return data
        return cast_floating(data, self.policy.output_dtype)

    # -- optimizers -------------------------------------------------------------------------

    def _wrap(self, optimizer: torch.optim.Optimizer) -> LossScaleOptimizer:
        owner = type(self).__name__
        if isinstance(optimizer, LossScaleOptimizer):
            raise TypeError(
                f"{owner}: the optimizer is already a LossScaleOptimizer; return the plain "
                "torch optimizer (the plugin wraps it; pass loss_scaler= to the plugin)"
            )
        if isinstance(optimizer, torch.optim.LBFGS):
            raise TypeError(
                f"{owner}: LBFGS re-evaluates its closure inside step(), which a loss-scaled "
                "step with skip on overflow cannot do; use another optimizer"
            )
        if self._module is None:
            raise MisuseError(
                f"{owner}: an optimizer reached the plugin before the model was prepared "
                "(convert_module)"
            )
        lso = LossScaleOptimizer(
            optimizer, loss_scaler=self.loss_scaler, trace_overflow=self.trace_overflow
        )
        # Under DDP every rank starts from rank 0's float32 masters, not just its 16-bit
        # weights (a no-op outside torch.distributed).
        lso.broadcast_masters()
        self._lsos.append(lso)
        self._records[id(lso)] = _Record()
        return lso

    def _owner_of(self, optimizer: Any) -> LossScaleOptimizer | None:
        """The wrapper of ``optimizer``: given as a Lightning or Fabric wrapper, the
        ``LossScaleOptimizer`` itself, or the inner optimizer a scheduler holds."""
        if isinstance(optimizer, LightningOptimizer):
            optimizer = optimizer.optimizer
        optimizer = getattr(optimizer, "_optimizer", optimizer)  # Fabric's _FabricOptimizer
        for lso in self._lsos:
            if optimizer is lso or any(inner is optimizer for inner in lso.optimizers):
                return lso
        return None

    def _scaled_loss(self, tensor: torch.Tensor, lsos: list[LossScaleOptimizer]) -> torch.Tensor:
        """``loss * scale`` through each optimizer the gradients may be for, so that each
        counts the backward. They share one scaler, so every result is the same value."""
        if not lsos:
            return self.loss_scaler.scale(tensor)
        scaled = lsos[0].get_scaled_loss(tensor)
        for other in lsos[1:]:
            other.get_scaled_loss(tensor)
        return scaled

    def _unscale(self, lso: LossScaleOptimizer) -> None:
        """Unscale into the float32 masters, once per step: clipping asks first in manual
        optimization and in Fabric, the step asks again."""
        record = self._records[id(lso)]
        if record.unscaled:
            return
        try:
            lso.unscale_()
        except MisuseError as err:
            raise MisuseError(
                f"{type(self).__name__}: optimizer step without a backward through the "
                "trainer; use self.manual_backward(loss) (Lightning) or fabric.backward(loss), "
                f"not loss.backward() ({err})"
            ) from None
        record.unscaled = True

    def _apply(self, lso: LossScaleOptimizer) -> StepResult:
        """The step (gradients already unscaled): apply or skip, update the scale."""
        result = lso.step()
        record = self._records[id(lso)]
        record.skipped = result.skipped
        record.unscaled = False
        self.last_step = result
        return result

    # Lightning types these as Parameters; masters are plain tensors, which every clipping
    # function (and optimizer) takes alike.
    def main_params(self, optimizer: torch.optim.Optimizer) -> Iterator[torch.Tensor]:  # type: ignore[override]
        """The float32 masters (and parameters without one): clipping and Fabric's
        ``clip_gradients`` act on these unscaled gradients, not the 16-bit ones."""
        lso = self._owner_of(optimizer)
        if lso is None:
            return (p for group in optimizer.param_groups for p in group["params"])
        return lso.master_params()

    # -- checkpoints ------------------------------------------------------------------------

    def _scaler_state(self) -> dict[str, Any]:
        return {
            "policy": str(self.policy),
            "level": self.level,
            "loss_scaler": self.loss_scaler.state_dict(),
        }

    def _load_scaler_state(self, state_dict: dict[str, Any]) -> None:
        owner = type(self).__name__
        missing = [k for k in ("level", "loss_scaler") if k not in state_dict]
        if missing:
            raise ValueError(
                f"{owner}.load_state_dict: not a {owner} state; missing {', '.join(missing)}"
            )
        if state_dict["level"] != self.level:
            raise ValueError(
                f"{owner}.load_state_dict: the checkpoint was trained at level "
                f"{state_dict['level']!r} (policy {state_dict.get('policy')!r}); this plugin "
                f"runs level {self.level!r}: resume with the same level"
            )
        self.loss_scaler.load_state_dict(state_dict["loss_scaler"])


# The ignore: the mixin's `precision` and `main_params` are narrower than Lightning's.
class MixprecPrecision(_MixprecPlugin, Precision):  # type: ignore[misc]
    """mixprec's mixed precision in ``lightning.pytorch.Trainer``.

    ``L.Trainer(plugins=[MixprecPrecision("mixed_float16", level="O2")])``. ``policy`` and
    ``level`` as in ``auto_mixed_precision`` (``"auto"``: O2 for mixed policies);
    ``loss_scaler`` (default: dynamic for float16 compute, none otherwise) is shared by all
    optimizers; ``keep_float32`` lists module types, name patterns (relative to the
    LightningModule) or modules kept in float32; ``trace_overflow`` names the first module
    that overflowed when a step is skipped (a warning on the ``mixprec`` logger).

    Each step logs ``loss_scale`` (the scale after the step) and ``skipped_steps`` (total
    overflow skips) with ``LightningModule.log``. LR schedulers with ``interval="step"`` do not
    advance after a skipped step. ``last_step`` holds the latest ``StepResult``.
    """

    def connect(
        self, model: nn.Module, optimizers: list[torch.optim.Optimizer], lr_schedulers: list[Any]
    ) -> tuple[nn.Module, list[torch.optim.Optimizer], list[Any]]:
        """Wrap each optimizer in a ``LossScaleOptimizer`` and each step-interval scheduler
        so that it holds after a skipped step. Lightning calls this at every ``setup``, with
        the optimizers it already has outside ``fit``: those stay as they are."""
        if any(self._owner_of(opt) is None for opt in optimizers):
            self._lsos, self._records = [], {}  # a new fit: configure_optimizers ran again
        wrapped: list[torch.optim.Optimizer] = []
        for opt in optimizers:
            wrapped.append(self._owner_of(opt) or self._wrap(opt))
        for config in lr_schedulers:
            if getattr(config, "interval", None) != "step" or isinstance(
                config.scheduler, _HeldOnSkip
            ):
                continue
            lso = self._owner_of(getattr(config.scheduler, "optimizer", None))
            if lso is None and len(self._lsos) == 1:
                lso = self._lsos[0]
            if lso is not None:
                config.scheduler = _held_on_skip(config.scheduler, self._records[id(lso)])
        return model, wrapped, lr_schedulers

    def backward(  # type: ignore[override]
        self,
        tensor: torch.Tensor,
        model: pl.LightningModule,
        optimizer: Any,
        *args: Any,
        **kwargs: Any,
    ) -> None:
        """The scaled loss goes to ``LightningModule.backward`` (a user's override of it still
        runs). ``manual_backward`` names no optimizer: every wrapped one counts it."""
        if optimizer is None:
            lsos = list(self._lsos)
        else:
            owner = self._owner_of(optimizer)
            if owner is None:
                raise MisuseError(
                    f"{type(self).__name__}.backward: the optimizer {type(optimizer).__name__} "
                    "is not one this plugin wrapped in connect()"
                )
            lsos = [owner]
        model.backward(self._scaled_loss(tensor, lsos), *args, **kwargs)

    def optimizer_step(  # type: ignore[override]
        self,
        optimizer: Any,
        model: pl.LightningModule,
        closure: Callable[[], Any],
        **kwargs: Any,
    ) -> Any:
        """Run the closure (forward, backward), unscale into the float32 masters, then
        ``on_before_optimizer_step`` and gradient clipping, then apply or skip.

        Returns the ``StepResult`` (manual optimization: ``opt.step()`` returns it), or the
        closure's ``None`` when ``training_step`` returned ``None`` (no step, as in
        Lightning's own plugins)."""
        lso = self._owner_of(optimizer)
        if lso is None:
            raise MisuseError(
                f"{type(self).__name__}.optimizer_step: {type(optimizer).__name__} is not an "
                "optimizer this plugin wrapped in connect()"
            )
        if kwargs:
            raise TypeError(
                f"{type(self).__name__}: optimizer.step() got {sorted(kwargs)}; a "
                "LossScaleOptimizer step takes no arguments"
            )
        closure_result = closure()
        skip = closure_result is None and model.automatic_optimization
        if not skip:
            self._unscale(lso)
        # Lightning's own hook (protected, used the same way by its MixedPrecision):
        # on_before_optimizer_step, then configure_gradient_clipping on the unscaled masters.
        self._after_closure(model, optimizer)
        if skip:
            return closure_result
        result = self._apply(lso)
        self._log(model)
        return result

    def clip_gradients(
        self,
        optimizer: torch.optim.Optimizer,
        clip_val: float = 0.0,
        gradient_clip_algorithm: Any = GradClipAlgorithmType.NORM,
    ) -> None:
        """Clip the unscaled float32 masters. In manual optimization ``self.clip_gradients``
        comes before ``opt.step()``: the gradients are unscaled here first."""
        lso = self._owner_of(optimizer)
        if lso is not None and clip_val > 0:
            self._unscale(lso)
        super().clip_gradients(optimizer, clip_val, gradient_clip_algorithm)

    def _log(self, model: pl.LightningModule) -> None:
        """``loss_scale`` and ``skipped_steps`` through ``LightningModule.log``, as a user's
        training_step logs: every logger gets them, and so does ``trainer.callback_metrics``.

        Only on the steps Lightning writes to its loggers (``log_every_n_steps``): the two
        ``log`` calls cost 0.95 ms of Python per step on a 2-core EPYC (a 1.2 ms step of a
        small MLP), and the values of the other steps would be dropped anyway. The condition
        is the one Lightning checks later in the same batch, a protected property of its
        logger connector."""
        trainer = model.trainer
        connector = getattr(trainer, "_logger_connector", None)
        fast_dev_run = getattr(trainer, "fast_dev_run", False)  # set by a connector, untyped
        if connector is not None and not (connector.should_update_logs or fast_dev_run):
            return
        state = self.loss_scaler.state
        model.log("loss_scale", state.scale, on_step=True, on_epoch=False)
        model.log("skipped_steps", float(state.skipped_steps), on_step=True, on_epoch=False)

    def state_dict(self) -> dict[str, Any]:
        """The scaler's state (scale, counters) with the policy and level. Masters and the
        inner optimizer's state are in Lightning's ``optimizer_states`` (the
        ``LossScaleOptimizer``'s ``state_dict``)."""
        return self._scaler_state() if self._scaler is not None else {}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._load_scaler_state(state_dict)


class MixprecFabricPrecision(_MixprecPlugin, FabricPrecision):  # type: ignore[misc]
    """mixprec's mixed precision in ``lightning.fabric.Fabric``: the same options as
    ``MixprecPrecision``.

    Fabric shows a plugin the optimizer only when it steps, unscales or clips, so each
    optimizer is wrapped in a ``LossScaleOptimizer`` then (masters from the float32 values
    kept when the model was prepared), and ``fabric.backward`` scales the loss by the shared
    scaler. ``optimizer.step()`` returns the ``StepResult``: step a scheduler only when
    ``not result.skipped``. The 16-bit gradients are released after each step, since the
    optimizer's own ``zero_grad`` only reaches the float32 masters.

    Checkpoints: put the plugin in the state, ``fabric.save(path, {"model": model,
    "optimizer": optimizer, "mixprec": plugin})``; its state holds the scaler and every
    wrapped optimizer's masters, which the optimizer's own state does not.
    """

    def _reset_run(self) -> None:
        super()._reset_run()
        self._last_loss: torch.Tensor | None = None  # see _fabric_lso
        self._pending: list[dict[str, Any]] = []  # loaded before their optimizer was seen

    def __getstate__(self) -> dict[str, Any]:
        state = super().__getstate__()
        state.pop("_last_loss", None)
        state.pop("_pending", None)
        return state

    def _fabric_lso(self, optimizer: Any) -> LossScaleOptimizer:
        lso = self._owner_of(optimizer)
        if lso is not None:
            return lso
        lso = self._wrap(getattr(optimizer, "_optimizer", optimizer))
        if self._pending:
            lso.load_state_dict(self._pending.pop(0))
        # Backward passes made before Fabric showed us this optimizer (the first step) left
        # gradients scaled by the shared scale: count them as the step's micro-batch.
        waiting = any(p.grad is not None for p in lso.master_params()) or any(
            half.grad is not None for half, _ in lso.master_weights()
        )
        if waiting and self._last_loss is not None:
            lso.get_scaled_loss(self._last_loss)
        return lso

    def backward(
        self, tensor: torch.Tensor, model: nn.Module | None, *args: Any, **kwargs: Any
    ) -> None:
        self._last_loss = tensor.detach()
        self._scaled_loss(tensor, list(self._lsos)).backward(*args, **kwargs)

    def unscale_gradients(self, optimizer: torch.optim.Optimizer) -> None:
        """Unscale into the float32 masters (``fabric.clip_gradients`` calls this)."""
        self._unscale(self._fabric_lso(optimizer))

    def main_params(self, optimizer: torch.optim.Optimizer) -> Iterator[torch.Tensor]:  # type: ignore[override]
        return self._fabric_lso(optimizer).master_params()

    def optimizer_step(self, optimizer: Any, **kwargs: Any) -> StepResult:
        if kwargs:
            raise TypeError(
                f"{type(self).__name__}: optimizer.step() got {sorted(kwargs)}; a "
                "LossScaleOptimizer step takes no closure or other arguments"
            )
        lso = self._fabric_lso(optimizer)
        self._unscale(lso)
        result = self._apply(lso)
        for half, _ in lso.master_weights():
            half.grad = None
        return result

    def state_dict(self) -> dict[str, Any]:
        if self._scaler is None:
            return {}
        return {
            **self._scaler_state(),
            "optimizers": [lso.state_dict() for lso in self._lsos] + list(self._pending),
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._load_scaler_state(state_dict)
        states = list(state_dict.get("optimizers", []))
        for lso, state in zip(self._lsos, states, strict=False):
            lso.load_state_dict(state)
        # Fabric has not shown us these optimizers yet: they load when it does.
        self._pending = states[len(self._lsos) :]


# -- schedulers -------------------------------------------------------------------------------


class _HeldOnSkip:
    """A step-interval LR scheduler that stays where it is after a skipped optimizer step.

    Lightning steps schedulers after every optimizer step whatever the step did; this wrapper
    makes ``step()`` do nothing when its optimizer's last step was skipped for an overflow.
    Everything else, reads and writes, goes to the scheduler. Its class derives from the
    scheduler's (as Lightning's own ``LightningOptimizer`` does), so that ``isinstance`` in a
    user's ``lr_scheduler_step`` still holds."""

    _mixprec_scheduler: Any
    _mixprec_record: _Record

    def step(self, *args: Any, **kwargs: Any) -> Any:
        if self._mixprec_record.skipped:
            return None
        return self._mixprec_scheduler.step(*args, **kwargs)

    def state_dict(self) -> Any:
        return self._mixprec_scheduler.state_dict()

    def load_state_dict(self, state_dict: Any) -> None:
        self._mixprec_scheduler.load_state_dict(state_dict)

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_mixprec_"):  # during unpickling, before __dict__ is filled
            raise AttributeError(name)
        return getattr(self._mixprec_scheduler, name)

    def __setattr__(self, name: str, value: Any) -> None:
        setattr(self._mixprec_scheduler, name, value)

    def __reduce__(self) -> tuple[Any, ...]:
        return (_held_on_skip, (self._mixprec_scheduler, self._mixprec_record))

    def __repr__(self) -> str:
        return f"HeldOnSkip({self._mixprec_scheduler!r})"


_HELD_CLASSES: dict[type, type] = {}


def _held_class(kind: type) -> type:
    held = _HELD_CLASSES.get(kind)
    if held is None:
        held = _HELD_CLASSES[kind] = type(f"HeldOnSkip{kind.__name__}", (_HeldOnSkip, kind), {})
    return held


def _held_on_skip(scheduler: Any, record: _Record) -> _HeldOnSkip:
    held: _HeldOnSkip = object.__new__(_held_class(type(scheduler)))
    held.__dict__["_mixprec_scheduler"] = scheduler
    held.__dict__["_mixprec_record"] = record
    return held
