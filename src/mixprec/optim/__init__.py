"""``LossScaleOptimizer``: master weights, loss scaling, skip on overflow, clipping,
gradient accumulation, around any ``torch.optim`` optimizer.

One step: copy the 16-bit gradients into the float32 master gradients, unscale them with one
multi-tensor kernel that also finds inf/NaN, clip, make the one host synchronisation of the
step, then either apply the inner optimizer and copy the masters back into the 16-bit weights
(one multi-tensor copy), or skip, leaving weights and optimizer state untouched.
"""

from __future__ import annotations

import copy
import logging
import warnings
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from mixprec._dist import agree_found_inf, is_distributed, is_dtensor
from mixprec._dtypes import HALF_DTYPES, dtype_name
from mixprec._errors import ArgumentError, MisuseError, shown
from mixprec.casting import (
    COMPUTE_ATTR,
    LEVEL_ATTR,
    MASTERS_ATTR,
    POLICY_ATTR,
    take_float32_copy,
)
from mixprec.policy import Policy, global_policy
from mixprec.scaling import (
    DynamicLossScaler,
    LossScaler,
    NoOpLossScaler,
    StaticLossScaler,
    all_finite,
    checks_on_host,
    finite_on_cpu,
    unscale_grads_,
)
from mixprec.trace import Overflow, OverflowTracer, model_of

_log = logging.getLogger("mixprec")


@dataclass(frozen=True)
class StepResult:
    """What one ``step()`` did.

    ``applied``: the update was made (advance schedulers, EMA, step counters only then).
    ``found_inf``: the gradients held inf/NaN, so the update was skipped.
    ``scale``: the loss scale the gradients were computed with.
    ``grad_norm``: total norm of the unscaled gradients when ``max_grad_norm`` is set.
    ``accumulating``: this call only closed a micro-batch of gradient accumulation.
    """

    applied: bool
    found_inf: bool
    scale: float
    grad_norm: float | None = None
    accumulating: bool = False
    #: With ``trace_overflow``: the first module whose output or gradient was non-finite.
    overflow: Overflow | None = None

    @property
    def skipped(self) -> bool:
        """The step was due but not applied because of an overflow."""
        return self.found_inf


def _needs_scaling(params: list[torch.Tensor]) -> bool:
    """Float16 math needs loss scaling; decide from how the params' model was prepared."""
    tagged = False
    for p in params:
        if p.dtype == torch.float16 or getattr(p, COMPUTE_ATTR, None) == torch.float16:
            return True
        policy = getattr(p, POLICY_ATTR, None)
        if isinstance(policy, Policy):
            tagged = True
            if policy.loss_scaling == "dynamic" and getattr(p, LEVEL_ATTR, None) != "O0":
                return True
    return not tagged and global_policy().loss_scaling == "dynamic"


def _warn_if_eps_vanishes(group: dict[str, Any], where: str) -> None:
    """Pure float16 weights (O3) make Adam-style optimizers compute in float16, where the
    default eps=1e-8 rounds to 0: a zero gradient then gives 0/0 = NaN weights."""
    eps = group.get("eps")
    if not isinstance(eps, float) or eps <= 0:
        return
    vanishes = torch.tensor(eps, dtype=torch.float16).item() == 0.0
    if vanishes and any(p.dtype == torch.float16 for p in group["params"]):
        warnings.warn(
            f"{where} has eps={eps!r} and float16 parameters without float32 masters "
            "(level O3): eps rounds to 0 in float16 and a zero gradient will make NaN "
            "weights. Use eps >= 1e-4, or level O2.",
            UserWarning,
            stacklevel=3,
        )


def _check_param(p: Any, where: str) -> None:
    if not isinstance(p, torch.Tensor):
        raise TypeError(f"{where} must be a tensor, got {type(p).__name__}")
    if not p.is_floating_point():
        raise TypeError(
            f"{where} has dtype {p.dtype}; only floating-point parameters can be optimized "
            "(float32, float16, bfloat16)"
        )


