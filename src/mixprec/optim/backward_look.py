"""``BackwardLook``: over the first ``STEPS`` steps, what each ``opt.backward`` left, looked
at again at the next backward of an accumulation group (gradients cleared in between:
``model.zero_grad()``) and at the step (gradients changed while still multiplied by the
loss scale: a clip too early; another wrapper's backward at another scale). A loop's
habits show at once; after those steps it costs nothing.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from mixprec._dtypes import HALF_DTYPES
from mixprec._errors import MisuseError
from mixprec._warn import warn_at_caller
from mixprec.optim import rounding
from mixprec.optim.scaled_reach import say_what_sees_the_scale

if TYPE_CHECKING:
    from mixprec.optim.loss_scale_optimizer import LossScaleOptimizer
    from mixprec.optim.masters import MasterWeights

__all__ = ["BackwardLook", "grad_versions"]


def grad_versions(params: list[torch.Tensor]) -> list[int]:
    """The version counters of the parameters' gradients (-1 for none)."""
    return [-1 if p.grad is None else p.grad._version for p in params]


class BackwardLook:
    """The gradients' version counters after each ``opt.backward`` of the first
    ``STEPS`` steps (a loop's habits show at once; after that it costs nothing), looked at:

    - at the next backward of the same accumulation group: a gradient gone (``None``) or
      zeroed in place since means the earlier micro-batches were cleared
      (``model.zero_grad()`` between them), and only the last one would be applied;
    - at the step, under a loss scale above 1: every gradient changed since the last
      backward and before the unscale (``clip_grad_norm_(model.parameters())`` as with
      torch.amp, which multiplies them all) was clipped while still multiplied by the scale,
      so the clip cut it by about the scale. An edit of some (a mask) is not said;
    - at the step: 16-bit weights written since the last backward (a perturbation undone,
      as SAM does) that miss their masters' rounding by about a unit in the last place.
      The step gives those elements' masters the written 16-bit values, and their float32
      digits go: a SAM run at O2 in bfloat16 ended 4.3 times float32's update away from
      it, unsaid (restored with ``p.sub_(e)``; with ``p.copy_(saved)``, 0.035).
    """

    STEPS = 3

    def __init__(self) -> None:
        self.steps = 0
        self.versions: list[int] | None = None
        self.weights: list[tuple[int, int]] | None = None  # the 16-bit weights' versions
        self.seen = 0  # the count of looked-at backwards (any optimizer's) after its own
        self.norm: torch.Tensor | None = None  # the gradients' norm after its own backward
        self.hooks_looked = False  # the parameters' gradient hooks (first_scaled_loss)

    def backward(self, opt: LossScaleOptimizer, loss: torch.Tensor, kwargs: dict[str, Any]) -> None:
        """``opt``'s backward of one of the first steps, looked at before (cleared
        gradients) and after (their versions)."""
        if torch.compiler.is_compiling():
            opt.get_scaled_loss(loss).backward(**kwargs)
            return
        params = opt._weights.model_params()
        if opt._book.micro == 0:  # a group's first backward: counted here, eagerly (under
            self.steps += 1  # torch.compile(opt.step) the step's look is not run)
            if self.steps == 1:
                _say_if_loss_16bit(loss, opt._loss_scaler.get_scale())
        self._before_backward(params, opt._book.micro, opt.accumulation_steps)
        opt.get_scaled_loss(loss).backward(**kwargs)
        self.versions = grad_versions(params)
        self.norm = _total_norm(params)  # read only if another optimizer's backward follows
        self.weights = opt._weights.half_versions()
        self.seen = _note_backward(opt._loss_scaler.get_scale())  # no fold of device steps

    def looking(self, micro: int) -> bool:
        """Whether the backward about to run is looked at: one of the first ``STEPS``
        groups' (counted at each group's first backward), or a later micro-batch of the
        last of them."""
        return self.steps < self.STEPS or (micro > 0 and self.versions is not None)

    def first_scaled_loss(
        self, params: list[torch.Tensor], scale: float, loss: torch.Tensor
    ) -> None:
        """At the first scaled loss (``opt.backward``, or ``get_scaled_loss`` as the
        integrations call it): the gradient hooks, and the tensors outside ``params``,
        that will see it scaled."""
        if not torch.compiler.is_compiling():  # looked at in an eager call
            self.hooks_looked = True
            say_what_sees_the_scale(loss, params, scale)

    def _before_backward(self, params: list[torch.Tensor], micro: int, steps: int) -> None:
        then = self.versions
        if then is None or not 0 < micro < steps:
            return
        for p, version in zip(params, then, strict=False):
            grad = p.grad
            if version == -1 or (grad is not None and grad._version == version):
                continue
            if grad is None or not bool(grad.any()):
                self.versions = None
                raise MisuseError(
                    f"the gradients of this accumulation group's first {micro} micro-batch"
                    f"{'es' if micro > 1 else ''} were cleared before this backward "
                    "(model.zero_grad() between micro-batches?): with accumulation_steps="
                    f"{steps} only the last micro-batch would be applied, still divided by "
                    f"{steps}. Clear with opt.zero_grad(), which keeps them until the group's "
                    "step, or not at all between micro-batches"
                )

    def _grew(self, params: list[torch.Tensor]) -> bool:
        """Whether the gradients grew since this optimizer's own backward: another
        backward added to them. An own clip (``clip_grad_norm_`` at scale 1, legitimate)
        only shrinks them; another model's optimizer at another scale, sharing nothing,
        was taken for an addition."""
        then, now = self.norm, _total_norm(params)
        return then is None or now is None or bool(now > then * 1.001)

    def before_unscale(self, weights: MasterWeights, scale: float) -> None:
        then, self.versions = self.versions, None
        if then is None or torch.compiler.is_compiling():
            return
        written = self.weights is not None and weights.half_versions() != self.weights
        if written and _said_inexact_restore(weights, self.weights):  # type: ignore[arg-type]
            self.steps = self.STEPS  # said once
        params = weights.model_params()
        # Every gradient still there written since: a clip (clip_grad_norm_ multiplies them
        # all), not a mask or an edit of a few (gone ones are no_gradients' to say).
        present = [
            (p.grad, v)
            for p, v in zip(params, then, strict=False)
            if v != -1 and p.grad is not None
        ]
        others = [s for count, s in _RECENT if count > self.seen and s != scale]
        if others and any(g._version != v for g, v in present) and self._grew(params):
            self.steps = self.STEPS  # said once
            warn_at_caller(
                "another LossScaleOptimizer's backward, at loss scale "
                f"{others[0]:g}, added to gradients of this one's (scale {scale:g}) after its "
                "own backward (a module both losses reach, such as a shared trunk): this "
                "optimizer divides the sum by its own scale, so the other loss's part comes "
                f"out {others[0] / scale:g} times too large or small. Wrap both in one, "
                "mp.LossScaleOptimizer([opt_a, opt_b]), with one backward of the summed loss "
                "(said once)"
            )
            return
        if scale != 1.0 and present and all(g._version != v for g, v in present):
            self.steps = self.STEPS  # said once
            warn_at_caller(
                "every gradient was rewritten between backward() and the unscale, while still "
                f"multiplied by the loss scale ({scale:g}). A clip_grad_norm_(model.parameters()"
                ", ...) there, as with torch.amp, saw the scaled gradients and cut them by about "
                "the scale: call opt.unscale_() first and clip opt.master_params(), or pass "
                "LossScaleOptimizer(..., max_grad_norm=...). A second backward through them "
                "(another LossScaleOptimizer's) added to them: wrap both optimizers in one, "
                "mp.LossScaleOptimizer([opt_a, opt_b]). (A linear edit, such as averaging them "
                "over ranks yourself, is exact under the scale: then nothing is wrong; said once)"
            )


