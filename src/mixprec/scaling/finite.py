"""Finiteness checks and in-place unscaling of gradients.

A step whose gradients hold inf or NaN is skipped. These kernels find that out without
synchronising with the device where they can (``unscale_grads_`` and ``all_finite`` return
device tensors); on CPU, where reading a value costs no synchronisation, they read their
answer at once (``checks_on_host``, ``finite_on_cpu``).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence

import torch

from mixprec._dist import is_dtensor

__all__ = ["all_finite", "checks_on_host", "finite_on_cpu", "unscale_grads_"]


def unscale_grads_(
    grads: Iterable[torch.Tensor | None],
    inv_scale: float,
    device: torch.device | str | None = None,
) -> torch.Tensor:
    """Multiply gradients by ``inv_scale`` in place and report whether any is inf or NaN.

    Dense and sparse gradients (their values: callers coalesce float16 sparse gradients
    first, as duplicate indices can overflow when summed). One multi-tensor kernel per
    (device, dtype) group. Returns a 0-dim float32 tensor, 1.0 if a non-finite value was
    seen, on the first gradient's device (on ``device`` when there are no gradients, so that
    a rank without gradients still joins a collective on the right device); nothing is
    synchronised with the host.
    """
    groups: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
    for grad in grads:
        if grad is None:
            continue
        values = grad._values() if grad.is_sparse else grad
        if is_dtensor(values):  # FSDP2: each rank unscales and checks its own shard
            values = values.to_local()  # type: ignore[attr-defined]
        groups.setdefault((values.device, values.dtype), []).append(values)
    tensors = [t for group in groups.values() for t in group]
    # The scale last: under torch.compile it is a graph input, and comparing it is a guard.
    if tensors and checks_on_host(tensors) and inv_scale == 1.0:
        # Scale 1 (float32, bfloat16) on CPU: a read-only check, as the multiply by 1 is
        # not needed. On CPU reading the answer costs no device synchronisation.
        return torch.tensor(0.0 if finite_on_cpu(tensors) else 1.0, dtype=torch.float32)
    found: dict[torch.device, torch.Tensor] = {}
    inv: dict[torch.device, torch.Tensor] = {}
    # Eager, a scale of 1 (bfloat16) needs no multiply where it is a kernel of its own.
    multiply = torch.compiler.is_compiling() or inv_scale != 1.0
    with torch.no_grad():
        for (device, _), tensors in groups.items():
            if device not in found:
                found[device] = torch.zeros((), dtype=torch.float32, device=device)
                if torch.compiler.is_compiling():
                    # Inductor bakes a fill value into the graph (a recompile per loss
                    # scale); a product keeps the scale a graph input.
                    inv[device] = torch.ones((), dtype=torch.float32, device=device) * inv_scale
                else:
                    inv[device] = torch.full((), inv_scale, dtype=torch.float32, device=device)
            _check_and_unscale(tensors, found[device], inv[device], multiply, inv_scale > 1.0)
    if not found:
        return torch.zeros((), dtype=torch.float32, device=device)
    flags = list(found.values())
    total = flags[0]
    for other in flags[1:]:
        total = total + other.to(total.device, non_blocking=True)
    return total


#: The dtypes CUDA's ``_amp_foreach_non_finite_check_and_unscale_`` takes (its CPU kernel
#: also takes bfloat16).
_AMP_KERNEL_DTYPES = (torch.float16, torch.float32, torch.float64)


def amp_kernel_takes(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether torch's amp check-and-unscale kernel takes tensors of ``dtype`` on ``device``."""
    return device.type == "cpu" or dtype in _AMP_KERNEL_DTYPES


def _check_and_unscale(
    tensors: list[torch.Tensor],
    found: torch.Tensor,
    inv: torch.Tensor,
    multiply: bool,
    grows: bool,
) -> None:
    """Torch's amp kernel where it takes the group. Else (bfloat16 gradients on CUDA, an O3
    model's, would raise ``NotImplementedError``) the inf-norms, the amp kernel over them,
    and a multiply, left out when ``multiply`` is False (scale 1). The inf-norm of a tensor
    is inf or NaN exactly when one of its values is. ``grows`` (a multiplier past 1: a loss
    scale below 1, a partial accumulation group's rescale): multiplied first and checked
    after, as the amp kernel checks each value before its multiply, which can then overflow."""
    if not grows and amp_kernel_takes(tensors[0].device, tensors[0].dtype):
        torch._amp_foreach_non_finite_check_and_unscale_(tensors, found, inv)
        return
    if grows:
        torch._foreach_mul_(tensors, inv)
        if checks_on_host(tensors):  # the CPU's sums: ~20x faster there than the norms
            if not finite_on_cpu(tensors):
                found.fill_(1.0)
            return
    nonempty = [t for t in tensors if t.numel() > 0]  # as the kernel skips empty tensors
    if nonempty:
        # The amp kernel takes the norms (float32, float64): it sets ``found`` to 1.0 in
        # place, one kernel where a stack, a test and a merge took five. The norms it
        # multiplies are thrown away.
        torch._amp_foreach_non_finite_check_and_unscale_(_inf_norms(nonempty), found, inv)
    if multiply and not grows:
        torch._foreach_mul_(tensors, inv)  # in float32, as the kernel multiplies


