"""The model and data the float8 doctor tests diagnose: a tabular regression whose input has
a sentinel column (a missing reading coded 99999) that sets torchao's tensorwise scale.

CPU float8 matmuls are emulated, so the models are small, with dims that are multiples of 16
and ``min_features=16`` (torchao's size thresholds would convert none of these layers).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from mixprec.float8 import Float8Options

SMALL = Float8Options(min_features=16)
E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
RECIPES = {
    "mixed_float8": "tensorwise",
    "mixed_float8_rowwise": "rowwise",
    "mixed_float8_rowwise_with_gw_hp": "rowwise_with_gw_hp",
}


class Sensors(nn.Module):
    """Tabular regression: 32 features in, LayerNorm after the first layer."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(32, 64)
        self.norm = nn.LayerNorm(64)
        self.fc1 = nn.Linear(64, 64)
        self.fc2 = nn.Linear(64, 64)
        self.head = nn.Linear(64, 16)  # the output head: kept bfloat16

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.gelu(self.norm(self.embed(x)))
        h = F.gelu(self.fc2(F.gelu(self.fc1(h))))
        return self.head(h)


BATCH, MISSING = 64, 99999.0


def sensors(seed: int = 0) -> Sensors:
    torch.manual_seed(seed)
    return Sensors()


def readings(n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Standardised features, targets from a fixed random teacher, and in column 0 of two
    rows per batch of 64 a missing reading coded 99999 (a sentinel, the classic outlier of
    tabular data). One scale for the whole input (tensorwise) is set by the sentinel:
    448 / 99999 puts every ordinary value below E4M3's smallest normal, most below its
    smallest subnormal. bfloat16 keeps its 8 exponent bits per value and does not care; nor,
    after the LayerNorm, do the layers downstream."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 32, generator=g)
    teacher = torch.Generator().manual_seed(1234)
    w1 = torch.randn(32, 64, generator=teacher) / 32**0.5
    w2 = torch.randn(64, 16, generator=teacher) / 8
    y = torch.tanh(x @ w1) @ w2
    for start in range(0, n, BATCH):
        x[start : start + 2, 0] = MISSING
    return x, y