@dataclass
class _Bookkeeping:
    """What one step leaves for the next. On an object of its own: inside
    ``torch.compile(opt.step)`` dynamo drops attribute writes on the ``Optimizer`` itself
    (torch 2.13; a write before the first graph break is lost), not on other objects."""

    versions: list[int]  # the 16-bit weights' version counters; see _follow_external_writes
    micro: int = 0  # backward passes since the last update
    fresh: bool = False  # a backward happened since the last step()
    found_inf: torch.Tensor | None = None  # set by unscale_()
    # Whether the float16 weights were finite after the last applied update; see _finish.
    weights_finite: torch.Tensor = field(default_factory=lambda: torch.ones((), dtype=torch.bool))


class LossScaleOptimizer(torch.optim.Optimizer):
    """Wrap ``optimizer`` for mixed precision training.

    16-bit parameters (made by ``auto_mixed_precision`` at O2, say) get float32 master copies
    that the inner optimizer updates, so its state stays float32; O3 parameters are updated in
    place, as O3 asks. ``loss_scaler`` defaults to a ``DynamicLossScaler`` when the
    parameters' model computes in float16, else a ``NoOpLossScaler`` (non-finite steps are
    still skipped). ``max_grad_norm`` clips the unscaled gradients (dense ones). With
    ``accumulation_steps=N``, ``backward`` adds ``loss / N`` and only every N-th ``step``
    updates; ``zero_grad`` in between keeps the sum.

    ``optimizer`` may be a list, e.g. ``[SparseAdam(embeddings), Adam(dense)]`` from
    ``split_embedding_parameters``: one loss scale, one backward, one finiteness check, and
    all of them step or all skip.

    It is a ``torch.optim.Optimizer``, so learning-rate schedulers accept it; their
    ``param_groups`` are the inner optimizers'.

    Keras 3's keywords ``initial_scale=`` and ``dynamic_growth_steps=`` give Keras 3's
    schedule (start at ``2**15``, double after ``2000`` clean steps, halve on overflow, no
    ceiling, no floor above float32's smallest normal) in place of mixprec's default.
    """

    def __init__(
        self,
        optimizer: torch.optim.Optimizer | Sequence[torch.optim.Optimizer],
        loss_scaler: LossScaler | None = None,
        max_grad_norm: float | None = None,
        accumulation_steps: int = 1,
        trace_overflow: bool | nn.Module = False,
        *,
        initial_scale: float | None = None,
        dynamic_growth_steps: int | None = None,
    ) -> None:
        # torch.optim.Optimizer.__init__ is not called: groups and state are the inner ones.
        if initial_scale is not None or dynamic_growth_steps is not None:
            loss_scaler = _keras_scaler(loss_scaler, initial_scale, dynamic_growth_steps)
        optimizers = [optimizer] if isinstance(optimizer, torch.optim.Optimizer) else optimizer
        if not isinstance(optimizers, (list, tuple)) or not optimizers:
            raise TypeError(
                "optimizer must be a torch.optim.Optimizer or a non-empty list of them, got "
                f"{type(optimizer).__name__}"
            )
        for inner in optimizers:
            if isinstance(inner, LossScaleOptimizer):
                raise TypeError("optimizer is already a LossScaleOptimizer; wrap the inner one")
            if not isinstance(inner, torch.optim.Optimizer):
                raise TypeError(
                    f"optimizer must be a torch.optim.Optimizer, got {type(inner).__name__}"
                )
        if loss_scaler is not None and not isinstance(loss_scaler, LossScaler):
            raise TypeError(
                "loss_scaler must be a NoOpLossScaler, StaticLossScaler or DynamicLossScaler, "
                f"got {type(loss_scaler).__name__}"
            )
        if max_grad_norm is not None and (
            isinstance(max_grad_norm, bool)
            or not isinstance(max_grad_norm, (int, float))
            or not 0 < max_grad_norm < torch.finfo(torch.float64).max  # 10**400 too
        ):
            raise ArgumentError(
                f"max_grad_norm={shown(max_grad_norm)} is invalid; use a finite number > 0 or None"
            )
        if isinstance(accumulation_steps, bool) or not isinstance(accumulation_steps, int):
            raise TypeError(f"accumulation_steps must be an int, got {accumulation_steps!r}")
        if accumulation_steps < 1:
            raise ArgumentError(
                f"accumulation_steps={accumulation_steps!r} is invalid; it must be >= 1"
            )
        self.optimizers: list[torch.optim.Optimizer] = list(optimizers)
        self.max_grad_norm = None if max_grad_norm is None else float(max_grad_norm)
        self.accumulation_steps = accumulation_steps
        self._half: list[torch.Tensor] = []  # 16-bit model parameters with masters
        self._masters: list[torch.Tensor] = []  # their float32 masters, same order
        self._plain: list[torch.Tensor] = []  # parameters the inner optimizer updates as is
        self._index: dict[int, tuple[bool, int]] = {}  # id(param) -> (has master, position)
        # float16 weights, which an update can push past 65504 while their float32 masters
        # stay finite: checked after each applied step, read at the next one's
        # synchronisation. (bfloat16 has float32's range: it overflows only where float32
        # training would, which no one checks either.)
        self._checked: list[torch.Tensor] = []
        for inner in self.optimizers:
            for i, group in enumerate(inner.param_groups):
                group["params"] = self._adopt(inner, group["params"], f"param_groups[{i}]")
                _warn_if_eps_vanishes(group, f"{type(inner).__name__} param_groups[{i}]")
        for inner in self.optimizers:
            for group in inner.param_groups:
                _fuse(inner, group)
        model_params = self._half + self._plain
        # Where found_inf lives when no parameter has a gradient (a rank with none).
        self._device = model_params[0].device if model_params else None
        self._loss_scaler = loss_scaler or (
            DynamicLossScaler() if _needs_scaling(model_params) else NoOpLossScaler()
        )
        self._book = _Bookkeeping(self._half_versions())
        self._tracer = self._make_tracer(trace_overflow, model_params)

    @staticmethod
    def _make_tracer(
        trace_overflow: bool | nn.Module, params: list[torch.Tensor]
    ) -> OverflowTracer | None:
        if trace_overflow is False:
            return None  # no hooks at all: tracing off costs nothing
        model = trace_overflow if isinstance(trace_overflow, nn.Module) else model_of(params)
        if model is None or (
            trace_overflow is not True and not isinstance(trace_overflow, nn.Module)
        ):
            raise ValueError(
                f"trace_overflow={trace_overflow!r}: pass the model (trace_overflow=model) "
                "unless it was prepared with auto_mixed_precision"
            )
        return OverflowTracer(model)

    # -- parameters -------------------------------------------------------------------------

    def _adopt(
        self, inner: torch.optim.Optimizer, params: list[torch.Tensor], where: str
    ) -> list[torch.Tensor]:
        """Swap 16-bit parameters for float32 masters in a param group's list."""
        adopted = []
        for j, p in enumerate(params):
            _check_param(p, f"{where}['params'][{j}]")
            if p.dtype == torch.float16:
                self._checked.append(_local(p))
            if p.dtype in HALF_DTYPES and (
                getattr(p, LEVEL_ATTR, None) != "O3" or getattr(p, MASTERS_ATTR, False)
            ):
                # Start from the float32 values auto_mixed_precision kept, when they are
                # still current (not after a load_state_dict into the 16-bit model).
                original = take_float32_copy(p)
                master = original if original is not None else p.detach().float()
                master.requires_grad_(True)
                state = inner.state.pop(p, None)
                if state:
                    # Moments become float32 like the master; scalar entries (step) stay as is.
                    inner.state[master] = {
                        k: v.float()
                        if torch.is_tensor(v) and v.is_floating_point() and v.dim()
                        else v
                        for k, v in state.items()
                    }
                self._index[id(p)] = (True, len(self._half))
                self._half.append(p)
                self._masters.append(master)
                adopted.append(master)
            else:
                self._index[id(p)] = (False, len(self._plain))
                self._plain.append(p)
                adopted.append(p)
        return adopted

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        group = dict(param_group)
        params = group["params"]
        params = [params] if isinstance(params, torch.Tensor) else list(params)
        group["params"] = self._adopt(self.optimizer, params, "param_group")
        self._book.versions = self._half_versions()  # new 16-bit parameters have versions too
        self.optimizer.add_param_group(group)
        _fuse(self.optimizer, self.optimizer.param_groups[-1])

    @property
    def optimizer(self) -> torch.optim.Optimizer:
        """The inner optimizer (the first one, when several were given)."""
        return self.optimizers[0]

    @property
    def param_groups(self) -> list[dict[str, Any]]:  # type: ignore[override]
        """The inner optimizers' groups (the same dicts: changing ``lr`` here changes it)."""
        if len(self.optimizers) == 1:
            return self.optimizers[0].param_groups
        return [g for inner in self.optimizers for g in inner.param_groups]

    @property
    def state(self) -> Any:  # type: ignore[override]
        if len(self.optimizers) == 1:
            return self.optimizers[0].state
        return {k: v for inner in self.optimizers for k, v in inner.state.items()}

    @property
    def defaults(self) -> dict[str, Any]:  # type: ignore[override]
        return self.optimizer.defaults

    @property
    def loss_scaler(self) -> LossScaler:
        return self._loss_scaler

    def broadcast_masters(self, src: int = 0) -> None:
        """Make every rank's float32 masters (and so 16-bit weights) those of rank ``src``.

        DDP broadcasts rank 0's 16-bit weights when it wraps a model; this sends the
        float32 masters behind them too, so no rank starts from rounded values."""
        import torch.distributed as dist

        if not (dist.is_available() and dist.is_initialized()):
            return
        with torch.no_grad():
            for master in self._masters:
                dist.broadcast(master, src)
            if self._half:
                torch._foreach_copy_(self._half, self._masters)
        self._book.versions = self._half_versions()

    def master_weights(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """``(16-bit model parameter, its float32 master)`` pairs."""
        return list(zip(self._half, self._masters, strict=True))

    def master_params(self) -> Iterator[torch.Tensor]:
        """The tensors the inner optimizer updates (float32 masters and plain parameters);
        after ``unscale_()`` their ``.grad`` holds the unscaled gradients."""
        for group in self.param_groups:
            yield from group["params"]

    # -- gradients --------------------------------------------------------------------------

    def backward(self, loss: torch.Tensor, **kwargs: Any) -> None:
        """``(loss * scale / accumulation_steps).backward(**kwargs)``."""
        self.get_scaled_loss(loss).backward(**kwargs)

    def get_scaled_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """``loss * scale / accumulation_steps`` (Keras ``get_scaled_loss``; the division
        only matters with accumulation, where it makes the summed gradients a mean, as
        ``backward`` does)."""
        self._book.micro += 1
        self._book.fresh = True
        factor = self._loss_scaler.get_scale() / self.accumulation_steps
        return loss * factor if factor != 1.0 else loss

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """``loss * scale`` (Keras 3's ``scale_loss``): a pure read that starts no
        micro-batch, for logging or for ``torch.autograd.grad`` followed by
        ``apply_gradients(zip(get_unscaled_gradients(grads), params))``. To train,
        use ``backward(loss)``, which also counts the micro-batch."""
        scale = self._loss_scaler.get_scale()
        return loss * scale if scale != 1.0 else loss

    def get_unscaled_gradients(
        self, grads: Iterable[torch.Tensor | None]
    ) -> list[torch.Tensor | None]:
        """New gradients divided by the scale; ``None`` stays ``None`` (Keras semantics).

        16-bit gradients come back in float32 (the dtype of their masters): unscaled in
        float16, small values would flush to zero."""
        inv = 1.0 / self._loss_scaler.get_scale()
        return [
            None if g is None else (g.float() if g.dtype in HALF_DTYPES else g) * inv for g in grads
        ]

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear the model's gradients, except between the micro-batches of an accumulation."""
        if 0 < self._book.micro < self.accumulation_steps:
            return
        params = self._half + self._plain
        if set_to_none:
            # The float32 master gradients go too: kept, they would sit beside the next
            # forward's activations (4 bytes a parameter at the peak), unlike float32 training.
            for p in params + self._masters:
                p.grad = None
        else:
            grads = [p.grad for p in params if p.grad is not None]
            if grads:
                torch._foreach_zero_(grads)

    def _load_master_grads(self) -> None:
        src, dst = [], []
        for p, m in zip(self._half, self._masters, strict=True):
            g = p.grad
            if g is None:
                m.grad = None
            elif g.is_sparse:
                # Widen before coalescing: summing duplicate indices in 16 bits can overflow.
                m.grad = g.float().coalesce()
            else:
                if m.grad is None or m.grad.is_sparse:
                    m.grad = torch.empty_like(m)
                src.append(g)
                dst.append(m.grad)
        if src:
            torch._foreach_copy_(dst, src)

    def _plain_grads(self) -> list[torch.Tensor]:
        grads = []
        for p in self._plain:
            if p.grad is not None:
                if p.grad.is_sparse and p.grad.dtype == torch.float16:
                    p.grad = p.grad.coalesce()
                grads.append(p.grad)
        return grads

    def _step_grads(self) -> list[torch.Tensor]:
        return [m.grad for m in self._masters if m.grad is not None] + self._plain_grads()

    def unscale_(self) -> None:
        """Unscale now (to inspect or clip ``master_params()`` grads yourself); ``step``
        then does not unscale again."""
        if self._book.found_inf is not None:
            raise MisuseError(
                "LossScaleOptimizer.unscale_() has already been called since the last step()"
            )
        if not self._book.fresh:
            raise MisuseError(
                "LossScaleOptimizer.unscale_() called without a backward() since the last step()"
            )
        if self._book.micro < self.accumulation_steps:
            raise MisuseError(
                f"LossScaleOptimizer.unscale_() called after {self._book.micro} of "
                f"{self.accumulation_steps} accumulation micro-batches; call it after the last"
            )
        self._unscale()

    def _half_versions(self) -> list[int]:
        return [p._version for p in self._half]

    def _follow_external_writes(self) -> None:
        """A 16-bit weight written outside this optimizer (``model.load_state_dict``)
        replaces its master; otherwise the next copy-back would undo the write."""
        versions = self._half_versions()
        if versions != self._book.versions:
            with torch.no_grad():
                for p, m, now, then in zip(
                    self._half, self._masters, versions, self._book.versions, strict=True
                ):
                    if now != then:
                        m.copy_(p)
            self._book.versions = versions

    def _unscale(self) -> None:
        self._follow_external_writes()
        self._load_master_grads()
        self._book.found_inf = self._loss_scaler.unscale_(self._step_grads(), self._device)

    # -- the step ---------------------------------------------------------------------------

    def step(self, closure: Callable[[], float] | None = None) -> StepResult:  # type: ignore[override]
        """Unscale once, check, clip, apply or skip, update the scale; see ``StepResult``."""
        if closure is not None:
            raise MisuseError("LossScaleOptimizer.step() does not take a closure")
        if not self._book.fresh:
            raise MisuseError(
                "LossScaleOptimizer.step() called without a new backward since the last step(): "
                "call opt.backward(loss) (or backward on opt.get_scaled_loss(loss)) first"
            )
        self._book.fresh = False
        if self._book.micro < self.accumulation_steps:
            return StepResult(False, False, self._loss_scaler.get_scale(), accumulating=True)
        if self._book.found_inf is None:
            result = self._host_step()
            if result is not None:
                return result
            self._unscale()
        return self._finish()

    def _host_step(self) -> StepResult | None:
        """The whole step with a Python bool for ``found_inf``, or None where the general path
        is needed: float32 (O0, ``auto`` on a CPU without fast 16-bit math) and bfloat16 O1
        and O3 on CPU, one process, nothing to unscale, copy back, clip or trace. The check
        reads its answer at once, and the tensor flags, collective and copies of ``_finish``
        would be per-step work that float32 training does not do."""
        if (
            self._half
            or self._checked
            or self.max_grad_norm is not None
            or self._tracer is not None
            or type(self._loss_scaler) not in _HOST_SCALERS
            or self._loss_scaler.get_scale() != 1.0
            or is_distributed()
        ):
            return None
        grads = [g._values() if g.is_sparse else g for g in self._plain_grads()]
        if not checks_on_host(grads):
            return None
        overflow = bool(grads) and not finite_on_cpu(grads)
        # The tail of _finish, restated: as a function of its own shared by both, it cost
        # torch.compile(opt.step) two more graphs, and dynamo then traced the scaler's
        # float32 rounding into a recursion in its struct polyfill (torch 2.13).
        if not overflow:
            for inner in self.optimizers:
                _unfuse_sparse(inner)
                inner.step()
        self._loss_scaler.update(overflow)
        self._book.micro = 0
        return StepResult(applied=not overflow, found_inf=overflow, scale=1.0)

    def apply_gradients(
        self, grads_and_vars: Iterable[tuple[torch.Tensor | None, torch.Tensor]]
    ) -> StepResult:
        """Apply already unscaled gradients (Keras ``apply_gradients``): check them, clip,
        apply or skip, update the scale."""
        pairs = list(grads_and_vars)
        self._follow_external_writes()
        for p in self._half + self._plain:
            p.grad = None
        for m in self._masters:
            m.grad = None
        for k, (grad, var) in enumerate(pairs):
            slot = self._index.get(id(var))
            if slot is None:
                raise ValueError(
                    f"apply_gradients: variable {k} (shape {tuple(var.shape)}, {var.dtype}) is "
                    "not a parameter of this optimizer"
                )
            if grad is None:
                continue
            if grad.shape != var.shape:
                raise ValueError(
                    f"apply_gradients: gradient {k} has shape {tuple(grad.shape)}, its variable "
                    f"{tuple(var.shape)}"
                )
            has_master, pos = slot
            target = self._masters[pos] if has_master else var
            target.grad = grad.detach().to(target.dtype)
        self._book.micro = self.accumulation_steps
        self._book.fresh = False
        self._book.found_inf = unscale_grads_(self._step_grads(), 1.0, self._device)
        return self._finish()

    def _finish(self) -> StepResult:
        # Flags agreed across ranks in one collective: this step's found_inf, and whether the
        # last applied update made a float16 weight inf/NaN (checked then, read now: no extra
        # host synchronisation). A skipped step changed no weight and sends the same answer
        # again, so a compiled step has one shape whichever steps were skipped.
        flags = [self._book.found_inf.reshape(1).float()]  # type: ignore[union-attr]
        if self._checked:
            flags.append((~self._book.weights_finite).reshape(1).to(flags[0]))
        agreed = agree_found_inf(flags[0] if len(flags) == 1 else torch.cat(flags))
        scale = self._loss_scaler.get_scale()
        norm = None
        if self.max_grad_norm is not None:
            dense = [p for p in self.master_params() if p.grad is not None and not p.grad.is_sparse]
            norm = nn.utils.clip_grad_norm_(dense, self.max_grad_norm, foreach=True)
            if is_dtensor(norm):  # FSDP2: the norm over every shard
                norm = norm.full_tensor()  # type: ignore[attr-defined]
        # The one host synchronisation of the step: the flags (and the norm) together.
        if norm is not None:
            *found_flags, norm_value = torch.cat([agreed, norm.reshape(1).to(agreed)]).tolist()
        else:
            found_flags, norm_value = agreed.tolist(), None
        if len(found_flags) > 1 and found_flags[1]:
            self._book.weights_finite = torch.ones((), dtype=torch.bool)  # said once
            self._raise_nonfinite_weights()
        overflow = bool(found_flags[0])
        origin = None
        if self._tracer is not None:
            origin = self._tracer.first_overflow() if overflow else None
            self._tracer.clear()
            if origin is not None:
                _log.warning("step skipped: overflow first in %s", origin)
        if not overflow:
            for inner in self.optimizers:
                _unfuse_sparse(inner)
                inner.step()
            if self._half:
                with torch.no_grad():
                    torch._foreach_copy_(self._half, self._masters)
                self._book.versions = self._half_versions()
            if self._checked:
                self._book.weights_finite = all_finite(self._checked)
        self._loss_scaler.update(overflow)
        self._book.micro = 0
        self._book.found_inf = None
        return StepResult(
            applied=not overflow,
            found_inf=overflow,
            scale=scale,
            grad_norm=norm_value,
            overflow=origin,
        )

    def _raise_nonfinite_weights(self) -> None:
        """Raise ``FloatingPointError`` naming the float16 weights that are inf or NaN."""
        params = self._half + self._plain
        model = model_of(params)
        names = {id(p): n for n, p in model.named_parameters()} if model is not None else {}
        lines = []
        for k, p in enumerate(params):
            if p.dtype != torch.float16 or bool(all_finite([_local(p)])):
                continue
            line = f"{names.get(id(p), f'parameter {k}')} ({dtype_name(p.dtype)}"
            if k < len(self._half):
                master = self._masters[k].detach()
                line += f"; its float32 master's largest |value| is {master.abs().max().item():g}"
            lines.append(line + ")")
        more = f"; and {len(lines) - 5} more" if len(lines) > 5 else ""
        found = "; ".join(lines[:5]) + more if lines else "on another rank"
        raise FloatingPointError(
            f"float16 weights became inf or NaN in the last applied update: {found}. Every "
            "later step would train on them. float16 holds no value past 65504: keep the "
            "module in float32 (keep_float32=[...]) or train in bfloat16 "
            "(policy='mixed_bfloat16'); an inf or NaN master needs a smaller learning rate or "
            "max_grad_norm="
        )

    # -- checkpointing ----------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """Inner optimizer state, float32 master weights and the loss scaler's state.

        Take it between steps: gradients accumulated mid-way are not part of it."""
        return {
            "optimizers": [inner.state_dict() for inner in self.optimizers],
            "master_weights": [m.detach() for m in self._masters],
            "loss_scaler": self._loss_scaler.state_dict(),
            "micro_steps": self._book.micro,
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if not isinstance(state_dict, dict):
            raise TypeError(
                "load_state_dict: a LossScaleOptimizer state is a dict (from state_dict()), "
                f"got {type(state_dict).__name__}"
            )
        missing = [
            k for k in ("optimizers", "master_weights", "loss_scaler") if k not in state_dict
        ]
        if missing:
            raise ValueError(
                f"load_state_dict: not a LossScaleOptimizer state; missing {', '.join(missing)}"
            )
        masters = state_dict["master_weights"]
        inner_states = state_dict["optimizers"]
        for key, value, kind in (
            ("master_weights", masters, torch.Tensor),
            ("optimizers", inner_states, dict),
        ):
            if not isinstance(value, (list, tuple)) or not all(isinstance(v, kind) for v in value):
                raise TypeError(
                    f"load_state_dict: '{key}' must be a list of {kind.__name__}, got "
                    f"{type(value).__name__}"
                    + (
                        f" of {sorted({type(v).__name__ for v in value})}"
                        if isinstance(value, (list, tuple))
                        else ""
                    )
                )
        _same_count("master weights", masters, self._masters)
        _same_count("inner optimizers", inner_states, self.optimizers)
        for i, (saved, master) in enumerate(zip(masters, self._masters, strict=True)):
            if saved.shape != master.shape:
                raise ValueError(
                    f"load_state_dict: master weight {i} has shape {tuple(saved.shape)}, "
                    f"expected {tuple(master.shape)}"
                )
        # The scaler's state is checked on a copy first, so that a bad one changes nothing.
        copy.deepcopy(self._loss_scaler).load_state_dict(state_dict["loss_scaler"])
        for inner, inner_state in zip(self.optimizers, inner_states, strict=True):
            inner.load_state_dict(inner_state)
        self._loss_scaler.load_state_dict(state_dict["loss_scaler"])
        with torch.no_grad():
            if masters:
                torch._foreach_copy_(self._masters, list(masters))
                torch._foreach_copy_(self._half, self._masters)
        self._book.versions = self._half_versions()
        self._book.micro = int(state_dict.get("micro_steps", 0))
        self._book.fresh = False
        self._book.found_inf = None

    def register_step_pre_hook(self, hook: Any) -> Any:
        """Runs before the (first) inner optimizer's step, that is, only on applied steps."""
        return self.optimizer.register_step_pre_hook(hook)

    def register_step_post_hook(self, hook: Any) -> Any:
        """Runs after the (first) inner optimizer's step, that is, only on applied steps."""
        return self.optimizer.register_step_post_hook(hook)

    def __getstate__(self) -> dict[str, Any]:
        return self.__dict__.copy()

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)

    def __repr__(self) -> str:
        return (
            f"LossScaleOptimizer({'+'.join(type(o).__name__ for o in self.optimizers)}, "
            f"loss_scaler={self._loss_scaler!r}, masters={len(self._masters)}, "
            f"max_grad_norm={self.max_grad_norm}, accumulation_steps={self.accumulation_steps})"
        )


