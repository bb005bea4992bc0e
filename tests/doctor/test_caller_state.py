"""The doctor measures with backward passes of its own: under the caller's no_grad they
still run, under inference_mode it says why it cannot, and the caller's input tensors get
no gradient and no hook from it."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import mixprec as mp


def model_and_batch():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    with torch.no_grad():
        model[0].weight.mul_(3000.0)  # activations past float16's range
    return model, torch.randn(16, 8), torch.randint(0, 4, (16,))


def test_under_no_grad_the_report_is_the_same():
    model, x, y = model_and_batch()
    plain = mp.diagnose(model, x, y, F.cross_entropy, check_steps=0)
    with torch.no_grad():
        quiet = mp.diagnose(model, x, y, F.cross_entropy, check_steps=0)
    assert quiet.recommended_keep_float32 == plain.recommended_keep_float32
    assert quiet.loss_scale_reached == plain.loss_scale_reached
    grads = [r.max_param_grad for r in quiet.modules]
    assert grads == [r.max_param_grad for r in plain.modules] and max(grads) > 0


def test_inference_mode_is_refused_with_the_reason():
    model, x, y = model_and_batch()
    with torch.inference_mode(), pytest.raises(ValueError, match="inference_mode"):
        mp.diagnose(model, x, y, F.cross_entropy)


def test_an_input_that_requires_grad_is_left_alone():
    model, x, y = model_and_batch()
    x.requires_grad_(True)
    mp.diagnose(model, x, y, F.cross_entropy, check_steps=0)
    assert x.grad is None and not x._backward_hooks


class _Attention(nn.Module):
    """A hand-written attention: its scores q @ k^T are computed in its own forward, where
    they overflow float16 while every Linear inside stays in range."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.q, self.k, self.v, self.out = (nn.Linear(d, d) for _ in range(4))
        self.d = d

    def forward(self, x):
        s = self.q(x) @ self.k(x).transpose(-1, -2) / self.d**0.5
        return self.out(torch.softmax(s, -1) @ self.v(x))


class _WithAttention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed, self.attn = nn.Linear(16, 64), _Attention(64)
        self.norm, self.head = nn.LayerNorm(64), nn.Linear(64, 4)

    def forward(self, x):
        return self.head(self.norm(self.attn(self.embed(x) * 500.0)))


def test_a_module_whose_own_arithmetic_overflows_is_named_and_kept():
    """Only leaves were candidates: the doctor blamed a later layer and recommended a plan
    that left the forward non-finite."""
    torch.manual_seed(0)
    model = _WithAttention()
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(8, 12, 16, generator=g), torch.randint(0, 4, (8,), generator=g)

    def loss_fn(out, t):
        return F.cross_entropy(out.mean(1), t)

    report = mp.diagnose(model, x, y, loss_fn, "mixed_float16", "O2", check_steps=0)
    assert report.culprits()[0].name == "attn"
    assert "attn" in report.recommended_keep_float32
    import copy

    kept = mp.auto_mixed_precision(copy.deepcopy(model), "mixed_float16", "O2",
                                   keep_float32=report.recommended_keep_float32)  # fmt: skip
    with torch.no_grad():
        assert torch.isfinite(kept(x)).all()


def test_a_single_layer_models_recommendation_applies():
    """The doctor names the model itself "(model)"; the keep list takes that name."""
    torch.manual_seed(0)
    model = nn.Linear(8, 4)
    x, y = torch.randn(16, 8) * 1e5, torch.randint(0, 4, (16,))
    report = mp.diagnose(model, x, y, F.cross_entropy, "mixed_float16", check_steps=0)
    assert report.recommended_keep_float32 == ["(model)"]
    kept = mp.auto_mixed_precision(nn.Linear(8, 4), "mixed_float16",
                                   keep_float32=report.recommended_keep_float32)  # fmt: skip
    with torch.no_grad():
        assert kept(x).dtype == torch.float32 and torch.isfinite(kept(x)).all()


def test_inputs_past_the_16bit_range_at_o2_get_no_keep_list_that_cannot_work():
    """At O2 the model casts its inputs to float16 before any layer: inputs of 1e5 arrive as
    inf whatever is kept. The doctor advised keeping every layer, which left the output
    NaN. It now says the inputs overflow and names what works: O1 with its own keep list."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
    x, y = torch.randn(16, 16), torch.randint(0, 4, (16,))
    x[0, 0] = 1e5
    report = mp.diagnose(model, x, y, nn.CrossEntropyLoss(), "mixed_float16", "O2")
    assert report.inputs_overflow == [("inputs", 1e5)]
    assert report.recommended_keep_float32 == [] and not report.healthy
    assert "casts its inputs to float16 before any layer" in report.advice[0]
    # The cast made the inf, not the model's own code (whose input was finite).
    assert report.own_code is None and "own code" not in str(report)
    assert '"inputs_overflow": [["inputs", 100000.0]]' in report.to_json()
    # What it points to works: O1's own keep list gives a finite output on this batch.
    o1 = mp.diagnose(model, x, y, nn.CrossEntropyLoss(), "mixed_float16", "O1")
    assert o1.inputs_overflow == [] and o1.recommended_keep_float32
    import copy

    kept = mp.auto_mixed_precision(copy.deepcopy(model), "mixed_float16", "O1",
                                   keep_float32=o1.recommended_keep_float32)  # fmt: skip
    with torch.no_grad():
        assert torch.isfinite(kept(x)).all()


class _MaskedScores(nn.Module):
    """An additive mask of -1e9: inf in float16, and harmless (softmax gives it 0)."""

    def __init__(self) -> None:
        super().__init__()
        self.q, self.out = nn.Linear(8, 8), nn.Linear(8, 4)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        return self.out(torch.softmax(self.q(x) + mask, -1))


@dataclasses.dataclass
class _Batch:
    features: torch.Tensor


class _TakesABatch(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.l = nn.Linear(8, 4)

    def forward(self, batch: _Batch) -> torch.Tensor:
        return self.l(batch.features / 1e4)


def test_an_input_cast_to_inf_that_harms_nothing_is_diagnosed_as_before():
    """Only a run the boundary cast made non-finite takes that path: a -1e9 mask (inf in
    float16) leaves the run finite, and keeps its loss-scale check."""
    torch.manual_seed(0)
    x, y = torch.randn(32, 8), torch.randint(0, 4, (32,))
    mask = torch.zeros(32, 8)
    mask[:, :2] = -1e9
    report = mp.diagnose(_MaskedScores(), (x, mask), y, F.cross_entropy, "mixed_float16", "O2")
    assert report.healthy and report.inputs_overflow == []
    assert report.loss_scale_reached == 2.0**16 and report.check is not None


def test_inputs_in_a_dataclass_are_found_as_the_model_casts_them():
    torch.manual_seed(0)
    x, y = torch.randn(32, 8) * 1e6, torch.randint(0, 4, (32,))
    report = mp.diagnose(_TakesABatch(), _Batch(x), y, F.cross_entropy, "mixed_float16", "O2")
    assert [where for where, _ in report.inputs_overflow] == ["inputs.features"]
    assert report.recommended_keep_float32 == [] and report.suggested_loss_scale is None
