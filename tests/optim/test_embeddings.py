"""split_embedding_parameters, and sparse embedding tables trained beside dense weights."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import mixprec as mp
from tests.conftest import make_transformer

F32 = torch.float32


def test_split_embedding_parameters_with_tied_weights():
    model = make_transformer()
    emb, other = mp.split_embedding_parameters(model)
    assert emb == [model.embed.weight]
    assert len(emb) + len(other) == len(list(model.parameters()))
    with pytest.raises(TypeError, match="needs an nn.Module, got int"):
        mp.split_embedding_parameters(3)  # type: ignore[arg-type]


def test_sparse_embeddings_with_sparse_adam_and_split():
    class Rec(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.table = nn.Embedding(100, 8, sparse=True)
            self.mlp = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))

        def forward(self, ids):
            return self.mlp(self.table(ids).mean(1)).squeeze(-1)

    torch.manual_seed(0)
    model = mp.auto_mixed_precision(Rec(), "mixed_float16", "O2")
    emb, dense = mp.split_embedding_parameters(model)
    assert emb == [model.table.weight] and len(dense) == 4
    opt = mp.LossScaleOptimizer(
        [torch.optim.SparseAdam(emb, lr=1e-2), torch.optim.Adam(dense, lr=1e-2)],
        max_grad_norm=1.0,
    )
    ids = torch.randint(0, 100, (32, 5))
    target = torch.randn(32)
    losses, results = [], []
    for _ in range(40):
        opt.zero_grad()
        loss = nn.functional.mse_loss(model(ids), target)
        losses.append(loss.item())
        opt.backward(loss)  # one loss scale for both optimizers
        assert model.table.weight.grad.is_sparse
        results.append(opt.step())
    assert sum(r.applied for r in results) >= 35  # the first steps may overflow float16
    assert opt.loss_scaler.state.skipped_steps == sum(not r.applied for r in results)
    assert model.table.weight.dtype == F32  # sparse tables stay float32 under float16
    assert next(iter(opt.master_params())).dtype == F32
    state = opt.state_dict()
    assert len(state["optimizers"]) == 2
    assert losses[-1] < 0.5 * losses[0]