#: torch optimizers with a fused kernel (one per step for all parameters, on CPU and CUDA).
_FUSABLE: tuple[type[torch.optim.Optimizer], ...] = (
    torch.optim.Adam,
    torch.optim.AdamW,
    torch.optim.SGD,
)


# Scalers whose scale-1 unscale is the finiteness check alone (a subclass may do more).
_HOST_SCALERS = (NoOpLossScaler, StaticLossScaler, DynamicLossScaler)


def _local(p: torch.Tensor) -> torch.Tensor:
    """The local shard of an FSDP2 parameter, else the parameter."""
    return p.to_local() if is_dtensor(p) else p  # type: ignore[attr-defined,no-any-return]


def _keras_scaler(
    loss_scaler: LossScaler | None, initial_scale: float | None, growth_steps: int | None
) -> DynamicLossScaler:
    """Keras 3's dynamic schedule, reached through its keyword names."""
    if loss_scaler is not None:
        raise TypeError(
            "LossScaleOptimizer takes loss_scaler= or Keras' initial_scale=/"
            "dynamic_growth_steps=, not both"
        )
    try:
        return DynamicLossScaler(
            init_scale=2.0**15 if initial_scale is None else initial_scale,
            growth_interval=2000 if growth_steps is None else growth_steps,
            min_scale=None,  # Keras 3 has no floor; float32's smallest normal is ours
            max_scale=None,
        )
    except (ArgumentError, TypeError) as err:  # name the arguments the user wrote
        text = str(err).replace("init_scale", "initial_scale")
        raise type(err)(text.replace("growth_interval", "dynamic_growth_steps")) from None


