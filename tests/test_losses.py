"""mixprec.cross_entropy against F.cross_entropy on float32 logits (the control), for every
reduction, ignored targets, several chunks and 16-bit logits; and what it keeps for backward."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import mixprec as mp
from mixprec import ArgumentError, cross_entropy, losses

# float32 against float32: the same arithmetic in another order (sums over 1000 classes).
F32 = {"rtol": 1e-5, "atol": 1e-6}


def _logits(n: int = 300, classes: int = 1000, dtype: torch.dtype = torch.float32):
    g = torch.Generator().manual_seed(0)
    logits = (3 * torch.randn(n, classes, generator=g)).to(dtype).requires_grad_()
    target = torch.randint(0, classes, (n,), generator=g)
    target[::7] = -100
    return logits, target


def _value_and_grad(fn, logits):
    logits.grad = None
    loss = fn(logits)
    loss.sum().backward()
    return loss.detach(), logits.grad


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("chunk_elements", [1 << 20, 7000])  # one chunk; 43 with a short last
def test_equals_torch_cross_entropy_on_float32_logits(reduction, chunk_elements, monkeypatch):
    monkeypatch.setattr(losses, "_CHUNK_ELEMENTS", chunk_elements)
    logits, target = _logits()
    ours = _value_and_grad(lambda x: cross_entropy(x, target, reduction=reduction), logits)
    ref = _value_and_grad(lambda x: F.cross_entropy(x, target, reduction=reduction), logits)
    torch.testing.assert_close(ours[0], ref[0], **F32)
    torch.testing.assert_close(ours[1], ref[1], **F32)
    assert ours[0].dtype == torch.float32


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_16_bit_logits_give_the_float32_loss_and_a_16_bit_gradient(dtype):
    logits, target = _logits(dtype=dtype)
    loss, grad = _value_and_grad(lambda x: cross_entropy(x, target), logits)
    # Control: the same 16-bit values upcast, then F.cross_entropy in float32.
    up = logits.detach().float().requires_grad_()
    ref_loss, ref_grad = _value_and_grad(lambda x: F.cross_entropy(x, target), up)
    assert loss.dtype == torch.float32 and grad.dtype == dtype
    torch.testing.assert_close(loss, ref_loss, **F32)
    # The gradient is the float32 one rounded once to the logits' dtype: within one unit in
    # its last place (2**-8 relative for bfloat16, 2**-11 for float16).
    eps = torch.finfo(dtype).eps
    torch.testing.assert_close(grad.float(), ref_grad, rtol=eps, atol=1e-7)


def test_language_model_layout_and_gradcheck():
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(2, 5, 11, dtype=torch.float64, generator=g, requires_grad=True)
    target = torch.randint(0, 11, (2, 5), generator=g)
    target[1, -1] = -100
    ref = F.cross_entropy(logits.reshape(-1, 11), target.reshape(-1))
    torch.testing.assert_close(cross_entropy(logits, target), ref, rtol=1e-12, atol=1e-12)
    assert cross_entropy(logits, target, reduction="none").shape == (2, 5)
    for reduction in ("mean", "none"):
        assert torch.autograd.gradcheck(
            lambda x, r=reduction: cross_entropy(x, target, reduction=r), (logits,)
        )


def test_all_targets_ignored_gives_nan_like_torch():
    logits = torch.randn(3, 4)
    target = torch.full((3,), -100)
    assert torch.isnan(cross_entropy(logits, target))
    assert torch.isnan(F.cross_entropy(logits, target))
    assert cross_entropy(logits, target, reduction="sum").item() == 0.0


def test_all_targets_ignored_give_zero_gradients_like_torch():
    """The loss is NaN (a mean over no row), but no row takes a gradient: the backward gave
    inf * 0 = NaN, so an all-padding micro-batch threw away its accumulation group and
    halved the loss scale."""
    ours = torch.randn(3, 4, requires_grad=True)
    theirs = ours.detach().clone().requires_grad_()
    target = torch.full((3,), -100)
    cross_entropy(ours, target).backward()
    F.cross_entropy(theirs, target).backward()
    assert torch.equal(ours.grad.abs(), theirs.grad.abs()) and not ours.grad.any()
    opt = mp.LossScaleOptimizer(torch.optim.SGD([ours], lr=0.1), accumulation_steps=2)
    opt.zero_grad()
    opt.backward(cross_entropy(ours, torch.tensor([0, 1, 2])))
    opt.backward(cross_entropy(ours, target))  # the group's second micro-batch: all padding
    result = opt.step()
    assert result.applied and not result.found_inf, result


def test_masked_classes_and_fully_masked_rows_like_torch():
    # Masked vocabulary entries (-inf) are common; a row masked everywhere gives NaN in torch.
    logits, target = _logits(n=6, classes=9)
    with torch.no_grad():
        logits[:, :4] = float("-inf")
        logits[5] = float("-inf")
    target = torch.tensor([4, 5, 6, 7, 8, 4])
    ours = cross_entropy(logits, target, reduction="none")
    ref = F.cross_entropy(logits, target, reduction="none")
    torch.testing.assert_close(ours[:5], ref[:5], **F32)
    assert torch.isnan(ours[5]) and torch.isnan(ref[5])
    grad_ours = _value_and_grad(lambda x: cross_entropy(x[:5], target[:5]), logits)[1]
    grad_ref = _value_and_grad(lambda x: F.cross_entropy(x[:5], target[:5]), logits)[1]
    torch.testing.assert_close(grad_ours, grad_ref, **F32)


def test_keeps_only_its_input_and_one_float_per_row_for_backward():
    logits, target = _logits(n=512, classes=2048, dtype=torch.bfloat16)
    saved: list[torch.Tensor] = []

    def pack(t):
        saved.append(t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        cross_entropy(logits, target)
    extra = sum(t.numel() * t.element_size() for t in saved if t.data_ptr() != logits.data_ptr())
    assert any(t.data_ptr() == logits.data_ptr() and t.dtype == torch.bfloat16 for t in saved)
    # Per row: the target (8 bytes), its not-ignored flag (1) and the log-sum-exp (4); no
    # float32 copy of the logits (512 x 2048 x 4 bytes = 4 MiB) nor of the log-probs.
    assert extra <= 512 * (8 + 1 + 4) + 64


def test_target_out_of_range_raises():
    # An IndexError naming the target, as F.cross_entropy's (a gather's RuntimeError named
    # an index of a dimension); an ignored label is no target.
    with pytest.raises(IndexError, match=r"target 4 is out of bounds; valid: 0\.\.3, or ignore"):
        cross_entropy(torch.randn(2, 4), torch.tensor([1, 4]))
    cross_entropy(torch.randn(2, 4), torch.tensor([1, -100]))


@pytest.mark.parametrize(
    ("logits", "target", "kwargs", "message"),
    [
        (torch.ones(3, 4, dtype=torch.int64), torch.zeros(3, dtype=torch.int64), {},
         "logits must be a floating tensor with classes on the last of at least 2 dimensions, "
         "got a torch.int64 tensor of shape (3, 4)"),
        (torch.ones(4), torch.zeros(1, dtype=torch.int64), {},
         "got a torch.float32 tensor of shape (4,)"),
        (torch.ones(3, 4), torch.zeros(3), {},
         "target must be an int64 or int32 tensor of class indices, got a torch.float32 "
         "tensor of shape (3,)"),
        (torch.ones(3, 4), [0, 1, 2], {}, "got list [0, 1, 2]"),
        (torch.ones(3, 4), torch.zeros(2, dtype=torch.int64), {},
         "target has shape (2,), expected (3,) (the logits' (3, 4) without the class "
         "dimension)"),
        (torch.ones(3, 4), torch.zeros(3, dtype=torch.int64), {"reduction": "avg"},
         "reduction='avg' is not valid; valid: 'mean', 'sum', 'none'"),
    ],
)  # fmt: skip
def test_bad_arguments_are_named(logits, target, kwargs, message):
    with pytest.raises(ArgumentError) as info:
        cross_entropy(logits, target, **kwargs)
    assert message in str(info.value)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_zero_rows_give_nan_and_an_empty_gradient_like_torch(dtype):
    # Before: backward failed with "range() arg 3 must not be zero".
    logits = torch.randn(0, 5, dtype=dtype, requires_grad=True)
    loss = cross_entropy(logits, torch.zeros(0, dtype=torch.long))
    assert torch.isnan(loss) and torch.isnan(F.cross_entropy(logits.float(), torch.zeros(0).long()))
    loss.backward()
    assert logits.grad is not None and logits.grad.shape == (0, 5)


def test_the_gradient_of_the_float32_logits_themselves_through_the_documented_ways():
    """The shortcut to the 16-bit source takes the float32 logits out of the graph;
    retain_grad() or a clone keeps them in, as docs/trainer.md says."""
    model = mp.models.CausalLM(vocab=64, d_model=32, n_layers=1, n_heads=2)
    mp.auto_mixed_precision(model, "mixed_bfloat16", "O2")
    x = torch.randint(0, 64, (2, 16))
    logits = model(x)
    reference = torch.autograd.grad(F.cross_entropy(logits.transpose(1, 2), x), logits)[0]
    logits = model(x)
    logits.retain_grad()
    kept = torch.autograd.grad(mp.cross_entropy(logits, x), logits)[0]
    logits = model(x)
    cloned = torch.autograd.grad(mp.cross_entropy(logits.clone(), x), logits)[0]
    torch.testing.assert_close(kept, reference, rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(cloned, reference, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("bad", [1.5, "x", None, True])
def test_cross_entropy_refuses_an_ignore_index_that_is_no_int(bad):
    # 1.5 matched no label and gave a loss; F.cross_entropy refuses it.
    with pytest.raises(mp.ArgumentError, match=rf"ignore_index={bad!r} is not valid; valid: an"):
        mp.cross_entropy(torch.randn(3, 4), torch.tensor([0, 1, 2]), ignore_index=bad)


@pytest.mark.parametrize("ignore", [False, True])
def test_second_order_gradients_equal_f_cross_entropy(ignore):
    """``create_graph=True`` through the loss (MAML's inner step, an input-gradient
    penalty): the backward was once-differentiable, so its gradient was a constant and
    the meta-gradient came out 12% off ``F.cross_entropy``'s, the penalty's 9%, unsaid."""
    from torch.func import functional_call

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 4))
    xs, xq = torch.randn(20, 16), torch.randn(20, 16)
    ys, yq = torch.randint(0, 4, (20,)), torch.randint(0, 4, (20,))
    if ignore:
        ys[::3] = -100
    params = dict(model.named_parameters())

    def meta_gradient(ce):
        inner = ce(functional_call(model, params, (xs,)), ys)
        grads = torch.autograd.grad(inner, list(params.values()), create_graph=True)
        fast = {k: v - 0.5 * g for (k, v), g in zip(params.items(), grads, strict=True)}
        outer = F.cross_entropy(functional_call(model, fast, (xq,)), yq)
        return torch.autograd.grad(outer, list(params.values()))

    def penalty_gradient(ce):
        x = xs.clone().requires_grad_(True)
        (gx,) = torch.autograd.grad(ce(model(x), ys), x, create_graph=True)
        return torch.autograd.grad(gx.pow(2).sum(), list(params.values()))

    for how in (meta_gradient, penalty_gradient):
        for ours, theirs in zip(how(mp.cross_entropy), how(F.cross_entropy), strict=True):
            torch.testing.assert_close(ours, theirs, rtol=1e-4, atol=1e-6)
