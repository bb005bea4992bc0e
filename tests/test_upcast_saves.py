"""Float32 functions inside 16-bit regions save a 16-bit copy of their upcast input: the
same gradients bit for bit (control: the same model with the saving switched off), less
memory, in-place writes still legal, and out of the way of activation checkpointing."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.profiler import ProfilerActivity, profile
from torch.utils.checkpoint import checkpoint

import mixprec as mp
from mixprec import _upcast_saves
from mixprec.models import CausalLM, lm_loss

D, TOKENS = 64, (2, 32)


class InPlaceResidual(nn.Module):
    """``h += mlp(norm(h))``: writes into the LayerNorm's 16-bit input after it ran."""

    def __init__(self) -> None:
        super().__init__()
        self.norm, self.mlp, self.head = nn.LayerNorm(D), nn.Linear(D, D), nn.Linear(D, 3)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        h = self.mlp(h)  # a 16-bit intermediate, not the caller's tensor
        h += self.mlp(self.norm(h))
        return self.head(h)


def _lm(level: str = "auto") -> nn.Module:
    torch.manual_seed(0)
    model = CausalLM(vocab=50, d_model=D, n_layers=1, n_heads=4, max_len=32)
    return mp.auto_mixed_precision(model, "mixed_bfloat16", level)


def _grads(model: nn.Module, enabled: bool, monkeypatch, wrap=None) -> list[torch.Tensor]:
    monkeypatch.setattr(_upcast_saves, "ENABLED", enabled)
    tokens = torch.randint(0, 50, TOKENS, generator=torch.Generator().manual_seed(1))
    model.zero_grad(set_to_none=True)
    out = wrap(model, tokens) if wrap else model(tokens)
    lm_loss(out, tokens).backward()
    return [p.grad.clone() for p in model.parameters()]


@pytest.mark.parametrize("level", ["O1", "O2"])
def test_gradients_are_bit_for_bit_those_of_plain_autograd(level, monkeypatch):
    model = _lm(level).eval()  # no dropout: both runs see the same values
    ours, plain = _grads(model, True, monkeypatch), _grads(model, False, monkeypatch)
    for a, b in zip(ours, plain, strict=True):
        assert torch.equal(a, b)


def _live_bytes_after_forward(model: nn.Module, tokens: torch.Tensor) -> tuple[int, object]:
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        out = model(tokens)
    events = prof.profiler.kineto_results.events()
    return sum(e.nbytes() for e in events if e.name() == "[memory]"), out


def test_layer_norm_inputs_are_kept_in_16_bits(monkeypatch):
    model = _lm().eval()
    tokens = torch.randint(0, 50, TOKENS)
    model(tokens)  # warm caches
    monkeypatch.setattr(_upcast_saves, "ENABLED", False)
    plain, _ = _live_bytes_after_forward(model, tokens)
    monkeypatch.setattr(_upcast_saves, "ENABLED", True)
    ours, _ = _live_bytes_after_forward(model, tokens)
    # Three LayerNorms (two in the block, one before the head), each input 2x32 tokens of
    # 64 features: kept as bfloat16 (2 bytes) instead of float32 (4 bytes).
    assert plain - ours == 3 * 2 * 32 * D * 2


def test_in_place_writes_after_the_float32_function_stay_legal(monkeypatch):
    torch.manual_seed(0)
    model = mp.auto_mixed_precision(InPlaceResidual(), "mixed_bfloat16")
    x, y = torch.randn(4, D), torch.tensor([0, 1, 2, 0])
    grads = []
    for enabled in (True, False):
        monkeypatch.setattr(_upcast_saves, "ENABLED", enabled)
        model.zero_grad(set_to_none=True)
        F.cross_entropy(model(x), y).backward()
        grads.append([p.grad.clone() for p in model.parameters()])
    for a, b in zip(*grads, strict=True):
        assert torch.equal(a, b)


def test_activation_checkpointing_keeps_its_own_hooks(monkeypatch):
    model = _lm().eval()
    seen: list[bool] = []
    real = _upcast_saves._hooks_usable

    def spy() -> bool:
        seen.append(real())
        return seen[-1]

    monkeypatch.setattr(_upcast_saves, "_hooks_usable", spy)
    wrapped = _grads(model, True, monkeypatch,
                     wrap=lambda m, t: checkpoint(m, t, use_reentrant=False))  # fmt: skip
    assert seen and not any(seen)  # inside checkpoint's hooks: ours stood aside
    seen.clear()
    plain = _grads(model, True, monkeypatch)
    assert seen and all(seen)
    for a, b in zip(wrapped, plain, strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize("level", ["O1", "O2", "O3"])
def test_per_sample_gradients_through_a_float32_island(level):
    """``vmap(grad(...))`` (per-sample gradients, DP-SGD) over a prepared model with a
    LayerNorm raised "Cannot access data pointer of Tensor that doesn't have storage" from
    the island's saved-tensor hooks; they now stay out of torch.func transforms. Compared
    with one backward per sample, to bfloat16 rounding."""
    from torch.func import functional_call, grad, vmap

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.LayerNorm(32), nn.ReLU(), nn.Linear(32, 4))
    model = mp.auto_mixed_precision(model, "mixed_bfloat16", level)
    x, y = torch.randn(8, 16), torch.randint(0, 4, (8,))
    params = {k: v.detach() for k, v in model.named_parameters()}

    def loss(p, a, b):
        return F.cross_entropy(functional_call(model, p, (a[None],)), b[None])

    got = vmap(grad(loss), in_dims=(None, 0, 0))(params, x, y)
    for i in range(8):
        model.zero_grad()
        F.cross_entropy(model(x[i : i + 1]), y[i : i + 1]).backward()
        for name, p in model.named_parameters():
            want = p.grad.float()
            err = (got[name][i].float() - want).abs().max() / want.abs().max().clamp(min=1e-6)
            assert err < 0.03, (name, i, err)