def _fuse(inner: torch.optim.Optimizer, group: dict[str, Any]) -> None:
    """Switch ``group`` to torch's fused kernel where the user left the choice to torch
    (``fused`` and ``foreach`` both None).

    On CPU torch then picks the per-parameter loop: AdamW on the LM d512's parameters took
    30-40 ms a step that way and 9-10 ms fused. Not once the optimizer has state (its
    ``step`` counters would be in the loop's format), and not for FSDP2's DTensor
    parameters (the fused kernels have no sharding rule)."""
    if (
        type(inner) not in _FUSABLE
        # Plain SGD (no momentum) is one add per parameter: torch's loop is faster than the
        # fused kernel on CPU (141 against 158 us a step for the MLP's 0.67 M, one thread).
        or (type(inner) is torch.optim.SGD and not group.get("momentum"))
        or inner.state
        or group.get("fused", False) is not None
        or group.get("foreach") is not None
        or group.get("differentiable")
        or group.get("capturable")
        or not all(
            p.device.type in ("cpu", "cuda") and p.dtype in _FUSED_DTYPES and not is_dtensor(p)
            for p in group["params"]
        )
    ):
        return
    # Not _step_supports_amp_scaling, which fused=True in the constructor also sets: it
    # would make a GradScaler leave skipping to the kernel, and fused SGD still moves its
    # momentum on a skipped step. This wrapper never calls the inner step on overflow.
    group["fused"] = True


