"""``cross_entropy``: float32-accurate cross-entropy that never holds float32 log-probs.

``F.cross_entropy(logits.float(), target)`` on a language model's logits keeps, at the peak of
the step, the float32 copy of the logits, the float32 log-softmax saved for backward and a
float32 gradient of each: four times the logits' size in float32, which is the largest
tensor of the step (2048 tokens x 8192 words: 64 MiB each). This function walks the rows in
chunks, upcasts one chunk at a time, and saves only its input and one float32 log-sum-exp per
row; backward recomputes the softmax chunk by chunk and writes the gradient in the logits'
dtype. With 16-bit logits (a policy whose ``output_dtype`` is the compute dtype) the loss path
then costs the 16-bit logits and their 16-bit gradient, and the arithmetic is still float32's.

Float32 logits that a mixed model upcast from 16 bits on its way out (the default
``output_dtype``) are read from that 16-bit source, and the gradient goes straight to it: the
same values bit for bit (the upcast is exact, the gradient is rounded once either way) without
a float32 copy saved, a float32 gradient or the cast back (see ``_output_sources``).
"""

from __future__ import annotations

import functools
import warnings
from typing import Any, Literal

import torch
import torch.nn.functional as F

from mixprec._errors import ArgumentError
from mixprec._output_sources import source_of

__all__ = ["cross_entropy"]

Reduction = Literal["mean", "sum", "none"]
_CHUNK_ELEMENTS = 1 << 20  # float32 working set of one chunk: 4 MiB


