"""``FusedStep``: torch's fused Adam, AdamW and SGD kernels (and plain SGD's one add per
parameter) called with tensor lists built once.

``Optimizer.step()`` rebuilds its tensor lists, groups them by device and dtype, and runs
its hooks and a profiler record on every call. For small models that is a large share of
the step: fused AdamW on the MLP 784-512-512-10 took 492 us through ``opt.step()`` and 318
us as the same two kernel calls with lists cached (2 threads, Intel Xeon with AMX,
torch 2.13). ``FusedStep`` makes exactly the calls torch's ``_fused_adam`` and
``_fused_sgd`` make (the same update, bit for bit, and the same state) once the
optimizer's own first step has built its state.

It hands back to ``opt.step()`` (``step`` returns False) whenever torch's step could do
something it does not: hooks (but mixprec's own guard, which is done after an optimizer's
first step), a ``step`` patched on the instance (a learning-rate scheduler given the inner
optimizer), the profiler, a group that is not fused or has capturable, differentiable or
tensor hyperparameters, mixed devices or dtypes in a group, a parameter without a
gradient, or state it has not seen (``load_state_dict`` replaces it).
"""

from __future__ import annotations

from typing import Any, cast

import torch

from mixprec._plain_optimizers import no_other_global_hooks
from mixprec.optim.layouts import match_state_layouts, refuse_misshapen

__all__ = ["FusedStep"]

_ADAM = (torch.optim.Adam, torch.optim.AdamW)
_SGD = torch.optim.SGD

# One group's cache: (group dict, its parameters, the state keys the kernel takes, each
# parameter's state dict, the state lists the kernel takes, one per key).
_Cached = tuple[
    dict[str, Any],
    tuple[torch.Tensor, ...],
    tuple[str, ...],
    list[dict[str, Any]],
    list[list[torch.Tensor]],
]


