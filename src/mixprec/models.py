"""Reference models for the examples, tests and benchmarks, one per workflow of the guides.

All are plain ``nn.Module``s with float32 weights; mixed precision is applied from outside
(``auto_mixed_precision``, a ``Policy``). Where a model's loss must stay in float32 whatever
the policy, the loss helper next to it (``lm_loss``, ``ctc_loss``) casts to float32 itself.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from mixprec._dtypes import closest
from mixprec._errors import ArgumentError, check_int
from mixprec.losses import cross_entropy

__all__ = [
    "MODELS",
    "CausalLM",
    "Recommender",
    "SpeechCTC",
    "cnn",
    "ctc_loss",
    "get_model",
    "lm_loss",
    "mlp",
    "synthetic_speech",
]


def mlp(
    input_shape: int | tuple[int, ...] = 784, hidden: int = 512, depth: int = 2, classes: int = 10
) -> nn.Module:
    """Flatten → ``depth`` x (Linear(hidden) → ReLU) → Linear(classes), as in the Keras and
    MindSpore mixed precision guides. The input size is the product of ``input_shape``."""
    shape = (input_shape,) if isinstance(input_shape, int) else tuple(input_shape)
    if not shape or any(isinstance(d, bool) or not isinstance(d, int) or d < 1 for d in shape):
        raise ArgumentError(f"input_shape={input_shape!r} is invalid; dims must be ints >= 1")
    for arg, value, minimum in (
        ("hidden", hidden, 1),
        ("depth", depth, 0),
        ("classes", classes, 1),
    ):
        check_int(arg, value, minimum)
    layers: list[nn.Module] = [nn.Flatten()]
    width = math.prod(shape)
    for _ in range(depth):
        layers += [nn.Linear(width, hidden), nn.ReLU()]
        width = hidden
    layers.append(nn.Linear(width, classes))
    return nn.Sequential(*layers)


class _AddChannel(nn.Module):
    """(n, H, W) → (n, 1, H, W), so that grayscale images feed a Conv2d as they are loaded."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.unsqueeze(1) if x.dim() == 3 else x


def cnn(in_channels: int = 1, classes: int = 10, width: int = 32) -> nn.Module:
    """Two conv + BatchNorm + ReLU + max-pool blocks, global average pool, Linear."""
    for arg, value in (("in_channels", in_channels), ("classes", classes), ("width", width)):
        check_int(arg, value, 1)
    return nn.Sequential(
        _AddChannel(),
        nn.Conv2d(in_channels, width, 3, padding=1),
        nn.BatchNorm2d(width),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Conv2d(width, 2 * width, 3, padding=1),
        nn.BatchNorm2d(2 * width),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(2 * width, classes),
    )


class _Block(nn.Module):
    """Pre-norm transformer block: x + attn(LN(x)), then x + MLP(LN(x))."""

    def __init__(self, d_model: int, n_heads: int, dropout: float) -> None:
        super().__init__()
        self.n_heads = n_heads
        self.dropout = dropout
        self.norm1 = nn.LayerNorm(d_model)
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.out = nn.Linear(d_model, d_model)
        self.norm2 = nn.LayerNorm(d_model)
        self.mlp = nn.Sequential(
            nn.Linear(d_model, 4 * d_model), nn.GELU(), nn.Linear(4 * d_model, d_model)
        )
        self.drop = nn.Dropout(dropout)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        b, t, d = h.shape
        qkv = self.qkv(self.norm1(h)).view(b, t, 3, self.n_heads, d // self.n_heads)
        q, k, v = qkv.permute(2, 0, 3, 1, 4)  # each (b, heads, t, head_dim)
        p = self.dropout if self.training else 0.0
        a = F.scaled_dot_product_attention(q, k, v, dropout_p=p, is_causal=True)
        h = h + self.drop(self.out(a.transpose(1, 2).reshape(b, t, d)))
        out: torch.Tensor = h + self.drop(self.mlp(self.norm2(h)))
        return out


class CausalLM(nn.Module):
    """A small pre-norm causal transformer: tokens ``(b, t)`` → logits ``(b, t, vocab)``."""

    def __init__(
        self,
        vocab: int = 1000,
        d_model: int = 128,
        n_layers: int = 2,
        n_heads: int = 4,
        max_len: int = 256,
        dropout: float = 0.0,
    ) -> None:
        super().__init__()
        for arg, value in (("vocab", vocab), ("d_model", d_model), ("n_heads", n_heads)):
            check_int(arg, value, 1)
        check_int("n_layers", n_layers, 0)
        check_int("max_len", max_len, 1)
        if d_model % n_heads:
            raise ArgumentError(
                f"d_model={d_model!r} is not divisible by n_heads={n_heads!r}; "
                "each head gets d_model // n_heads dims"
            )
        self.max_len = max_len
        self.embed = nn.Embedding(vocab, d_model)
        self.pos = nn.Embedding(max_len, d_model)
        # Unit-variance embeddings (the default) would swamp the residual stream at start.
        nn.init.normal_(self.embed.weight, std=0.02)
        nn.init.normal_(self.pos.weight, std=0.02)
        self.drop = nn.Dropout(dropout)
        self.blocks = nn.ModuleList(_Block(d_model, n_heads, dropout) for _ in range(n_layers))
        self.norm = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, vocab)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        if tokens.dim() != 2:
            raise ArgumentError(f"tokens must be (batch, seq_len), got shape {tuple(tokens.shape)}")
        t = tokens.shape[1]
        if t > self.max_len:
            raise ArgumentError(
                f"sequence length {t} exceeds max_len={self.max_len}; pass shorter sequences "
                f"or build CausalLM(max_len>={t})"
            )
        h = self.drop(self.embed(tokens) + self.pos(torch.arange(t, device=tokens.device)))
        for block in self.blocks:
            h = block(h)
        return self.head(self.norm(h))  # type: ignore[no-any-return]


