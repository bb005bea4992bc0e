"""Which torch.nn modules are what to the levels: normalisation, float32 islands, and the
matrix work whose weights O2 stores in 16 bits (``auto_mixed_precision``), which is also
what ``autotune`` gives a dtype of its own."""

from __future__ import annotations

import torch
from torch import nn
from torch.nn.utils.spectral_norm import SpectralNorm

__all__ = [
    "FLOAT32_MODULES",
    "HALF_STORAGE_MODULES",
    "MIXED_NORM_MODULES",
    "NORM_MODULES",
    "is_half_storage",
]

#: Normalisation: statistics computed in float32 at O1 and O2, output in the input's dtype.
NORM_MODULES: tuple[type[nn.Module], ...] = (
    nn.modules.batchnorm._NormBase,  # BatchNorm*, InstanceNorm*, SyncBatchNorm
    nn.LayerNorm, nn.GroupNorm, nn.LocalResponseNorm, nn.RMSNorm,
)  # fmt: skip

#: Normalisation whose PyTorch kernels take 16-bit inputs with float32 weights and compute
#: mean, variance and running statistics in float32 internally (measured on CPU: bfloat16
#: layer_norm equals the float32 result rounded once; CUDA's autocast runs layer_norm in
#: float32 anyway). They need no island, and an island's casts cost time: on the CNN
#: workload, BatchNorm islands made O2 ~1.2x float32 against autocast's ~2x.
MIXED_NORM_MODULES: tuple[type[nn.Module], ...] = (nn.modules.batchnorm._BatchNorm, nn.LayerNorm)

#: Modules that stay float32 at O1 and O2, outputs included: softmax, sigmoid, losses.
#: (Normalisation is a float32 island too, but hands its output back in the input's dtype:
#: NORM_MODULES.) A sigmoid in bfloat16 rounds every probability above 0.998 to exactly 1.0:
#: binary cross-entropy then clamps a wrong one's loss at 100 with no gradient, and a gate
#: at 1.0 passes none back (s * (1 - s) = 0).
FLOAT32_MODULES: tuple[type[nn.Module], ...] = (
    nn.Softmax, nn.LogSoftmax, nn.Softmin, nn.Sigmoid, nn.LogSigmoid, nn.modules.loss._Loss,
)  # fmt: skip


def is_half_storage(module: nn.Module, compute: torch.dtype) -> bool:
    """Matrix-work modules, including Hugging Face's ``Conv1D`` (GPT-2's linear layer).

    Sparse embedding tables stay float32 under float16: PyTorch cannot add float16 sparse
    tensors on the CPU ("cadd_sparse" is not implemented for Half), which accumulation,
    DDP and tables looked up twice all need."""
    if (
        compute == torch.float16
        and isinstance(module, (nn.Embedding, nn.EmbeddingBag))
        and module.sparse
    ):
        return False
    # torch's old spectral_norm hook does its power iteration with float32 buffers (u, v)
    # against weight_orig: in 16 bits the forward failed (addmv "same dtype"), at O2 only.
    if any(isinstance(h, SpectralNorm) for h in module._forward_pre_hooks.values()):
        return False
    kind = type(module)
    return isinstance(module, HALF_STORAGE_MODULES) or (
        kind.__name__ == "Conv1D" and kind.__module__.startswith("transformers")
    )


#: Modules whose weights O2 stores in the compute dtype: the matrix work.
HALF_STORAGE_MODULES: tuple[type[nn.Module], ...] = (
    nn.Linear, nn.Bilinear, nn.modules.conv._ConvNd, nn.Embedding, nn.EmbeddingBag,
    nn.MultiheadAttention, nn.RNNBase,
)  # fmt: skip