class _ChunkedCrossEntropy(torch.autograd.Function):
    # Every chunk goes through one float32 buffer: a fresh 4 MiB chunk per step of the loop
    # (and logsumexp's temporaries) cost more in page faults than the arithmetic on CPU
    # (2048 x 8192 bf16 logits, forward: 22 ms fresh against 8 ms reused).

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any, logits: torch.Tensor, target: torch.Tensor, valid: torch.Tensor, rows: int
    ) -> torch.Tensor:
        math = torch.promote_types(logits.dtype, torch.float32)
        picks = target.masked_fill(~valid, 0).unsqueeze(1)  # any in-range index: masked below
        lse = torch.empty(logits.shape[0], dtype=math, device=logits.device)
        picked = torch.empty_like(lse)
        n = logits.shape[0]
        buf = logits.new_empty((min(rows, n), logits.shape[1]), dtype=math)
        for start in range(0, n, rows):
            end = min(start + rows, n)
            chunk = buf[: end - start]
            chunk.copy_(logits[start:end])
            picked[start:end] = chunk.gather(1, picks[start:end]).squeeze(1)
            lse[start:end] = _logsumexp_(chunk)
        ctx.save_for_backward(logits, picks, valid, lse)
        ctx.rows = rows
        return (lse - picked).masked_fill_(~valid, 0.0)

    @staticmethod
    def backward(ctx: Any, grad_losses: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        logits, picks, valid, lse = ctx.saved_tensors
        # d loss_i: softmax_i - onehot_i, per row. Ignored rows get 0 even where the upstream
        # gradient is inf (the mean over no valid row divides by 0): a product would give
        # inf * 0 = NaN, where torch's nll_loss backward gives 0.
        scale = grad_losses.masked_fill(~valid, 0.0).unsqueeze(1)
        if torch.is_grad_enabled():
            # create_graph=True (MAML, a gradient penalty): a gradient that is differentiable
            # itself, out of place. The chunks' in-place work, once_differentiable before,
            # gave a constant: a meta-gradient 12% off F.cross_entropy's, unsaid.
            probs = torch.softmax(logits.to(lse.dtype), dim=1)
            onehot = torch.zeros_like(probs).scatter_(1, picks, 1.0)
            return ((probs - onehot) * scale).to(logits.dtype), None, None, None
        grad = torch.empty_like(logits, memory_format=torch.contiguous_format)
        n = logits.shape[0]
        rows = max(1, min(ctx.rows, n))  # 0 rows: no chunk, an empty gradient
        buf = logits.new_empty((rows, logits.shape[1]), dtype=lse.dtype)
        minus_one = torch.full((rows, 1), -1.0, dtype=lse.dtype, device=lse.device)
        for start in range(0, n, rows):
            end = min(start + rows, n)
            probs = buf[: end - start]
            probs.copy_(logits[start:end]).sub_(lse[start:end, None]).exp_()
            probs.scatter_add_(1, picks[start:end], minus_one[: end - start])
            grad[start:end] = probs.mul_(scale[start:end])
        return grad, None, None, None


def _logsumexp_(chunk: torch.Tensor) -> torch.Tensor:
    """``torch.logsumexp(chunk, 1)``, overwriting ``chunk`` instead of allocating a copy."""
    top = chunk.amax(dim=1, keepdim=True)
    top.masked_fill_(top.abs() == float("inf"), 0.0)  # as torch: all -inf rows give -inf
    sums = chunk.sub_(top).exp_().sum(dim=1)
    return sums.log_().add_(top.squeeze(1))


def cross_entropy(
    logits: torch.Tensor,
    target: torch.Tensor,
    *,
    ignore_index: int = -100,
    reduction: Reduction = "mean",
) -> torch.Tensor:
    """Cross-entropy of ``logits`` (classes on the last dimension: ``(N, C)`` or a language
    model's ``(batch, length, C)``) against integer ``target`` (the other dimensions), in
    float32 (float64 for float64 logits) whatever the logits' dtype.

    Equal to ``F.cross_entropy(logits.float().reshape(-1, C), target.reshape(-1))`` up to
    float32 rounding, with the same ``ignore_index`` and ``reduction`` meaning; the gradient
    comes back in the logits' dtype. Targets out of range raise as in ``F.cross_entropy``.
    """
    if not isinstance(logits, torch.Tensor) or not logits.is_floating_point() or logits.dim() < 2:
        raise ArgumentError(
            f"cross_entropy: logits must be a floating tensor with classes on the last of at "
            f"least 2 dimensions, got {_describe(logits)}"
        )
    if not isinstance(target, torch.Tensor) or target.dtype not in (torch.int64, torch.int32):
        raise ArgumentError(
            f"cross_entropy: target must be an int64 or int32 tensor of class indices, got "
            f"{_describe(target)}"
        )
    if tuple(target.shape) != tuple(logits.shape[:-1]):
        raise ArgumentError(
            f"cross_entropy: target has shape {tuple(target.shape)}, expected "
            f"{tuple(logits.shape[:-1])} (the logits' {tuple(logits.shape)} without the "
            f"class dimension)"
        )
    if reduction not in ("mean", "sum", "none"):
        raise ArgumentError(
            f"cross_entropy: reduction={reduction!r} is not valid; valid: 'mean', 'sum', 'none'"
        )
    if isinstance(ignore_index, bool) or not isinstance(ignore_index, int):
        raise ArgumentError(  # 1.5 matched no label and gave a loss; F.cross_entropy refuses
            f"cross_entropy: ignore_index={ignore_index!r} is not valid; valid: an int (the "
            "label to leave out; -100 by default)"
        )
    classes = logits.shape[-1]
    if torch.compiler.is_compiling():
        # Traced with the model, the loss is one graph: inductor fuses the upcast into the
        # log-softmax and the partitioner saves the 16-bit logits, which is what the chunks
        # and the source link do by hand in eager mode.
        return F.cross_entropy(
            logits.float().reshape(-1, classes),
            target.reshape(-1).long(),
            ignore_index=ignore_index,
            reduction=reduction,
        ).reshape(target.shape if reduction == "none" else ())
    source = source_of(logits)
    if source is not None:
        logits = source
    elif _from_compiled_graph(logits):
        _warn_compiled_output()
    flat_target = target.reshape(-1).long()
    valid = flat_target != ignore_index
    # As F.cross_entropy says it (a gather failed with "index ... out of bounds for
    # dimension 1", naming no target); on the CPU, where the check costs no device sync.
    out = None
    if logits.device.type == "cpu":
        out = valid & ((flat_target < 0) | (flat_target >= classes))
    if out is not None and bool(out.any()):
        raise IndexError(
            f"cross_entropy: target {int(flat_target[out][0])} is out of bounds; valid: "
            f"0..{classes - 1}, or ignore_index={ignore_index}"
        )
    rows = max(1, _CHUNK_ELEMENTS // max(classes, 1))
    flat_logits = logits.reshape(-1, classes)
    losses: torch.Tensor = _ChunkedCrossEntropy.apply(flat_logits, flat_target, valid, rows)
    if reduction == "none":
        return losses.reshape(target.shape)
    if reduction == "sum":
        return losses.sum()
    # As F.cross_entropy: the mean over targets that are not ignored (NaN when all are).
    return losses.sum() / valid.sum()


def _from_compiled_graph(logits: torch.Tensor) -> bool:
    grad_fn = logits.grad_fn
    return (
        logits.dtype == torch.float32
        and grad_fn is not None
        and "CompiledFunction" in grad_fn.name()
        and torch.is_grad_enabled()
    )


@functools.cache
def _warn_compiled_output() -> None:
    warnings.warn(
        "mixprec.cross_entropy: these float32 logits come out of a torch.compile'd model, whose "
        "outputs cannot carry the link to their 16-bit source, so the loss keeps a float32 copy "
        "for backward (same values, more memory). Compile the loss together with the model "
        "(build_train_step(..., compile=True) does) to let inductor fuse the upcast instead.",
        UserWarning,
        stacklevel=3,
    )


def _describe(value: object) -> str:
    if isinstance(value, torch.Tensor):
        return f"a {value.dtype} tensor of shape {tuple(value.shape)}"
    return f"{type(value).__name__} {value!r}"