def _total_norm(params: list[torch.Tensor]) -> torch.Tensor | None:
    grads = [p.grad for p in params if p.grad is not None and not p.grad.is_sparse]
    if not grads:
        return None
    # In float32: a float16 norm of gradients under the scale is inf, and inf never grows.
    norms = torch._foreach_norm(grads, 2, dtype=torch.float32)
    total: torch.Tensor = torch.stack([n.to(norms[0].device) for n in norms]).norm()
    return total


def _say_if_loss_16bit(loss: torch.Tensor, scale: float) -> None:
    """A loss computed in 16 bits (a pure policy's 16-bit outputs into F.cross_entropy):
    its steps (0.0078 near 1.0 in bfloat16) hide improvement, so a ReduceLROnPlateau fed
    it cut the learning rate to 1e-8 (float32: none), and in float16 the scaled loss's
    own gradient, the scale, is inf past 65504 (every first step skipped), unsaid. Also
    one computed in 16 bits and then cast (``loss_fn(output, target).float()``): the cast
    keeps the rounding, and its backward passes the scale back in 16 bits."""
    if not isinstance(loss, torch.Tensor):
        return
    dtype: torch.dtype | None = loss.dtype
    cast = ""
    if dtype not in HALF_DTYPES:
        dtype, cast = _cast_from(loss), " and then cast"
    if dtype in HALF_DTYPES:
        overflows = dtype == torch.float16 and scale > 65504
        warn_at_caller(
            f"the loss is computed in {str(dtype).removeprefix('torch.')}{cast}: its "
            f"rounding (steps of {torch.finfo(dtype).eps:.2g} near 1.0) hides real progress "
            "from what reads it (a ReduceLROnPlateau cut the learning rate to 1e-8 where "
            "float32 kept 1e-3)"
            + (f", and at loss scale {scale:g} its own gradient overflows" if overflows else "")
            + ". Compute it in float32: loss_fn(output.float(), target)"
        )


