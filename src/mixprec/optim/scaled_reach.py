"""What sees a scaled backward's gradients before the step unscales them, said once at the
first scaled loss: under float16 loss scaling every gradient of that backward is multiplied
by the scale, and the step unscales only the parameters it holds. Gradient hooks on the
parameters that clamped them cut float16 updates to 1/65536 of float32's. An input's
gradient read for its size (a raw gradient-ascent attack, a saliency map) came back 65536
times float32's; a latent tensor stepped by a plain optimizer beside the wrapper moved 3130
times too far (and took the inf of a skipped step for good); a module backward hook that
clipped saw the scaled values, all unsaid. Parameters of prepared models are left to the
checks that know them (a GAN's other optimizer, a plain optimizer over a prepared model)."""

from __future__ import annotations

from typing import Any

import torch
from torch.autograd.graph import Node

from mixprec._warn import warn_at_caller
from mixprec.casting import POLICY_ATTR

__all__ = ["say_what_sees_the_scale"]

_HOOK_NODE = "BackwardHookFunctionBackward"  # register_full_backward_hook's node


# What a hook must do with a gradient it sees scaled: the step unscales what it returns, so
# a hook that returned the gradient divided by the scale had it divided twice (a float16
# clamp hook written so moved the weights 3.8e-7 where float32 moved 0.025).
_IN_A_HOOK = (
    "In the hook, read the gradient as g / opt.loss_scaler.get_scale(), and return it "
    "still scaled: clamp at C * scale (not C), or divide, clamp and multiply back"
)


def say_what_sees_the_scale(loss: torch.Tensor, params: list[torch.Tensor], scale: float) -> None:
    """The gradient hooks on ``params``; then, walking ``loss``'s graph once, the leaves
    outside ``params`` that are no prepared model's parameters, and module backward hooks."""
    if scale == 1.0:
        return
    _say_if_hooks_see_scaled(params, scale)
    if not isinstance(loss, torch.Tensor) or loss.grad_fn is None:
        return
    own = {id(p) for p in params}
    outside: list[torch.Tensor] = []
    hooked = False
    seen: set[object] = set()
    stack: list[Node | None] = [loss.grad_fn]
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        hooked = hooked or node.name() == _HOOK_NODE
        leaf = getattr(node, "variable", None)  # AccumulateGrad: the leaf it writes
        if leaf is not None:
            if id(leaf) not in own and not hasattr(leaf, POLICY_ATTR):
                outside.append(leaf)
            continue
        stack.extend(fn for fn, _ in node.next_functions)
    if outside:
        _say_when_written(outside, scale)
    if hooked:
        warn_at_caller(
            "module backward hooks (register_full_backward_hook) in this backward see "
            f"gradients multiplied by the loss scale ({scale:g}): one that clips or clamps "
            "them cuts the update by about the scale, and one that logs them logs them "
            f"scaled. {_IN_A_HOOK} (said once)"
        )


def _say_when_written(leaves: list[torch.Tensor], scale: float) -> None:
    """Said at the first ``.grad`` the scaled backward writes into one of ``leaves`` (a
    post-accumulate hook on each, all removed then): not for ``torch.autograd.grad`` over
    the scaled loss (Keras' loop) or ``backward(inputs=...)`` without them, which write
    none."""
    handles: list[torch.utils.hooks.RemovableHandle] = []
    shapes = ", ".join(str(tuple(t.shape)) for t in leaves[:3])
    more = ", ..." if len(leaves) > 3 else ""

    def written(_: torch.Tensor) -> None:
        if not handles:
            return
        for handle in handles:
            handle.remove()
        handles.clear()
        warn_at_caller(
            f"{len(leaves)} tensor(s) outside this LossScaleOptimizer get gradients from its "
            f"scaled backward (shapes {shapes}{more}: an input with requires_grad, a latent "
            "or a model that another optimizer steps): their .grad is multiplied by the loss "
            f"scale ({scale:g}) and holds inf when a step is skipped. Give another optimizer "
            "of them to this one, mp.LossScaleOptimizer([opt, other]); for an input's "
            "gradient divide by the scale it was made at, opt.loss_scaler.get_scale() read "
            "before step() (which may change it); its sign, as FGSM takes it, is exact "
            "(said once)"
        )

    handles.extend(t.register_post_accumulate_grad_hook(written) for t in leaves)


def _say_if_hooks_see_scaled(params: list[torch.Tensor], scale: float) -> None:
    """Gradient hooks on the parameters (``register_hook``,
    ``register_post_accumulate_grad_hook``) see the gradients multiplied by the loss
    scale: one that clamps them (per-parameter clipping in the backward) cut float16
    updates to 1/65536 of float32's, unsaid; one that logs them logs them scaled."""
    hooked = sum(
        any(
            _users(hook)
            for hooks in (p._backward_hooks, getattr(p, "_post_accumulate_grad_hooks", None))
            for hook in (hooks or {}).values()
        )
        for p in params
    )
    if hooked:
        warn_at_caller(
            f"{hooked} parameter(s) have gradient hooks (register_hook, "
            "register_post_accumulate_grad_hook), which see the gradients multiplied by the "
            f"loss scale ({scale:g}): a hook that clips or clamps them cuts the update by "
            "about the scale, and one that logs them logs them scaled. Clip in the step "
            "(LossScaleOptimizer(..., max_grad_norm=...), or opt.unscale_() then clip "
            f"opt.master_params()). {_IN_A_HOOK}. A hook that is linear in the gradient (a "
            "sign flip, a mask) is exact: then nothing is wrong (said once)"
        )


def _users(hook: Any) -> bool:
    """A hook of the user's: not torch's own (DDP's all-reduce, linear in the gradient)."""
    fn = getattr(hook, "func", hook)  # a functools.partial's function
    return not str(getattr(fn, "__module__", "") or "").startswith("torch.")
