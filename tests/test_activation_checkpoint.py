"""Activation checkpointing of blocks inside a prepared model (``mp.activation_checkpoint``,
``mp.checkpoint_context``): the recompute computes softmax and normalisation in float32 as
the forward did, so the gradients equal those of the same model without checkpointing."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

import mixprec as mp


class Block(nn.Module):
    """Pre-norm block: a LayerNorm module and a functional softmax, both float32 at O2."""

    def __init__(self) -> None:
        super().__init__()
        self.norm, self.fc = nn.LayerNorm(32), nn.Linear(32, 32)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc(self.norm(x)).softmax(-1)


class Net(nn.Module):
    def __init__(self, wrap=None) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.blocks = nn.ModuleList(Block() for _ in range(2))
        self.head = nn.Linear(32, 4)
        self.wrap = wrap

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = self.wrap(block, x) if self.wrap else block(x)
        return self.head(x)


def grads(wrap=None, level: str = "O2", compile: bool = False) -> torch.Tensor:
    model = mp.auto_mixed_precision(Net(wrap), "mixed_bfloat16", level)
    run = torch.compile(model, fullgraph=True) if compile else model
    run(torch.randn(8, 32, generator=torch.Generator().manual_seed(1))).square().mean().backward()
    return torch.cat([p.grad.float().flatten() for p in model.parameters()])


@pytest.mark.parametrize("level", ["O1", "O2"])
def test_a_checkpointed_block_recomputes_as_its_forward_did(level):
    # torch's checkpoint restores autocast for the recompute, not the float32 functions
    # mode: its non-reentrant variant then failed on the recomputed dtypes.
    with pytest.raises(torch.utils.checkpoint.CheckpointError, match="metadata"):
        grads(lambda b, x: checkpoint(b, x, use_reentrant=False), level)
    plain = grads(level=level)
    assert torch.equal(grads(mp.activation_checkpoint, level), plain)  # bitwise
    context = lambda b, x: checkpoint(b, x, use_reentrant=False,  # noqa: E731
                                      context_fn=mp.checkpoint_context)  # fmt: skip
    assert torch.equal(grads(context, level), plain)


def test_outside_a_prepared_model_it_is_torch_checkpoint():
    torch.manual_seed(0)
    block = Block()
    x = torch.randn(4, 32, requires_grad=True)
    mp.activation_checkpoint(block, x).sum().backward()
    expected = x.grad.clone()
    x.grad = None
    block(x).sum().backward()
    assert torch.equal(x.grad, expected)


def test_compiled_whole_graph_with_checkpointed_blocks():
    plain = grads(compile=True)
    # The traced graph holds the casts; its recompute is the graph's own.
    checked = grads(mp.activation_checkpoint, compile=True)
    assert torch.allclose(checked, plain, rtol=0.0, atol=2e-2 * plain.abs().max().item())


def test_the_reentrant_variant_runs_and_says_once_what_its_recompute_does():
    # It takes no context_fn: inside a prepared model its recompute runs the float32
    # functions in 16 bits. Outside one (or at a float32 policy) there is nothing to say.
    import warnings

    import mixprec.recompute as module

    module._SAID_REENTRANT.clear()
    reentrant = lambda b, x: mp.activation_checkpoint(b, x, use_reentrant=True)  # noqa: E731
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        for policy in ("float32", "mixed_bfloat16", "mixed_bfloat16"):
            model = mp.auto_mixed_precision(Net(reentrant), policy)
            # The reentrant variant gives gradients only through inputs that need them.
            model(torch.randn(8, 32, requires_grad=True)).square().mean().backward()
            assert all(p.grad is not None for p in model.parameters())
    said = [w for w in seen if "use_reentrant=True inside a prepared model" in str(w.message)]
    assert len(said) == 1


def test_torch_checkpoint_failing_in_opt_backward_names_what_to_use():
    # torch's message names tensor positions and dtypes only; opt.backward (and so the
    # Trainer) says it again with the pointer, and the failed backward leaves no gradients.
    model = mp.auto_mixed_precision(
        Net(lambda b, x: checkpoint(b, x, use_reentrant=False)), "mixed_bfloat16", "O2"
    )
    opt = mp.LossScaleOptimizer(torch.optim.SGD(model.parameters(), 0.1))
    loss = model(torch.randn(8, 32)).float().square().mean()
    with pytest.raises(
        torch.utils.checkpoint.CheckpointError,
        match=r"(?s)different metadata.*mp\.activation_checkpoint\(block, \*args\).*"
        r"context_fn=mp\.checkpoint_context",
    ) as info:
        opt.backward(loss)
    assert isinstance(info.value.__cause__, torch.utils.checkpoint.CheckpointError)
    assert all(p.grad is None for p in model.parameters())


def test_other_backward_errors_pass_through_as_they_were():
    model = mp.auto_mixed_precision(Net(), "mixed_bfloat16", "O2")
    opt = mp.LossScaleOptimizer(torch.optim.SGD(model.parameters(), 0.1))
    loss = model(torch.randn(8, 32)).float().square().mean()
    opt.backward(loss, retain_graph=False)
    with pytest.raises(RuntimeError, match="backward through the graph a second time") as info:
        opt.backward(loss)
    assert info.value.__cause__ is None


def test_a_recompute_of_another_shape_outside_mixprec_gets_no_pointer():
    # float32 on both sides (a block whose recompute takes another shape): not the float32
    # functions mode's doing, so torch's message stands alone.
    from mixprec.recompute import with_pointer

    width = {"n": 4}

    def block(x: torch.Tensor) -> torch.Tensor:
        out = torch.tanh(x[:, : width["n"]])  # saves its output, which the recompute checks
        width["n"] = 3
        return out

    x = torch.randn(2, 8, requires_grad=True)
    with pytest.raises(torch.utils.checkpoint.CheckpointError) as info:
        checkpoint(block, x, use_reentrant=False).sum().backward()
    assert "torch.float32" in str(info.value) and with_pointer(info.value) is None
