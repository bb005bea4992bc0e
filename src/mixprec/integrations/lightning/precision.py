"""What ``MixprecPrecision`` and ``MixprecFabricPrecision`` share: the options, the model's
preparation, the one loss scaler, and the wrapped optimizers' steps.

No numerics of its own: ``convert_module`` prepares the model with ``auto_mixed_precision`` and
every optimizer is wrapped in a ``LossScaleOptimizer`` (float32 masters for 16-bit weights,
loss scaling, skip on overflow), so a Lightning run steps exactly as mixprec's own ``Trainer``
does. All optimizers of a plugin share one loss scaler: Lightning's manual
``manual_backward(loss)`` and Fabric's ``backward(loss)`` do not say which optimizer the
gradients are for, so the loss must be scaled by a scale they all use.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Generator, Iterable, Iterator
from dataclasses import dataclass
from typing import Any, Literal

import torch
from torch import nn

from mixprec._errors import ArgumentError, MisuseError
from mixprec._prepare_once import needs_preparation
from mixprec.casting import Float32Functions, cast_floating
from mixprec.integrations.lightning._lightning import LightningOptimizer
from mixprec.keep import KeepEntry, keep_list
from mixprec.levels import auto_mixed_precision, resolve_level
from mixprec.optim import LossScaleOptimizer, StepResult, needs_scaling
from mixprec.optim.sharing import coordinated
from mixprec.policy import Policy, PolicyLike, get_policy
from mixprec.scaling import DynamicLossScaler, LossScaler, NoOpLossScaler

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
        raise ArgumentError(
            f"{owner}(keep_float32={keep_float32!r}): expected module types, module name "
            "patterns (str) or modules, or a sequence of them"
        ) from None
    for entry in entries:
        if not (
            isinstance(entry, (str, nn.Module))
            or (isinstance(entry, type) and issubclass(entry, nn.Module))
        ):
            raise ArgumentError(
                f"{owner}(keep_float32=...): entry {entry!r} ({type(entry).__name__}) is not "
                "an nn.Module subclass, a module name pattern (str) or a module"
            )
    return entries


class Wrappers:
    """The ``LossScaleOptimizer``\\ s a plugin made, weakly, each kept alive by its torch
    optimizer: a sweep or notebook reusing one Fabric kept every trial's wrapper, with its
    masters and optimizer state (+15.7 MB a trial for a 4.5 MB model), and saved them all
    in each checkpoint (69.5 MB by the fifth trial)."""

    def __init__(self) -> None:
        self._refs: list[weakref.ref[LossScaleOptimizer]] = []

    def append(self, lso: LossScaleOptimizer, optimizer: torch.optim.Optimizer) -> None:
        optimizer.__dict__["_mixprec_wrapper"] = lso  # lives as long as the optimizer
        self._refs = [ref for ref in self._refs if ref() is not None] + [weakref.ref(lso)]

    def _live(self) -> list[LossScaleOptimizer]:
        return [lso for lso in (ref() for ref in self._refs) if lso is not None]

    def __iter__(self) -> Iterator[LossScaleOptimizer]:
        return iter(self._live())

    def __len__(self) -> int:
        return len(self._live())

    def __getitem__(self, index: int) -> LossScaleOptimizer:
        return self._live()[index]


@dataclass
class _Record:
    """Per wrapped optimizer, between Lightning's calls."""

    skipped: bool = False  # its last step was skipped for an overflow: hold its schedulers
    unscaled: bool = False  # this step's gradients are unscaled already (by clipping)
    # The scale its gradients were scaled by: the shared scale may move before it steps.
    backward_scale: float | None = None


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
        except (ValueError, TypeError) as err:
            raise ArgumentError(f"{owner}: {err}") from None
        if loss_scaler is not None and not isinstance(loss_scaler, LossScaler):
            raise ArgumentError(
                f"{owner}(loss_scaler={loss_scaler!r}): expected None (the policy's default) "
                "or a mixprec NoOpLossScaler, StaticLossScaler or DynamicLossScaler, got "
                f"{type(loss_scaler).__name__}"
            )
        if not isinstance(trace_overflow, bool):
            raise ArgumentError(
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
        self._lsos = Wrappers()  # in the order Lightning gave them
        self._records: dict[int, _Record] = {}  # id(LossScaleOptimizer) -> record
        self._unwrapped_scale: float | None = None  # see _wrap
        #: Lightning's toggle record and the 16-bit weights it switches off (plugin.py).
        self._toggled: tuple[object, list[torch.Tensor]] | None = None
        #: What the last optimizer step did (``None`` before the first).
        self.last_step: StepResult | None = None

    def __getstate__(self) -> dict[str, Any]:
        # ddp_spawn pickles the plugin into its workers before setup. A plugin that already ran
        # holds hooks and weak references: what goes across is the configuration and the scaler.
        state = self.__dict__.copy()
        for key in ("_module", "_lsos", "_records", "last_step", "_toggled"):
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
        """The ``LossScaleOptimizer``\\ s this plugin made whose torch optimizers
        live, in Lightning's order."""
        return list(self._lsos)

    # -- the model --------------------------------------------------------------------------

    def convert_module(self, module: nn.Module) -> nn.Module:
        """``auto_mixed_precision(module, policy, level, keep_float32)``, once per model.

        Lightning calls this at every ``fit``/``validate``/``test``; a model already prepared
        the same way is left as it is, one prepared otherwise is refused (``needs_preparation``)."""
        ours = f"{type(self).__name__}(policy={self.policy.name!r}, level={self.level!r})"
        keep = self.keep_float32
        # Prepared by this plugin already: its own arguments, whatever Lightning swapped in
        # since (DDP's sync_batchnorm replaces BatchNorm layers before fit's call only).
        ours_before = self._module is not None and self._module() is module
        if not ours_before and needs_preparation(
            module, self.policy, self.level, where=ours, keep_float32=keep, takes_amp_level=False
        ):
            auto_mixed_precision(module, self.policy, self.level, keep_float32=keep)
        self._module = weakref.ref(module)
        if self._scaler is None:
            # mixprec's one rule for the default: float16 math (from the policy, or a
            # to_float(..., float16) inside the model) needs dynamic scaling, nothing else does.
            needs = needs_scaling(list(module.parameters()))
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
        """Inputs pass as they are. Lightning's Trainer hands the whole batch here, targets
        included: its ``MixedPrecision`` passes it as it is too, and the model's region casts
        its floating inputs once at its boundary (O2, O3) while float targets stay float32.
        ``MixprecFabricPrecision`` casts (Fabric hands only the model's arguments)."""
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
            raise ArgumentError(
                f"{owner}: the optimizer is already a LossScaleOptimizer; return the plain "
                "torch optimizer (the plugin wraps it; pass loss_scaler= to the plugin)"
            )
        if isinstance(optimizer, torch.optim.LBFGS):
            raise ArgumentError(
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
        # Its optimizers share one scaler (and, toggled, a trunk) by design: the records
        # below bring each backward's gradients to the scale of the step.
        coordinated(lso._book)
        # Under DDP every rank starts from rank 0's float32 masters, not just its 16-bit
        # weights (a no-op outside torch.distributed).
        lso.broadcast_masters()
        self._lsos.append(lso, optimizer)
        live = {id(held) for held in self._lsos}
        self._records = {k: r for k, r in self._records.items() if k in live}
        # Backward passes made before this optimizer was wrapped (Fabric's first step) were
        # scaled by the scale then: the correction in _unscale needs it.
        self._records[id(lso)] = _Record(backward_scale=self._unwrapped_scale)
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
        scale = self.loss_scaler.get_scale()
        if not lsos:
            self._unwrapped_scale = scale
            return self.loss_scaler.scale(tensor)
        for lso in lsos:
            record = self._records[id(lso)]
            if record.unscaled:
                # Its gradients are unscaled in the masters already (clipped before this
                # backward): this one's would be left out (O2) or added still scaled (O1).
                raise MisuseError(
                    f"{type(self).__name__}: a backward after clip_gradients and before the "
                    f"optimizer's step: clip once per step, after the step's last backward "
                    "(its gradients would be lost, or applied without unscaling)"
                )
            if record.backward_scale is not None and record.backward_scale != scale:
                # Manual accumulation: an earlier backward of this step, then another
                # optimizer's step moved the shared scale. Those gradients are brought to
                # this scale, so that the one unscale at the step fits them all.
                grads = [p.grad for p in lso.model_params() if p.grad is not None]
                if grads:
                    torch._foreach_mul_(grads, scale / record.backward_scale)
            record.backward_scale = scale
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
        # Two optimizers, backward both, then step both (a GAN): the first step's scale
        # update moved the shared scale these gradients were not scaled by; they are
        # brought to it in the unscale's own pass, before its inf/NaN check.
        now, then = self.loss_scaler.get_scale(), record.backward_scale
        try:
            lso.unscale_(now / then if then is not None else 1.0)
        except MisuseError as err:
            raise MisuseError(
                f"{type(self).__name__}: optimizer step without a backward through the "
                "trainer; use self.manual_backward(loss) (Lightning) or fabric.backward(loss), "
                f"not loss.backward() ({err})"
            ) from None
        record.unscaled = True
        record.backward_scale = None

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
            raise ArgumentError(
                f"{owner}.load_state_dict: not a {owner} state; missing {', '.join(missing)}"
            )
        saved_policy = state_dict.get("policy")
        if saved_policy is not None and saved_policy != str(self.policy):
            raise ArgumentError(
                f"{owner}.load_state_dict: the checkpoint was trained with policy "
                f"{saved_policy!r}; this plugin runs {str(self.policy)!r}: resume with the same "
                "policy, or load the weights alone (a weights-only load) to change it"
            )
        if state_dict["level"] != self.level:
            raise ArgumentError(
                f"{owner}.load_state_dict: the checkpoint was trained at level "
                f"{state_dict['level']!r} (policy {state_dict.get('policy')!r}); this plugin "
                f"runs level {self.level!r}: resume with the same level"
            )
        self.loss_scaler.load_state_dict(state_dict["loss_scaler"])
