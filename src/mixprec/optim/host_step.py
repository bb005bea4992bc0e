"""The default CPU step of ``LossScaleOptimizer``, taken whole on the host.

On CPU, in one process, at scale 1 (float32, and bfloat16 at O1, O2 and O3: the default
on every CPU) a step needs no tensor flags, collective or device-side bookkeeping: the
gradients are checked where they lie, and a clean step copies them into the masters, steps
(``FusedStep``'s direct kernel calls where it can) and copies the masters back.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from mixprec._dist import is_distributed
from mixprec.optim import deferred
from mixprec.optim.checks import no_gradients
from mixprec.optim.fused import _unfuse_sparse, step_inner_fused_safely
from mixprec.optim.step_result import StepResult
from mixprec.scaling import finite_on_cpu

if TYPE_CHECKING:
    from mixprec.optim.loss_scale_optimizer import LossScaleOptimizer

__all__ = ["host_step"]


def host_step(opt: LossScaleOptimizer) -> StepResult | None:
    """The whole step on the host, or None where the general path is needed.

    Taken on CPU, in one process, at scale 1 (float32, and bfloat16 at O1, O2 and O3:
    the default) with nothing to clip or trace and no float16 weight to check: a
    read-only finiteness check of the gradients as they are, its answer read at once (no
    synchronisation on CPU); then, on a clean step, the 16-bit gradients into the masters'
    float32 ones, the inner step and the masters back into the 16-bit weights, each one
    kernel (the inner step as direct fused-kernel calls where ``FusedStep`` can).
    The tensor flags, collective and copies of ``LossScaleOptimizer._finish`` would be
    per-step work that plain training does not do. Under ``torch.compile`` it returns at
    the first test."""
    weights = opt._weights
    if (
        not opt._book.host_path
        or opt.max_grad_norm is not None  # public attributes: set after construction too
        or opt._tracer is not None
        or opt._loss_scaler.get_scale() != 1.0
        or torch.compiler.is_compiling()
        or is_distributed()
        or deferred.ON_HOST  # the device path asked for on CPU (tests)
    ):
        return None
    opt._read_device_steps()  # earlier steps decided on the device count first
    # Checked before they are widened: reading the 16-bit gradients is half the bytes,
    # and a skipped step then copies nothing.
    grads = [p.grad for p in weights.half if p.grad is not None] + weights.plain_grads()
    if not grads:
        return no_gradients(opt._book, 1.0)
    if any(g.is_sparse for g in grads):
        grads = [g._values() if g.is_sparse else g for g in grads]
    overflow = not finite_on_cpu(grads)
    if not overflow and weights.half:
        weights.follow_external_writes(stepping=True)
        weights.load_master_grads()
    # The tail of _finish, restated: as a function of its own shared by both, it cost
    # torch.compile(opt.step) two more graphs, and dynamo then traced the scaler's
    # float32 rounding into a recursion in its struct polyfill (torch 2.13).
    if not overflow:
        for k, (inner, fused) in enumerate(zip(opt.optimizers, opt._book.fused, strict=True)):
            if weights.saw_sparse:
                _unfuse_sparse(inner)
            if not fused.step():
                step_inner_fused_safely(inner, opt._book)
            opt._book.stepped = k + 1  # in: a raise from here finishes the step as applied
        if weights.half:
            weights.copy_back()
        opt._book.stepped = deferred.COPIED
        opt._run_post_hooks()
    opt._book.stepped = 0
    opt._loss_scaler.update(overflow)
    opt._book.micro = 0
    return StepResult(applied=not overflow, found_inf=overflow, scale=1.0)