def _cast_from(loss: torch.Tensor) -> torch.dtype | None:
    """The dtype of what ``loss`` was cast from, where its last op is a cast (``.float()``,
    ``.to(...)``). Read from the autograd node before the cast: the metadata it keeps of
    its forward's output (private in torch, so looked up with a default)."""
    fn = loss.grad_fn
    if fn is None or fn.name() != "ToCopyBackward0" or len(fn.next_functions) != 1:
        return None
    node, index = fn.next_functions[0]
    meta = getattr(node, "_input_metadata", None)
    if not meta or index >= len(meta):
        return None
    dtype: torch.dtype = meta[index].dtype
    return dtype


def _said_inexact_restore(weights: MasterWeights, then: list[tuple[int, int]]) -> bool:
    """16-bit weights written since the last backward, some elements within two units in
    the last place of their masters and not their rounding: a perturbation undone by
    arithmetic (SAM's ``p.sub_(e)``), which rounds. Said at once (one host read); whether
    it was said."""
    near = []
    with torch.no_grad():
        # A group added since the backward (add_param_group) has weights beyond ``then``.
        for p, m, stored, was in zip(weights.half, weights.masters, weights.stored, then,
                                     strict=False):  # fmt: skip
            if (p._version, p.data_ptr()) == was:
                continue
            low = rounding.narrower(p.dtype, stored)
            missed = m.to(low) != p.to(low)
            near.append((missed & ~rounding.moved(p.float(), m, low)).sum())
    count = int(torch.stack(near).sum()) if near else 0
    if count:  # said once
        warn_at_caller(
            f"{count} values of 16-bit weights were written between the last backward and "
            "step() (a perturbation undone, as SAM does?) and miss their float32 masters' "
            "rounding by about a unit in the last place: the step takes the written 16-bit "
            "values for them, and their masters lose their float32 digits (a SAM run at O2 "
            "ended 4.3 times float32's update away from it). Undo such a change exactly: "
            "saved = [p.detach().clone() for p in params] before it, p.copy_(s) after"
        )
    return count > 0


# The scales of the latest looked-at backwards of every LossScaleOptimizer, counted: a
# gradient written by another optimizer's backward at another scale is unscaled wrongly.
_RECENT: list[tuple[int, float]] = []
_COUNT = [0]


def _note_backward(scale: float) -> int:
    _COUNT[0] += 1
    _RECENT.append((_COUNT[0], scale))
    del _RECENT[:-16]
    return _COUNT[0]
