"""``CompensatedAdamW``: AdamW for pure 16-bit weights (level O3) that keeps accuracy.

A bfloat16 weight has 8 bits of mantissa: an update smaller than half a unit in its last
place (2**-9 relative) is rounded away, so late in training, with small learning rates, O3
stops learning where O2 (float32 masters) goes on. Two remedies, neither keeping a float32
copy of the weights:

- ``compensation="kahan"``: a 16-bit buffer per weight holds what rounding lost, 2 extra
  bytes per parameter. For a bfloat16 weight it is the low 16 bits of the float32 value
  the weight is the high 16 bits of (``split_float32``): the two together are that float32
  value exactly, so updates as small as float32 keeps count. (A bfloat16 buffer of the
  rounding error, Kahan summation, itself rounded away updates below about
  ``|w| * 2**-17``: at lr 3e-6 a LayerNorm gain near 1 never moved.) For a float16 weight
  it is Kahan's: the rounding error, in float16, fed into the next update.
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

__all__ = ["CompensatedAdamW", "compensated_value", "join_float32", "split_float32",
           "stochastic_round"]  # fmt: skip

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


def split_float32(values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """float32 -> (bfloat16, int16): the value rounded to bfloat16 (to nearest, ties away
    from zero) and what that left out, as the int16 difference of the bit patterns, which
    such rounding keeps within [-2**15, 2**15 - 1]. ``join_float32`` gives back ``values``
    exactly."""
    bits = values.float().contiguous().view(torch.int32)
    high = bits.add(0x8000).bitwise_and_(-65536)  # 0xFFFF0000 as a signed 32-bit mask
    low = bits.sub(high).to(torch.int16)
    return high.bitwise_right_shift_(16).to(torch.int16).view(torch.bfloat16), low


def _split_into(values: torch.Tensor, weight: torch.Tensor, low: torch.Tensor) -> None:
    """``split_float32`` of float32 ``values`` (used up) into ``weight`` and ``low``, in
    place: the int32 results are in range, so the copies into int16 are exact."""
    bits = values.view(torch.int32)
    high = bits.add(0x8000).bitwise_and_(-65536)
    low.copy_(bits.sub_(high))
    weight.view(torch.int16).copy_(high.bitwise_right_shift_(16))


def join_float32(weight: torch.Tensor, low: torch.Tensor) -> torch.Tensor:
    """The float32 value of a bfloat16 ``weight`` and its int16 ``low`` bits."""
    bits = weight.detach().contiguous().view(torch.int16).to(torch.int32)
    return bits.bitwise_left_shift_(16).add_(low).view(torch.float32)


def compensated_value(weight: torch.Tensor, compensation: torch.Tensor) -> torch.Tensor:
    """The float32 value a 16-bit weight and its ``CompensatedAdamW`` compensation stand
    for: joined bits (bfloat16, int16 buffer), or the sum (Kahan's float16 buffer, or a
    bfloat16 one saved before the int16 buffer)."""
    if compensation.dtype == torch.int16:
        return join_float32(weight.to(torch.bfloat16), compensation)
    return weight.detach().float() + compensation.float()


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
        """torch's, with the float32 moments and the compensation kept as saved: torch casts
        state to the parameter's dtype, which would round a 16-bit weight's moments to 16
        bits and turn its int16 low bits into bfloat16 numbers; and the ``generator``'s
        state where it was saved."""
        state_dict = dict(state_dict)
        generator_state = state_dict.pop("generator_state", None)
        if generator_state is not None and self.generator is not None:
            self.generator.set_state(generator_state)
        saved_ids = [i for group in state_dict["param_groups"] for i in group["params"]]
        kept = {
            i: {k: v for k, v in state.items() if k in ("exp_avg", "exp_avg_sq", "compensation")}
            for i, state in state_dict["state"].items()
        }
        super().load_state_dict(state_dict)
        params = [p for group in self.param_groups for p in group["params"]]
        for i, p in zip(saved_ids, params, strict=True):
            for key, value in kept.get(i, {}).items():
                dtype = value.dtype if key == "compensation" else torch.float32
                self.state[p][key] = value.to(p.device, dtype, copy=True)

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
                elif _joined(p, group) and state["compensation"].is_floating_point():
                    # Saved as Kahan's bfloat16 buffer (before the int16 low bits).
                    whole = p.detach().float() + state["compensation"].float()
                    state["compensation"] = _as_low_bits(p, whole)
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
        # A bfloat16 weight with its low bits: the float32 value, decayed and updated whole.
        weights = [
            join_float32(p, s["compensation"]) if _joined(p, group) else p.float()
            for p, s in zip(params, states, strict=True)
        ]
        if decay:
            torch._foreach_add_(updates, torch._foreach_mul(weights, -lr * decay))
        for p, w, u, s in zip(params, weights, updates, states, strict=True):
            if p.dtype == torch.float32:
                p.add_(u)
            elif _joined(p, group):
                _split_into(w.add_(u), p.detach(), s["compensation"])
            elif group["compensation"] == "kahan":
                # Kahan (float16): add what rounding lost last step; keep what it loses now.
                c = s["compensation"]
                corrected = u + c.float()
                new = (w + corrected).to(p.dtype)
                c.copy_(corrected - (new.float() - w))
                p.copy_(new)
            elif group["compensation"] == "stochastic":
                p.copy_(stochastic_round(w + u, self.generator))
            else:
                p.copy_((w + u).to(p.dtype))


def _joined(p: torch.Tensor, group: dict[str, Any]) -> bool:
    return p.dtype == torch.bfloat16 and group["compensation"] == "kahan"


def _compensation(p: torch.Tensor) -> torch.Tensor:
    """The buffer of a 16-bit weight at its first step: what its rounding lost from the
    float32 values it stands for (a float32 checkpoint or an O2 run's masters loaded into
    it), so that an O3 run goes on from them; zeros where it stands for none. A state
    saved at O2 holds none: resumed at O3, the step raised ``KeyError``."""
    start, _ = float32_start(p)
    if p.dtype == torch.bfloat16:
        return _as_low_bits(p, start)
    return (start - p.detach().float()).to(p.dtype)


def _as_low_bits(p: torch.Tensor, whole: torch.Tensor) -> torch.Tensor:
    """A bfloat16 weight's buffer as int16 low bits of the float32 values it stands for:
    the weight is rounded anew from them (``split_float32`` rounds ties away from zero,
    torch's casts to even)."""
    high, low = split_float32(whole)
    with torch.no_grad():
        p.copy_(high)
    return low


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
