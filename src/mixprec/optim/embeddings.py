"""``split_embedding_parameters``: a model's embedding tables apart from its other
parameters, for the recommender workflow (a sparse optimizer for the tables, a dense one for
the rest, one ``LossScaleOptimizer`` over both)."""

from __future__ import annotations

from torch import nn

from mixprec._errors import check_module

__all__ = ["split_embedding_parameters"]


def split_embedding_parameters(
    model: nn.Module,
) -> tuple[list[nn.Parameter], list[nn.Parameter]]:
    """``(embedding parameters, other parameters)`` of ``model``, each in model order.

    Embedding tables (``nn.Embedding``, ``nn.EmbeddingBag``) are usually given their own
    optimizer (``SparseAdam`` for sparse gradients) and, in distributed runs, are not
    all-reduced like dense weights. A weight tied between an embedding and another module
    counts as an embedding.
    """
    check_module("split_embedding_parameters", model)
    tables = {
        id(p)
        for m in model.modules()
        if isinstance(m, (nn.Embedding, nn.EmbeddingBag))
        for p in m.parameters(recurse=False)
    }
    params = list(model.parameters())
    return [p for p in params if id(p) in tables], [p for p in params if id(p) not in tables]