def _unfuse_sparse(inner: torch.optim.Optimizer) -> None:
    """Fused groups with sparse gradients (a sparse embedding) step unfused from then on:
    torch's fused kernels refuse them, and which parameters get sparse gradients does not
    change between steps. Only fused groups are walked: other optimizers pay nothing."""
    if type(inner) not in _FUSABLE:
        return
    for group in inner.param_groups:
        if group.get("fused") and any(
            p.grad is not None and p.grad.is_sparse for p in group["params"]
        ):
            group["fused"] = False


# Not 16-bit parameters (O3): torch 2.12-2.13's fused CPU SGD skips the vectorised part of
# float16/bfloat16 updates (pytorch/pytorch#191763); pure float16 SGD diverged with it.
_FUSED_DTYPES = (torch.float32, torch.float64)


def _same_count(what: str, saved: Sequence[Any], ours: Sequence[Any]) -> None:
    if len(saved) != len(ours):
        raise ValueError(
            f"load_state_dict: state has {len(saved)} {what}, this LossScaleOptimizer {len(ours)}"
        )


def split_embedding_parameters(
    model: nn.Module,
) -> tuple[list[nn.Parameter], list[nn.Parameter]]:
    """``(embedding parameters, other parameters)`` of ``model``, each in model order.

    Embedding tables (``nn.Embedding``, ``nn.EmbeddingBag``) are usually given their own
    optimizer (``SparseAdam`` for sparse gradients) and, in distributed runs, are not
    all-reduced like dense weights. A weight tied between an embedding and another module
    counts as an embedding.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(
            f"split_embedding_parameters(model=...) needs an nn.Module, got {type(model).__name__}"
        )
    tables = {
        id(p)
        for m in model.modules()
        if isinstance(m, (nn.Embedding, nn.EmbeddingBag))
        for p in m.parameters(recurse=False)
    }
    params = list(model.parameters())
    return [p for p in params if id(p) in tables], [p for p in params if id(p) not in tables]
