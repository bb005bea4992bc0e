"""A mixed model's float32 output remembers its 16-bit source, and ``cross_entropy`` reads it:
the same loss and gradients bit for bit as through the float32 copy, without saving that
copy; and every case where the shortcut would be visible takes the ordinary path."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import mixprec as mp
from mixprec import cross_entropy
from mixprec._output_sources import source_of


def _model(level: str = "O2") -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(50, 32), nn.LayerNorm(32), nn.Linear(32, 64))
    return mp.auto_mixed_precision(model, "mixed_bfloat16", level)


def _tokens() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return torch.randint(0, 50, (4, 6), generator=g), torch.randint(0, 64, (4, 6), generator=g)


def _grads(model: nn.Module) -> list[torch.Tensor]:
    return [p.grad.clone() for p in model.parameters()]


def _loss_and_grads(level: str, through_copy: bool) -> tuple[torch.Tensor, list[torch.Tensor]]:
    model = _model(level)
    x, y = _tokens()
    out = model(x)
    # A clone carries no link: the control goes through the float32 copy, as before.
    loss = cross_entropy(out.clone() if through_copy else out, y)
    loss.backward()
    return loss.detach(), _grads(model)


def _nodes(loss: torch.Tensor) -> list[object]:
    """Every autograd node ``loss`` reaches."""
    seen: dict[int, object] = {}
    stack = [loss.grad_fn]
    while stack:
        fn = stack.pop()
        if fn is None or id(fn) in seen:
            continue
        seen[id(fn)] = fn
        stack.extend(f for f, _ in fn.next_functions)
    return list(seen.values())


def _reaches(loss: torch.Tensor, node: object) -> bool:
    return any(fn is node for fn in _nodes(loss))


@pytest.mark.parametrize("level", ["O1", "O2"])
def test_loss_and_gradients_are_bit_for_bit_those_through_the_float32_copy(level):
    loss, grads = _loss_and_grads(level, through_copy=False)
    ref_loss, ref_grads = _loss_and_grads(level, through_copy=True)
    assert torch.equal(loss, ref_loss)
    for g, ref in zip(grads, ref_grads, strict=True):
        assert torch.equal(g, ref)


def test_the_loss_keeps_the_16_bit_source_and_not_the_float32_output():
    model = _model()
    x, y = _tokens()
    out = model(x)
    assert out.dtype == torch.float32
    source = source_of(out)
    assert source is not None and source.dtype == torch.bfloat16
    loss = cross_entropy(out, y)
    (chunked,) = [fn for fn in _nodes(loss) if "ChunkedCrossEntropy" in fn.name()]
    saved = chunked.saved_tensors
    assert saved[0].dtype == torch.bfloat16
    assert saved[0].untyped_storage().data_ptr() == source.untyped_storage().data_ptr()
    assert not _reaches(loss, out.grad_fn)  # no float32 gradient, no cast back


def test_no_link_without_autograd():
    model = _model()
    x, _ = _tokens()
    with torch.no_grad():
        out = model(x)
    assert source_of(out) is None
    assert not hasattr(out, "_mixprec_upcast_of")  # the 16-bit output is not kept alive


def _visible_uses():
    def written(out):
        out.mul_(2.0)
        return out

    def retained(out):
        out.retain_grad()
        return out

    def hooked(out):
        out.register_hook(lambda g: g)
        return out

    return [written, retained, hooked]


@pytest.mark.parametrize("use", _visible_uses(), ids=["written", "retain_grad", "hook"])
def test_the_ordinary_path_where_the_shortcut_would_show(use):
    model = _model()
    x, y = _tokens()
    out = use(model(x))
    assert source_of(out) is None
    loss = cross_entropy(out, y)
    assert _reaches(loss, out.grad_fn)
    loss.backward()
    if out.retains_grad:
        assert out.grad is not None and out.grad.dtype == torch.float32


def test_a_second_use_of_the_output_adds_its_gradient():
    # z-loss beside the cross-entropy: the two paths meet at the 16-bit source, summed in
    # 16 bits instead of in float32 then rounded: one more bfloat16 rounding (2**-8 relative)
    # on the output's gradient, which reaches each parameter's gradient as a whole.
    def run(through_copy: bool) -> list[torch.Tensor]:
        model = _model()
        x, y = _tokens()
        out = model(x)
        ce_input = out.clone() if through_copy else out
        (cross_entropy(ce_input, y) + 1e-2 * out.logsumexp(-1).pow(2).mean()).backward()
        return _grads(model)

    for g, ref in zip(run(False), run(True), strict=True):
        assert (g - ref).norm() <= 2**-7 * ref.norm()
