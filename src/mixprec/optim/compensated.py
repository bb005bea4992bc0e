"""``CompensatedAdamW``: AdamW for pure 16-bit weights (level O3) that keeps accuracy.

A bfloat16 weight has 8 bits of mantissa: an update smaller than half a unit in its last
place (2**-9 relative) is rounded away, so late in training, with small learning rates, O3
stops learning where O2 (float32 masters) goes on. Two remedies, neither keeping a float32
copy of the weights:

- ``compensation="kahan"``: a 16-bit buffer per weight holds what rounding lost last time
  and feeds it into the next update (Kahan summation): 2 extra bytes per parameter.
- ``compensation="stochastic"``: round the float32 result up or down at random, with the
  probabilities that make the rounding unbiased on average (bfloat16 only): no extra bytes.

The moments are kept in float32 (they are optimizer state, not weights), and the update is
computed in float32 with multi-tensor kernels.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from typing import Any, Literal

import torch

from mixprec._dtypes import dtype_name
from mixprec._errors import ArgumentError, is_number
from mixprec._live_masters import float32_start

__all__ = ["CompensatedAdamW", "stochastic_round"]

Compensation = Literal["kahan", "stochastic", "none"]


def stochastic_round(
    values: torch.Tensor, generator: torch.Generator | None = None
) -> torch.Tensor:
    """float32 -> bfloat16, rounding up with probability equal to the dropped fraction.

    bfloat16 is float32 with the low 16 bits cut: add a uniform random 16-bit integer to
    the bit pattern and cut. Adding in the integer domain moves the magnitude, so the
    rounding is unbiased for negative values too."""
    bits = values.float().contiguous().view(torch.int32)
    noise = torch.randint(0, 1 << 16, bits.shape, dtype=torch.int32, device=bits.device,
                          generator=generator)  # fmt: skip
    rounded = (bits + noise) & -65536  # 0xFFFF0000 as a signed 32-bit mask
    return rounded.view(torch.float32).to(torch.bfloat16)


class CompensatedAdamW(torch.optim.Optimizer):
    """AdamW (decoupled weight decay) for float32, bfloat16 or float16 weights.

    For 16-bit weights the update is computed in float32 and applied with Kahan
    compensation (default) or stochastic rounding (bfloat16); float32 weights are updated
    as by ``torch.optim.AdamW``. Use it at level O3 through ``LossScaleOptimizer``
    (16-bit parameters at O3 get no float32 masters)."""

    # eps is added to a float32 denominator: 1e-8 does not vanish with float16 weights.
    EPS_IN_FLOAT32 = True

    def __init__(
        self,
        params: Iterable[Any],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 1e-2,
        compensation: Compensation = "kahan",
        generator: torch.Generator | None = None,
    ) -> None:
        # Finite numbers: lr=inf made the weights non-finite at the first step, eps=inf
        # froze them, a string raised a bare TypeError.
        for name, value in (("lr", lr), ("eps", eps)):
            if not (is_number(value) and 0 < value < math.inf):
                raise ArgumentError(f"{name}={value!r} is invalid; it must be a finite number > 0")
        if not (
            isinstance(betas, (tuple, list))
            and len(betas) == 2
            and all(is_number(b) and 0.0 <= b < 1.0 for b in betas)
        ):  # one or three values failed at the first step, unpacking
            raise ArgumentError(f"betas={betas!r} are invalid; two numbers, each in [0, 1)")
        if generator is not None and not isinstance(generator, torch.Generator):
            raise ArgumentError(
                f"generator={generator!r} is invalid; a torch.Generator (for stochastic "
                "rounding) or None"
            )
        defaults = {"lr": lr, "betas": betas, "eps": eps, "weight_decay": weight_decay,
                    "compensation": compensation}  # fmt: skip
        super().__init__(params, defaults)  # each group is checked by add_param_group
        self.generator = generator

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        super().add_param_group(param_group)
        try:
            _check_group(self.param_groups[-1], len(self.param_groups) - 1)
        except ArgumentError:
            self.param_groups.pop()  # refused: not kept
            raise

    def state_dict(self) -> dict[str, Any]:
        """torch's, with the ``generator``'s state (stochastic rounding draws from it): a
        resumed run then rounds as the uninterrupted one would."""
        state = super().state_dict()
        if self.generator is not None:
            state["generator_state"] = self.generator.get_state()
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """torch's, with the float32 moments kept as saved: torch casts floating state to
        the parameter's dtype, which would round a 16-bit weight's moments to 16 bits; and
        the ``generator``'s state where it was saved."""
        state_dict = dict(state_dict)
        generator_state = state_dict.pop("generator_state", None)
        if generator_state is not None and self.generator is not None:
            self.generator.set_state(generator_state)
        saved_ids = [i for group in state_dict["param_groups"] for i in group["params"]]
        moments = {
            i: {k: v for k, v in state.items() if k in ("exp_avg", "exp_avg_sq")}
            for i, state in state_dict["state"].items()
        }
        super().load_state_dict(state_dict)
        params = [p for group in self.param_groups for p in group["params"]]
        for i, p in zip(saved_ids, params, strict=True):
            for key, value in moments.get(i, {}).items():
                self.state[p][key] = value.to(p.device, torch.float32, copy=True)

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            params = [p for p in group["params"] if p.grad is not None]
            if not params:
                continue
            for p in params:
                if p.grad.is_sparse:
                    raise RuntimeError("CompensatedAdamW does not support sparse gradients")
                state = self.state[p]
                if not state:
                    state["step"] = 0
                    state["exp_avg"] = torch.zeros_like(p, dtype=torch.float32)
                    state["exp_avg_sq"] = torch.zeros_like(p, dtype=torch.float32)
                kahan = p.dtype != torch.float32 and group["compensation"] == "kahan"
                if kahan and "compensation" not in state:  # also a state loaded without it
                    state["compensation"] = _compensation(p)
                state["step"] += 1
            self._update(group, params)
        return loss

    def _update(self, group: dict[str, Any], params: list[torch.Tensor]) -> None:
        beta1, beta2 = group["betas"]
        lr, eps, decay = group["lr"], group["eps"], group["weight_decay"]
        states = [self.state[p] for p in params]
        grads = [p.grad.float() for p in params]  # type: ignore[union-attr]
        exp_avg = [s["exp_avg"] for s in states]
        exp_avg_sq = [s["exp_avg_sq"] for s in states]
        torch._foreach_lerp_(exp_avg, grads, 1.0 - beta1)
        torch._foreach_mul_(exp_avg_sq, beta2)
        torch._foreach_addcmul_(exp_avg_sq, grads, grads, 1.0 - beta2)
        # Steps can differ between parameters (one that had no gradient for a while).
        steps = [s["step"] for s in states]
        denom = torch._foreach_sqrt(exp_avg_sq)
        torch._foreach_div_(denom, [(1.0 - beta2**t) ** 0.5 for t in steps])
        torch._foreach_add_(denom, eps)
        updates = torch._foreach_div(exp_avg, denom)
        torch._foreach_mul_(updates, [-lr / (1.0 - beta1**t) for t in steps])
        weights = [p.float() for p in params]
        if decay:
            torch._foreach_add_(updates, torch._foreach_mul(weights, -lr * decay))
        for p, w, u, s in zip(params, weights, updates, states, strict=True):
            if p.dtype == torch.float32:
                p.add_(u)
            elif group["compensation"] == "kahan":
                # Kahan: add what rounding lost last step; keep what it loses this step.
                c = s["compensation"]
                corrected = u + c.float()
                new = (w + corrected).to(p.dtype)
                c.copy_(corrected - (new.float() - w))
                p.copy_(new)
            elif group["compensation"] == "stochastic":
                p.copy_(stochastic_round(w + u, self.generator))
            else:
                p.copy_((w + u).to(p.dtype))