class FusedStep:
    """The inner optimizer's step as direct fused-kernel calls, where that is the same."""

    def __init__(self, inner: torch.optim.Optimizer) -> None:
        self.inner = inner
        self._kind = type(inner) if type(inner) in (*_ADAM, _SGD) else None
        self._state: object = None  # the inner.state the lists were built from
        self._cached: list[_Cached] = []

    def step(self, found_inf: torch.Tensor | None = None) -> bool:
        """Step the inner optimizer directly; False (nothing done) where it must step
        itself. With ``found_inf`` (a 0-dim float32 tensor on the parameters' device) the
        fused kernels skip the update on the device when it is nonzero, as torch's
        optimizers do for ``GradScaler``: no host read decides; plain SGD cannot, so it
        answers False then."""
        return _step_eagerly(self, found_inf)  # type: ignore[no-any-return]

    def _step(self, found_inf: torch.Tensor | None) -> bool:
        match_state_layouts(self.inner)  # a state tensor replaced: the lists are rebuilt
        grads = self._grads(skip_on_device=found_inf is not None)
        if grads is None:
            return False
        if torch.autograd.profiler._is_profiler_enabled:
            # Labelled as torch labels its own step, so that a profile (profile_step's too)
            # sees the step training runs.
            name = f"Optimizer.step#{type(self.inner).__name__}.step"
            with torch.autograd.profiler.record_function(name):
                self._calls(grads, found_inf)
        else:
            self._calls(grads, found_inf)
        return True

    def _calls(self, grads: list[list[torch.Tensor]], found_inf: torch.Tensor | None) -> None:
        with torch.no_grad():
            for (group, params, _, _, lists), g in zip(self._cached, grads, strict=True):
                if params:
                    self._call(group, params, g, lists, found_inf)

    def _grads(self, skip_on_device: bool) -> list[list[torch.Tensor]] | None:
        """Each cached group's gradients, or None where ``inner.step()`` must run."""
        inner = self.inner
        if (
            self._kind is None
            or "step" in inner.__dict__
            or inner._optimizer_step_pre_hooks
            or inner._optimizer_step_post_hooks
            or not no_other_global_hooks()
            # Set by a GradScaler for torch's own step to read (adam.py, sgd.py).
            or getattr(inner, "grad_scale", None) is not None
            or getattr(inner, "found_inf", None) is not None
        ):
            return None
        stale = self._state is not inner.state or len(self._cached) != len(inner.param_groups)
        if stale:
            refuse_misshapen(inner)  # a state loaded: checked before any kernel runs
            if not self._build():
                return None
        grads = []
        for j, (group, params, keys, states, lists) in enumerate(self._cached):
            if (
                inner.param_groups[j] is not group
                or not self._plain(group)
                or len(lists) != self._lists_needed(group)  # amsgrad or momentum switched
                or not _same(group["params"], params)  # a parameter replaced or reordered
                or not self._same_state(params, keys, states, lists)
            ):
                self._state = None  # rebuilt (or refused) next time
                refuse_misshapen(inner, always=True)  # a state tensor replaced
                return None
            if skip_on_device and not group.get("fused"):
                return None
            g = [p.grad for p in params]
            if any(t is None for t in g):
                return None
            grads.append(cast(list[torch.Tensor], g))
        return grads

    def _plain(self, group: dict[str, Any]) -> bool:
        """The group runs torch's fused kernel, or is plain SGD (one add per parameter),
        with Python-number hyperparameters."""
        if group.get("differentiable") or not isinstance(group["lr"], float):
            return False
        if self._kind is _SGD and not group.get("fused"):
            return not (group["momentum"] or group["weight_decay"] or group["maximize"])
        if group.get("fused") is not True:
            return False
        if self._kind is _SGD:
            return True
        return not group.get("capturable") and all(isinstance(b, float) for b in group["betas"])

    def _same_state(
        self,
        params: tuple[torch.Tensor, ...],
        keys: tuple[str, ...],
        states: list[dict[str, Any]],
        lists: list[list[torch.Tensor]],
    ) -> bool:
        """Every parameter's state is the dict, and holds the tensors, the lists were built
        from (``state.clear()``, ``state[p]["exp_avg"] = t`` replace them)."""
        state = self.inner.state
        for i, p in enumerate(params if keys else ()):
            now = state.get(p)
            if now is not states[i] or any(
                now.get(key) is not lst[i] for key, lst in zip(keys, lists, strict=True)
            ):
                return False
        return True

    def _lists_needed(self, group: dict[str, Any]) -> int:
        if self._kind is _SGD:
            return 1 if group["momentum"] else 0
        return 4 if group["amsgrad"] else 3

    def _build(self) -> bool:
        """Cache every group's lists from the optimizer's state; False before its first
        step (no state yet) or for anything ``step`` does not cover."""
        inner, cached = self.inner, []
        for group in inner.param_groups:
            params = group["params"]
            if not self._plain(group):
                return False
            if params and len({(p.device, p.dtype) for p in params}) != 1:
                return False  # torch would make one call per (device, dtype)
            keys = (
                ("momentum_buffer",)
                if self._kind is _SGD
                else ("exp_avg", "exp_avg_sq", "step")
                + (("max_exp_avg_sq",) if group["amsgrad"] else ())
            )
            if self._kind is _SGD and not group["momentum"]:
                keys = ()  # SGD without momentum keeps no state
            found = [inner.state.get(p) for p in params] if keys else []
            if any(not s for s in found):
                return False
            states: list[dict[str, Any]] = found  # type: ignore[assignment]
            got = [[s.get(k) for s in states] for k in keys]
            if any(not isinstance(t, torch.Tensor) for lst in got for t in lst):
                return False
            lists = cast(list[list[torch.Tensor]], got)
            if self._kind is not _SGD and any(
                t.device != p.device for t, p in zip(lists[2], params, strict=True)
            ):
                return False
            cached.append((group, tuple(params), keys, states, lists))
        self._cached, self._state = cached, inner.state
        return True

    def _call(
        self,
        group: dict[str, Any],
        params: tuple[torch.Tensor, ...],
        grads: list[torch.Tensor],
        lists: list[list[torch.Tensor]],
        found_inf: torch.Tensor | None,
    ) -> None:
        if found_inf is not None and found_inf.device != params[0].device:
            found_inf = found_inf.to(params[0].device)  # groups on other devices
        if self._kind is _SGD and not group.get("fused"):
            # torch's SGD without momentum: param.add_(grad, alpha=-lr), per parameter.
            torch._foreach_add_(params, grads, alpha=-group["lr"])
            return
        if self._kind is _SGD:
            torch._fused_sgd_(
                params,
                grads,
                lists[0] if lists else [],
                weight_decay=group["weight_decay"],
                momentum=group["momentum"],
                lr=group["lr"],
                dampening=group["dampening"],
                nesterov=group["nesterov"],
                maximize=group["maximize"],
                is_first_step=False,  # the state holds the momentum buffers
                found_inf=found_inf,
            )
            return
        exp_avgs, exp_avg_sqs, steps = lists[:3]
        torch._foreach_add_(steps, 1)
        decoupled = group.get("decoupled_weight_decay", self._kind is torch.optim.AdamW)
        kernel = torch._fused_adamw_ if decoupled else torch._fused_adam_
        beta1, beta2 = group["betas"]
        kernel(
            params,
            grads,
            exp_avgs,
            exp_avg_sqs,
            lists[3] if len(lists) > 3 else [],
            steps,
            amsgrad=group["amsgrad"],
            lr=group["lr"],
            beta1=beta1,
            beta2=beta2,
            weight_decay=group["weight_decay"],
            eps=group["eps"],
            maximize=group["maximize"],
            found_inf=found_inf,
        )
        if found_inf is not None:  # a skipped step does not count, as in torch's _fused_adam
            torch._foreach_sub_(steps, [found_inf] * len(steps))


# Eager under torch.compile(opt.step), as torch runs its own fused optimizers (their
# functional form is torch.compiler.disable'd): the checks above read hooks and
# identities that would be guards, and the kernels are single calls either way.
_step_eagerly = torch._disable_dynamo(FusedStep._step)  # type: ignore[attr-defined]


def _same(now: list[torch.Tensor], then: tuple[torch.Tensor, ...]) -> bool:
    return len(now) == len(then) and all(a is b for a, b in zip(now, then, strict=True))
