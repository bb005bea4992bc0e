"""What a param group of 16-bit weights stepped in place (O3: no float32 masters) loses,
said when the wrapper takes the group: host numbers alone, nothing per step.

- Adam-style optimizers keep their second moments in the weights' dtype. In float16,
  ``(1 - beta2) * g**2`` underflows for gradients below about 5e-3, and the update becomes
  about ``m / eps``: AdamW at O3 ended 5.7 times float32's movement away from it with
  ``eps=1e-4`` (the docs' old advice), 109 times with 1e-6, 140 fused, unsaid; and the
  default ``eps=1e-8`` is 0 in float16 (a zero gradient gives NaN weights).
- AdamW's decoupled weight decay, applied unfused as a multiplication of its own, whose
  share of a weight per step is below half a unit in the last place rounds away at every
  step: a bfloat16 block that float32 decayed to 0.74 of its norm kept 1.000, unsaid.
  (SGD's decay is part of the gradient, and a fused kernel rounds decay and update once:
  where a weight has a gradient, both decay as in float32.)

``CompensatedAdamW`` (``EPS_IN_FLOAT32``) keeps its state and decay exact; O2 keeps float32
masters. Both are named.
"""

from __future__ import annotations

from typing import Any

import torch

from mixprec._dtypes import HALF_DTYPES, dtype_name
from mixprec._warn import warn_at_caller

__all__ = ["say_what_in_place_loses"]

# torch optimizers whose state holds squared gradients (or their running sums).
_SECOND_MOMENTS = (
    torch.optim.Adam,
    torch.optim.AdamW,
    torch.optim.NAdam,
    torch.optim.RAdam,
    torch.optim.Adamax,
    torch.optim.RMSprop,
    torch.optim.Adagrad,
    torch.optim.Adadelta,
    torch.optim.SparseAdam,
)
_FIX = "Use level O2 (float32 masters and optimizer state) or mp.CompensatedAdamW"


def say_what_in_place_loses(
    inner: torch.optim.Optimizer, group: dict[str, Any], where: str
) -> None:
    """Warn for a group of 16-bit parameters stepped in place whose second moments
    underflow (float16) or whose weight decay rounds away (see the module's docstring)."""
    half = [p for p in group["params"] if p.dtype in HALF_DTYPES]
    if not half or getattr(inner, "EPS_IN_FLOAT32", False):
        return
    dtype = half[0].dtype
    if dtype == torch.float16 and isinstance(inner, _SECOND_MOMENTS):
        eps = group.get("eps")
        zero = isinstance(eps, float) and eps > 0 and torch.tensor(eps, dtype=dtype).item() == 0
        zero = zero and not group.get("fused")  # the fused kernels add eps in float32
        nan = f"; eps={eps!r} is 0 in float16, so a zero gradient gives NaN weights"
        warn_at_caller(
            f"{where} keeps its gradient statistics (squares, or Adamax's max) in float16 "
            "for float16 parameters without float32 masters (level O3): small gradients' "
            "squares underflow (below about 5e-3 in Adam's second moment), and the update "
            "grows toward m / eps (AdamW ended 5.7 to 140 times float32's movement away "
            "from it, whatever the eps or kernel)" + (nan if zero else "") + f". {_FIX}."
        )
    share = _decay_share(inner, group)
    if share is not None and 0 < share < torch.finfo(dtype).eps / 2:
        warn_at_caller(
            f"{where}: weight decay takes {share:.2g} of a weight a step, below half a "
            f"unit in the last place of {dtype_name(dtype)} ({torch.finfo(dtype).eps / 2:.2g}"
            "): stepped in place without float32 masters (level O3), it rounds away at "
            f"every step and the weights never decay. {_FIX}."
        )


def _decay_share(inner: torch.optim.Optimizer, group: dict[str, Any]) -> float | None:
    """The share of a weight one step's decay takes where it is a rounding of its own:
    ``lr * weight_decay`` for AdamW's decoupled decay, which the unfused step applies as
    ``param.mul_(1 - lr * wd)`` before the update. None where the decay is rounded together
    with the update (SGD's, part of the gradient; a fused kernel's), or there is none."""
    lr, wd = group.get("lr"), group.get("weight_decay")
    if not isinstance(lr, float) or not isinstance(wd, (int, float)) or not wd:
        return None
    decoupled = isinstance(inner, torch.optim.AdamW) or group.get("decoupled_weight_decay")
    return lr * wd if decoupled and not group.get("fused") else None