def _compensation(p: torch.Tensor) -> torch.Tensor:
    """Kahan's buffer for a 16-bit weight at its first step: what its rounding lost from
    the float32 values it stands for (a float32 checkpoint or an O2 run's masters loaded
    into it), so that an O3 run goes on from them; zeros where it stands for none. A
    state saved at O2 holds none: resumed at O3, the step raised ``KeyError``."""
    start, _ = float32_start(p)
    return (start - p.detach().float()).to(p.dtype)


#: The weights it updates: float32 as torch's AdamW, 16-bit through float32. A float64
#: weight would go through float32 too (and through bfloat16 with "stochastic").
_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _check_group(group: dict[str, Any], index: int) -> None:
    """A group's ``compensation`` (the constructor's, or the group's own) is one of the
    three, and ``"stochastic"`` (which rounds to bfloat16) holds no float16 weight; its
    ``weight_decay`` is a finite number >= 0 (NaN made every weight NaN with finite
    gradients, which no inf/NaN check sees); its weights are float32 or 16-bit."""
    decay = group["weight_decay"]
    if not is_number(decay) or not 0 <= float(decay) < math.inf:
        raise ArgumentError(
            f"weight_decay={decay!r} is invalid (param_groups[{index}]); it must be a finite "
            "number >= 0"
        )
    other = sorted({dtype_name(p.dtype) for p in group["params"] if p.dtype not in _DTYPES})
    if other:
        raise ArgumentError(
            f"CompensatedAdamW updates float32, bfloat16 and float16 weights; "
            f"param_groups[{index}] holds {', '.join(other)} (use torch.optim.AdamW for those)"
        )
    compensation = group["compensation"]
    if compensation not in ("kahan", "stochastic", "none"):
        raise ArgumentError(
            f"compensation={compensation!r} is invalid (param_groups[{index}]); valid: "
            "'kahan', 'stochastic', 'none'"
        )
    if compensation == "stochastic" and any(p.dtype == torch.float16 for p in group["params"]):
        raise ArgumentError(
            f"compensation='stochastic' rounds to bfloat16 (param_groups[{index}]); a float16 "
            "parameter needs compensation='kahan'"
        )