_IGNORE = -100  # lm_loss's target for the last position, which has no next token


def lm_loss(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """Next-token cross-entropy: position i predicts token i+1, in float32 for any logits."""
    # float32 arithmetic: the log-sum-exp over a large vocabulary loses precision in 16 bits
    # (float16 keeps ~3 significant digits, bfloat16 ~2), which biases the loss and gradient.
    # The last position has no next token: ignoring it, instead of slicing it off, spares a
    # copy of the logits, and mixprec's cross_entropy never holds a float32 copy of them.
    targets = F.pad(tokens[:, 1:], (0, 1), value=_IGNORE)
    return cross_entropy(logits, targets, ignore_index=_IGNORE)


_KERNEL, _STRIDE, _PADDING = 3, 2, 1  # SpeechCTC's convolution over time
_MIN_TIME = 39  # synthetic_speech: (39 * 3 // 4 + 2 * 1 - 3) // 2 + 1 = 15 frames


class SpeechCTC(nn.Module):
    """Features ``(b, time, n_mels)`` → Conv1d (stride 2) → GRU → float32 log-probs
    ``(time', b, n_tokens)`` for CTC, with the blank at index 0."""

    def __init__(self, n_mels: int = 40, n_tokens: int = 29, hidden: int = 128) -> None:
        super().__init__()
        check_int("n_mels", n_mels, 1)
        check_int("hidden", hidden, 1)
        check_int("n_tokens", n_tokens, 2)  # the blank and one label at least
        self.n_mels = n_mels
        self.conv = nn.Conv1d(n_mels, hidden, _KERNEL, stride=_STRIDE, padding=_PADDING)
        self.gru = nn.GRU(hidden, hidden, num_layers=1, batch_first=True)
        self.head = nn.Linear(hidden, n_tokens)

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        if features.dim() != 3 or features.shape[-1] != self.n_mels:
            raise ArgumentError(
                f"features must be (batch, time, n_mels={self.n_mels}), "
                f"got shape {tuple(features.shape)}"
            )
        h = F.relu(self.conv(features.transpose(1, 2))).transpose(1, 2)
        h, _ = self.gru(h)
        # float32 log-softmax: CTC sums these over every alignment; see ctc_loss.
        return F.log_softmax(self.head(h).float(), dim=-1).transpose(0, 1)

    def output_lengths(self, input_lengths: torch.Tensor) -> torch.Tensor:
        """Frames left after the strided convolution, for ``ctc_loss``'s input lengths."""
        frames = input_lengths + 2 * _PADDING - _KERNEL
        return torch.div(frames, _STRIDE, rounding_mode="floor") + 1


def ctc_loss(
    log_probs: torch.Tensor,
    targets: torch.Tensor,
    input_lengths: torch.Tensor,
    target_lengths: torch.Tensor,
    blank: int = 0,
) -> torch.Tensor:
    """CTC loss of ``(T, b, n_tokens)`` log-probs, in float32: each sample's loss divided
    by its target length, then the mean over the batch (torch's ``reduction="mean"``).

    16-bit log-probs are computed from in float32 (rounded already: ``SpeechCTC``'s float32
    log-softmax keeps its digits under a policy whose output is float32, the default).
    Refused: targets outside ``[0, n_tokens)`` or equal to ``blank`` within their lengths,
    which torch's CPU kernel does not check (it read past the log-probs); on other
    devices and compiled, torch's own checks stand."""
    # float32 whatever the policy (as the TensorFlow 1 mixed precision guide keeps it): the
    # forward-backward recursion adds up log-probabilities over T frames and every alignment;
    # in 16 bits the rounding of each term accumulates and the loss and gradients drift.
    if log_probs.device.type == "cpu" and not torch.compiler.is_compiling():
        _check_ctc_targets(targets, target_lengths, log_probs.shape[-1], blank)
    return F.ctc_loss(
        log_probs.float(), targets, input_lengths, target_lengths, blank=blank, reduction="mean"
    )


def _check_ctc_targets(
    targets: torch.Tensor, target_lengths: Any, classes: int, blank: int
) -> None:
    """Each sample's labels (within its length) in ``[0, classes)`` and not ``blank``."""
    target_lengths = torch.as_tensor(target_lengths)  # torch takes lists and tuples too
    if targets.dim() == 2:
        if int(target_lengths.max()) > targets.shape[1]:
            raise ArgumentError(
                f"ctc_loss: target_lengths reach {int(target_lengths.max())}, past the "
                f"targets' {targets.shape[1]} columns"
            )
        positions = torch.arange(targets.shape[1], device=targets.device)
        used = targets[positions < target_lengths.to(targets.device)[:, None]]
    else:  # one concatenated row, as torch also takes them
        used = targets[: int(target_lengths.sum())]
    bad = (used < 0) | (used >= classes) | (used == blank)
    if bool(bad.any()):
        value = int(used[bad][0])
        raise ArgumentError(
            f"ctc_loss: targets hold the label {value}; valid: 0..{classes - 1} except the "
            f"blank {blank} (n_tokens={classes}: is the model's vocabulary the data's?)"
        )


def synthetic_speech(
    n: int = 64, time: int = 100, n_mels: int = 40, n_tokens: int = 29, seed: int = 0
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Learnable data for ``SpeechCTC``: (features, targets, input_lengths, target_lengths).

    Targets: 5-15 tokens in 1..n_tokens-1 (0 is the blank), padded with 0 to ``(n, 15)``,
    with no token repeated back to back (without a gap, a repeat could not be heard). Each
    token has a fixed random spectrum; a sample's frames spell its targets in equal
    segments, plus Gaussian noise; frames past ``input_lengths`` are zero.
    """
    check_int("n", n, 1)
    check_int("n_mels", n_mels, 1)
    check_int("n_tokens", n_tokens, 3)  # the blank and 2 labels
    # A sample has at least time * 3 // 4 frames, halved by the stride-2 convolution; CTC
    # needs as many frames as targets (15 at most), or the loss is inf: time >= 39.
    check_int("time", time, _MIN_TIME)
    g = torch.Generator().manual_seed(seed)
    spectra = torch.randn(n_tokens, n_mels, generator=g)
    target_lengths = torch.randint(5, 16, (n,), generator=g)
    input_lengths = torch.randint(time * 3 // 4, time + 1, (n,), generator=g)
    targets = torch.zeros(n, 15, dtype=torch.int64)
    features = torch.zeros(n, time, n_mels)
    for i in range(n):
        length, frames = int(target_lengths[i]), int(input_lengths[i])
        # Adding 1..n_tokens-2 to the previous token (mod the n_tokens-1 labels) never repeats it.
        steps = torch.randint(1, n_tokens - 1, (length,), generator=g)
        labels = (torch.cumsum(steps, 0) % (n_tokens - 1)) + 1
        targets[i, :length] = labels
        which = labels[torch.arange(frames) * length // frames]
        noise = 0.5 * torch.randn(frames, n_mels, generator=g)
        features[i, :frames] = spectra[which] + noise
    return features, targets, input_lengths, target_lengths


class Recommender(nn.Module):
    """One embedding per categorical feature → concatenation → MLP → one logit per sample.

    With ``sparse=True`` the embedding gradients are sparse (only the looked-up rows), as in
    the recommender workflows; optimise those tables with ``SGD`` or ``SparseAdam``.
    """

    def __init__(
        self,
        table_sizes: tuple[int, ...] = (1000, 1000, 100),
        dim: int = 16,
        hidden: int = 64,
        sparse: bool = True,
    ) -> None:
        super().__init__()
        if not table_sizes:
            raise ArgumentError("table_sizes=() is invalid; give at least one table size")
        for size in table_sizes:
            check_int("table_sizes entry", size, 1)
        check_int("dim", dim, 1)
        check_int("hidden", hidden, 1)
        self.tables = nn.ModuleList(nn.Embedding(s, dim, sparse=sparse) for s in table_sizes)
        self.mlp = nn.Sequential(
            nn.Linear(len(table_sizes) * dim, hidden), nn.ReLU(), nn.Linear(hidden, 1)
        )

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if ids.dim() != 2 or ids.shape[1] != len(self.tables):
            raise ArgumentError(
                f"ids must be (batch, {len(self.tables)}): one column per table, "
                f"got shape {tuple(ids.shape)}"
            )
        h = torch.cat([table(ids[:, j]) for j, table in enumerate(self.tables)], dim=1)
        return self.mlp(h).squeeze(-1)  # type: ignore[no-any-return]


MODELS: dict[str, Callable[..., nn.Module]] = {
    "mlp": mlp,
    "cnn": cnn,
    "lm": CausalLM,
    "speech": SpeechCTC,
    "recommender": Recommender,
}


def get_model(name: str, **kwargs: object) -> nn.Module:
    """Build a registered model by name, e.g. ``get_model("lm", vocab=500)``."""
    if name not in MODELS:
        hint = closest(str(name), list(MODELS))
        raise ArgumentError(
            f"model={name!r} is not a known model; valid names: {', '.join(MODELS)}"
            + (f" (closest: {hint!r})" if hint else "")
        )
    return MODELS[name](**kwargs)
