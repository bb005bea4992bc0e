"""Parameters that alias one another: a second ``nn.Parameter`` over a weight's memory
(``head.weight = nn.Parameter(emb.weight)``), and a tied weight loaded under its second
name. Before: O2 and O3 cast each Parameter on its own and untied them (a frozen head
never moved: 0.999 of float32's update missing), at O2 each got a master of its own and
one's update overwrote the other's (0.449 off), and float32 values loaded under the head's
name were rounded to bfloat16 for the masters (1.2e-4 off)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import mixprec as mp
from tests.conftest import TiedLM


def _aliased(frozen: bool) -> nn.Sequential:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(50, 16), nn.Linear(16, 50, bias=False))
    model[1].weight = nn.Parameter(model[0].weight, requires_grad=not frozen)
    return model


def _train(model: nn.Module, opt: torch.optim.Optimizer, steps: int = 20) -> None:
    g = torch.Generator().manual_seed(1)
    for _ in range(steps):
        x = torch.randint(0, 50, (8, 3), generator=g)
        loss = F.cross_entropy(model(x).float().reshape(-1, 50), x.reshape(-1))
        opt.zero_grad()
        if isinstance(opt, mp.LossScaleOptimizer):
            opt.backward(loss)
        else:
            loss.backward()
        opt.step()


@pytest.mark.parametrize("level", ["O2", "O3"])
def test_a_frozen_head_over_the_embeddings_memory_stays_tied_and_trains(level):
    control = _aliased(frozen=True)
    _train(control, torch.optim.SGD([control[0].weight], lr=0.5))
    model = mp.auto_mixed_precision(_aliased(frozen=True), "mixed_bfloat16", level)
    assert model[0].weight.data_ptr() == model[1].weight.data_ptr()
    start = model[1].weight.detach().float().clone()
    # model.parameters(), the frozen head among them, as the usual idiom gives them: the
    # head gets no master (its copy-back would undo the embedding's update).
    _train(model, mp.LossScaleOptimizer(torch.optim.SGD(model.parameters(), lr=0.5)))
    assert model[0].weight.data_ptr() == model[1].weight.data_ptr()
    moved = (control[1].weight.detach() - start).abs().max()
    off = (model[1].weight.detach().float() - control[1].weight.detach()).abs().max()
    # Of float32's move: O2 0.02, O3 (pure bfloat16 SGD) 0.09; before, untied: 0.999.
    assert off < {"O2": 0.05, "O3": 0.15}[level] * moved


@pytest.mark.parametrize("tie", ["before", "after"])
def test_two_trainable_parameters_over_one_memory_are_refused_at_o2(tie):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(50, 16), nn.Linear(16, 50, bias=False))
    if tie == "before":
        model[1].weight = nn.Parameter(model[0].weight)
    mp.auto_mixed_precision(model, "mixed_bfloat16", "O2")
    if tie == "after":
        model[1].weight = nn.Parameter(model[0].weight)
    with pytest.raises(
        mp.ArgumentError,
        match=r"^param_groups\[0\]\['params'\]\[1\] \(shape \(50, 16\), torch.bfloat16\) is a "
        r"second nn.Parameter over the memory of another parameter .* "
        r"\(head\.weight = emb\.weight\), or freeze one \(requires_grad=False\) .*built$",
    ):
        mp.LossScaleOptimizer(torch.optim.SGD(model.parameters(), lr=0.5))


@pytest.mark.parametrize("how", ["keep_float32", "to_float before"])
def test_an_alias_kept_in_float32_keeps_its_weight_float32_and_tied(how):
    """The frozen head kept in float32 and the embedding cast on its own: untied, the head
    never moved while the embedding did."""
    model = _aliased(frozen=True)
    if how == "keep_float32":
        mp.auto_mixed_precision(model, "mixed_bfloat16", "O2", keep_float32=["1"])
    else:
        mp.to_float(model[1], "float32")
        mp.auto_mixed_precision(model, "mixed_bfloat16", "O2")
    assert model[0].weight.dtype == model[1].weight.dtype == torch.float32
    assert model[0].weight.data_ptr() == model[1].weight.data_ptr()
    start = model[1].weight.detach().clone()
    _train(model, mp.LossScaleOptimizer(torch.optim.SGD(model.parameters(), lr=0.5)), 2)
    assert not torch.equal(model[1].weight, start)


def test_a_sparse_gradient_passes_through_a_cast():
    """``mp.to_float`` of a model whose sparse embedding has a gradient: the memory look
    asked the sparse gradient for its storage ("Cannot access storage of
    SparseTensorImpl"), where the cast had worked."""
    model = mp.auto_mixed_precision(nn.Sequential(nn.Embedding(10, 4, sparse=True)),
                                    "bfloat16", "O3")  # fmt: skip
    model(torch.tensor([[1, 2]])).float().sum().backward()
    mp.to_float(model, torch.float32)
    assert model[0].weight.dtype == torch.float32 and model[0].weight.grad.is_sparse


def test_the_same_parameter_tied_under_two_names_is_not_refused():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(50, 16), nn.Linear(16, 50, bias=False))
    model[1].weight = model[0].weight
    mp.auto_mixed_precision(model, "mixed_bfloat16", "O2")
    opt = mp.LossScaleOptimizer(torch.optim.SGD(model.parameters(), lr=0.5))
    _train(model, opt, steps=2)
    assert model[0].weight is model[1].weight


@pytest.mark.parametrize("key", ["emb.weight", "head.weight"])
def test_float32_values_loaded_under_either_name_of_a_tied_weight_start_the_master(key):
    torch.manual_seed(0)
    values = torch.randn(50, 16) * 0.02
    model = mp.auto_mixed_precision(TiedLM(), "mixed_bfloat16", "O2")
    model.load_state_dict({key: values}, strict=False)
    opt = mp.LossScaleOptimizer(torch.optim.SGD(model.parameters(), lr=0.0))
    (master,) = [m for _, m in opt.master_weights()]
    assert torch.equal(master, values)