def checks_on_host(tensors: Sequence[torch.Tensor]) -> bool:
    """Whether finiteness checks read their answer at once (``finite_on_cpu``): on CPU,
    where that costs no synchronisation; not under ``torch.compile``, and not for DTensors
    (a read on the host would see this rank's partial sum only)."""
    return not torch.compiler.is_compiling() and all(
        t.device.type == "cpu" and not is_dtensor(t) for t in tensors
    )


def finite_on_cpu(tensors: Sequence[torch.Tensor]) -> bool:
    """Whether every value of these CPU tensors is finite, reading each once.

    A sum is finite when every value is (inf and NaN propagate); a non-finite sum of finite
    values (float32 overflow in the sum) is told apart by the exact per-tensor check. On one
    thread this is ~25% faster than torch's amp kernel, which also writes every gradient,
    and ~20x faster than ``torch._foreach_norm(..., inf)``, a per-tensor loop on CPU. Under
    ``torch.compile`` the branch would break the graph: the caller uses the kernels there.
    """
    with torch.no_grad():
        # Python floats: a 0-dim isfinite is several kernels, .item() on CPU is not.
        # bfloat16 sums in its own dtype (float32's range; torch accumulates in float32 on
        # CPU): reading bfloat16 gradients took half the time of reading their float32
        # copies. float16 sums in float32: its own would overflow at 65504.
        if math.isfinite(sum(_sum(t) for t in tensors)):
            return True
        return all(bool(t.isfinite().all()) for t in tensors)


def _sum(t: torch.Tensor) -> float:
    return (t.sum(dtype=torch.float32) if t.dtype == torch.float16 else t.sum()).item()


def all_finite(tensors: Iterable[torch.Tensor | None]) -> torch.Tensor:
    """A 0-dim bool tensor: True when every value of every tensor is finite (MindSpore's
    ``all_finite``). Sparse tensors are checked through their values; ``None`` is skipped.
    Does not synchronise; ``bool(...)`` on the result does."""
    dense = [t._values() if t.is_sparse else t for t in tensors if t is not None]
    floating = [t for t in dense if t.is_floating_point() and t.numel() > 0]
    if not floating:
        return torch.ones((), dtype=torch.bool)
    device = floating[0].device
    if checks_on_host(floating):
        return torch.tensor(finite_on_cpu(floating))
    with torch.no_grad():
        # The norms are float32 or float64 (stack keeps float64's range: a finite 1e300 is
        # not inf); to(device) is a no-op on the usual one device. A norm is below inf
        # exactly when it is finite (NaN compares False): one kernel, where isfinite is four.
        norms = torch.stack([n.to(device) for n in _inf_norms(floating)])
        return norms.lt(math.inf).all()


#: Whether ``torch._foreach_norm`` takes ``dtype`` (the norms of 16-bit tensors computed
#: and returned in float32, without a cast kernel per tensor).
_NORM_TAKES_DTYPE = any(
    a.name == "dtype" for a in torch.ops.aten._foreach_norm.Scalar._schema.arguments
)


def _inf_norms(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """Each tensor's inf-norm, in float32 (float64 for float64 tensors): inf when a value
    is inf, NaN when one is NaN, finite otherwise (bfloat16's largest value is below
    float32's). One multi-tensor kernel per dtype."""
    wide = [t.dtype in (torch.float32, torch.float64) for t in tensors]
    if all(wide):
        return list(torch._foreach_norm(tensors, float("inf")))
    # Not for DTensors (FSDP2): their sharding rule for the norm may not take ``dtype``.
    if _NORM_TAKES_DTYPE and not any(wide) and not any(is_dtensor(t) for t in tensors):
        return list(torch._foreach_norm(tensors, float("inf"), dtype=torch.float32))
    return [
        n if n.dtype in (torch.float32, torch.float64) else n.float()
        for n in torch._foreach_norm(tensors, float("inf"))
    ]
