"""Which kernels the wrapped optimizers run, and whether the parameters need loss scaling.

``_fuse`` switches a param group to torch's fused kernel (one kernel a step for all its
parameters) where the user left the choice to torch; ``_unfuse_sparse`` steps a group
unfused once it meets sparse gradients. ``needs_scaling`` decides, from how the parameters'
model was prepared, whether the default loss scaler is dynamic.
"""

from __future__ import annotations

import functools
from typing import Any

import torch

from mixprec._dist import fsdp_computes_in_float16, is_dtensor
from mixprec._plain_optimizers import step_inner
from mixprec._warn import warn_at_caller
from mixprec.casting import COMPUTE_ATTR, LEVEL_ATTR, POLICY_ATTR
from mixprec.optim.layouts import is_dense, match_state_layouts, refuse_misshapen
from mixprec.policy import Policy, global_policy

__all__ = ["needs_scaling"]

#: torch optimizers with a fused kernel (one per step for all parameters, on CPU and CUDA).
_FUSABLE: tuple[type[torch.optim.Optimizer], ...] = (
    torch.optim.Adam,
    torch.optim.AdamW,
    torch.optim.SGD,
)

# 16-bit parameters (O3) only on CUDA: torch 2.12-2.13's fused CPU SGD skips the vectorised
# part of float16/bfloat16 updates (pytorch/pytorch#191763); pure float16 SGD diverged with
# it. Unfused on CUDA, an O3 step could not skip on the device and read found_inf each step.
_FUSED_DTYPES: dict[str, tuple[torch.dtype, ...]] = {
    "cpu": (torch.float32, torch.float64),
    "cuda": (torch.float32, torch.float64, torch.float16, torch.bfloat16),
}


def needs_scaling(params: list[torch.Tensor]) -> bool:
    """Float16 math needs loss scaling; decide from how the params' model was prepared, or
    for FSDP2's shards (new parameters, untagged), from ``fsdp_mixed_precision``'s policy."""
    tagged = False
    shards = False
    for p in params:
        shards = shards or is_dtensor(p)
        if p.dtype == torch.float16 or getattr(p, COMPUTE_ATTR, None) == torch.float16:
            return True
        policy = getattr(p, POLICY_ATTR, None)
        if isinstance(policy, Policy):
            tagged = True
            if policy.loss_scaling == "dynamic" and getattr(p, LEVEL_ATTR, None) != "O0":
                return True
    if not tagged and shards and fsdp_computes_in_float16(params):
        return True
    return not tagged and global_policy().loss_scaling == "dynamic"


@functools.cache
def _fused_cpu_sgd_drops_16bit() -> bool:
    """Whether this torch's fused CPU SGD leaves a 16-bit parameter where it was
    (pytorch/pytorch#191763: torch 2.12-2.13 skip the vectorised part), tried once."""
    p = torch.nn.Parameter(torch.ones(64, dtype=torch.bfloat16))
    p.grad = torch.ones_like(p)
    torch.optim.SGD([p], lr=0.5, fused=True).step()
    return bool((p.detach() == 1).any())


def _say_if_fused_sgd_drops(inner: torch.optim.Optimizer, group: dict[str, Any]) -> None:
    """An SGD group the user fused over CPU 16-bit parameters (O3): torch's kernel drops
    most of each update there (the weights moved 0.015 of float32's in 20 steps), unsaid."""
    half = (torch.float16, torch.bfloat16)
    if (
        type(inner) is torch.optim.SGD
        and group.get("fused")
        and any(p.device.type == "cpu" and p.dtype in half for p in group["params"])
        and _fused_cpu_sgd_drops_16bit()
    ):
        warn_at_caller(
            "SGD(fused=True) over float16/bfloat16 parameters on CPU (level O3): this "
            f"torch ({torch.__version__}) drops most of each such update in its fused CPU "
            "kernel (pytorch/pytorch#191763). Leave fused unset (mixprec then picks "
            "torch's loop for them), or use level O2 (float32 masters, fused)."
        )


def _fuse(inner: torch.optim.Optimizer, group: dict[str, Any]) -> None:
    """Switch ``group`` to torch's fused kernel where the user left the choice to torch
    (``fused`` and ``foreach`` both None).

    On CPU torch then picks the per-parameter loop: AdamW on the LM d512's parameters took
    30-40 ms a step that way and 9-10 ms fused. Not once the optimizer has state (its
    ``step`` counters would be in the loop's format), and not for FSDP2's DTensor
    parameters (the fused kernels have no sharding rule). Every group the wrapper takes
    comes here: one fused by the user where torch's kernel drops updates is said."""
    _say_if_fused_sgd_drops(inner, group)
    if (
        type(inner) not in _FUSABLE
        # Plain SGD (no momentum) is one add per parameter: torch's loop is faster than the
        # fused kernel on CPU (141 against 158 us a step for the MLP's 0.67 M, one thread).
        # On CUDA the fused kernel is one launch, and it skips on the device (``deferred``):
        # unfused, every step read found_inf on the host, a synchronisation.
        or (
            type(inner) is torch.optim.SGD
            and not group.get("momentum")
            and any(p.device.type == "cpu" for p in group["params"])
        )
        or inner.state
        or group.get("fused", False) is not None
        or group.get("foreach") is not None
        or group.get("differentiable")
        or group.get("capturable")
        or not all(
            p.dtype in _FUSED_DTYPES.get(p.device.type, ()) and not is_dtensor(p) and is_dense(p)
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


def step_inner_fused_safely(inner: torch.optim.Optimizer, book: Any) -> None:
    """``step_inner``, with any fused SGD group where some parameters with gradients have a
    momentum buffer and others none yet (a branch first used at a later step, a layer
    unfrozen) stepped unfused this once: torch's fused kernel cannot step such a group (a
    TypeError), and its loop starts the new buffers from the gradient as plain SGD does."""
    refuse_misshapen(inner)  # a state loaded from another model: before torch's kernels
    match_state_layouts(inner)
    unfused = []
    # Buffers are never dropped: once every parameter has one, no group can mix (no loop).
    every = sum(len(group["params"]) for group in inner.param_groups)
    if type(inner) is torch.optim.SGD and len(inner.state) < every:
        for group in inner.param_groups:
            if group.get("fused") and group.get("momentum"):
                held = [
                    "momentum_buffer" in inner.state.get(p, ())
                    for p in group["params"]
                    if p.grad is not None
                ]
                if any(held) and not all(held):
                    group["fused"] = False
                    unfused.append(group)
    try:
        step_inner(inner, book)
    finally:
        for group in unfused:
            group["fused"] = True
