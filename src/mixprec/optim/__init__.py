"""The optimizer side of mixed precision: ``LossScaleOptimizer`` (float32 master weights,
loss scaling, skipping non-finite steps, clipping, gradient accumulation, Keras' methods)
around any ``torch.optim`` optimizer, what one step did (``StepResult``), the embedding
split of the recommender workflow, and ``CompensatedAdamW`` for pure 16-bit weights.
"""

from __future__ import annotations

from mixprec.optim.compensated import CompensatedAdamW, stochastic_round
from mixprec.optim.embeddings import split_embedding_parameters
from mixprec.optim.fused import needs_scaling
from mixprec.optim.loss_scale_optimizer import LossScaleOptimizer
from mixprec.optim.step_result import StepResult

__all__ = [
    "CompensatedAdamW",
    "LossScaleOptimizer",
    "StepResult",
    "needs_scaling",
    "split_embedding_parameters",
    "stochastic_round",
]
