"""Optimizer state and parameters laid out alike for torch's fused kernels, which walk a
parameter, its gradient and its state as flat memory (``optim/layouts.py``)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import mixprec as mp


def _cnn(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.Conv2d(8, 8, 3, padding=1),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 4),
    ).to(memory_format=torch.channels_last)  # fmt: skip


def _batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [
        (torch.randn(8, 3, 8, 8, generator=g).to(memory_format=torch.channels_last),
         torch.randint(0, 4, (8,), generator=g))
        for _ in range(6)
    ]  # fmt: skip


@pytest.mark.parametrize("level", ["O1", "O2"])
def test_a_channels_last_model_resumed_from_a_checkpoint_trains_as_without_the_break(
    tmp_path, level
):
    """A checkpoint writes state contiguous and torch's load keeps that: a channels_last
    conv's exp_avg no longer matched its weight, and the fused AdamW kernel mixed
    elements' moments (0.35 of the update off after the resume), unsaid."""

    def make(seed: int) -> tuple[nn.Module, mp.LossScaleOptimizer]:
        model = mp.auto_mixed_precision(_cnn(seed), "mixed_bfloat16", level)
        return model, mp.LossScaleOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-2))

    path = tmp_path / "c.safetensors"
    for a, b in zip(_run(make, _batches()), _run(make, _batches(), path, 3), strict=True):
        torch.testing.assert_close(b, a, rtol=0, atol=0)


def _run(make, batches, path=None, at: int = 0) -> list[torch.Tensor]:
    """``make(0)``'s model trained over ``batches``; with ``path``, saved there before batch
    ``at`` and trained on from ``make(5)``'s, loaded from it. Its parameters."""
    model, opt = make(0)
    for i, (x, y) in enumerate(batches):
        if path is not None and i == at:
            mp.save_checkpoint(path, model, opt)
            model, opt = make(5)
            mp.load_checkpoint(path, model, opt)
        opt.zero_grad()
        opt.backward(nn.functional.cross_entropy(model(x), y))
        opt.step()
    return list(model.parameters())


def test_a_parameter_with_gaps_is_stepped_unfused():
    """nn.Parameter(W[:, ::2]): its gradient is contiguous and the fused kernel walked the
    parameter as flat memory, updating the values between its elements (128 of 256) and
    the wrong elements (1.26 of the update off plain AdamW), unsaid."""
    torch.manual_seed(0)
    base = torch.randn(8, 16)
    plain_w = nn.Parameter(base.clone()[:, ::2])
    mixed_w = nn.Parameter(base.clone()[:, ::2])
    model = mp.auto_mixed_precision(nn.Module(), "mixed_bfloat16", "O1")
    model.w = mixed_w
    opt = mp.LossScaleOptimizer(torch.optim.AdamW([mixed_w], lr=1e-2))
    plain = torch.optim.AdamW([plain_w], lr=1e-2)
    x = torch.randn(4, 8)
    for _ in range(3):
        for w, step in ((plain_w, plain), (mixed_w, opt)):
            step.zero_grad()
            loss = (x @ w.T).square().mean()
            opt.backward(loss) if step is opt else loss.backward()
            step.step()
    torch.testing.assert_close(mixed_w, plain_w, rtol=0, atol=0)
    between = mixed_w.untyped_storage()  # the gaps' values: untouched
    gaps = torch.tensor([], dtype=torch.float32).set_(between)[1::2]
    assert torch.equal(gaps, base.flatten()[1::2])


class _Bag(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb, self.head = nn.Embedding(50, 16, sparse=True), nn.Linear(16, 4)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.emb(ids).mean(1))


def test_sparse_optimizer_state_is_saved_dense_and_resumes_as_without_the_break(tmp_path):
    """SGD's momentum over a sparse embedding is a sparse tensor: save_checkpoint raised
    torch's "unsupported memory format option Contiguous". It is stored dense: the same
    values, and the resumed run matches the uninterrupted one."""
    g = torch.Generator().manual_seed(2)
    batches = [(torch.randint(0, 50, (32, 4), generator=g), torch.randint(0, 4, (32,), generator=g))
               for _ in range(4)]  # fmt: skip

    def make(seed: int) -> tuple[nn.Module, mp.LossScaleOptimizer]:
        torch.manual_seed(seed)
        model = mp.auto_mixed_precision(_Bag(), "float32")
        return model, mp.LossScaleOptimizer(
            torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)
        )

    path = tmp_path / "s.safetensors"
    for a, b in zip(_run(make, batches), _run(make, batches, path, 2), strict=True):
        torch.testing.assert_close(b, a, rtol=1e-6, atol=1e-6)


def test_masters_of_a_model_made_channels_last_after_preparation_take_its_layout():
    """The float32 values kept at preparation are contiguous: masters built from them were
    too, under channels_last weights, and each step's gradient load and copy-back
    converted layouts (6% of a CNN's step). Values unchanged."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Conv2d(3, 8, 3), nn.ReLU(), nn.Conv2d(8, 8, 3))
    original = net[0].weight.detach().clone()
    model = mp.auto_mixed_precision(net, "mixed_bfloat16", "O2")
    model.to(memory_format=torch.channels_last)
    opt = mp.LossScaleOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-3))
    master = dict(opt.master_weights())[model[0].weight]
    assert master.stride() == model[0].weight.stride() != original.stride()
    assert torch.equal(master, original)
