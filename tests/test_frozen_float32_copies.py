"""The first step's word on the float32 values kept on frozen 16-bit weights
(``_float32_copies.say_if_frozen_copies``): true whether the weights stay frozen or are
unfrozen later (gradual unfreezing), where those values are what the masters start from."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

import mixprec as mp

SAID = (
    "16 16-bit weights no LossScaleOptimizer holds (frozen: a backbone, an adapter's base) "
    "keep their float32 values beside them, 2.0 MiB more: a save writes them exactly, and a "
    "weight unfrozen later (add_param_group) starts its master from them. If these weights "
    "stay frozen, they take 1.5 times their float32 memory for good: "
    "mp.release_float32_copies(model) frees them (a save then writes their 16-bit values, "
    "and a weight unfrozen later starts its master from its 16-bit rounding)"
)


def _frozen_backbone() -> tuple[nn.Module, nn.Module, list[torch.Tensor]]:
    """An O2 bfloat16 model whose 8-layer backbone is frozen, and its float32 weights."""
    torch.manual_seed(0)
    backbone = nn.Sequential(*[nn.Linear(256, 256) for _ in range(8)]).requires_grad_(False)
    float32 = [p.detach().clone() for p in backbone.parameters()]
    model = mp.auto_mixed_precision(nn.Sequential(backbone, nn.Linear(256, 10)),
                                    "mixed_bfloat16", "O2")  # fmt: skip
    return model, backbone, float32


def _steps(model: nn.Module, opt: mp.LossScaleOptimizer, n: int) -> None:
    x, y = torch.randn(4, 256), torch.randint(0, 10, (4,))
    for _ in range(n):
        opt.zero_grad()
        opt.backward(nn.functional.cross_entropy(model(x), y))
        opt.step()


def _unfreeze(backbone: nn.Module, opt: mp.LossScaleOptimizer) -> list[torch.Tensor]:
    """Gradual unfreezing: the backbone joins the optimizer; its masters' first values."""
    backbone.requires_grad_(True)
    opt.add_param_group({"params": list(backbone.parameters()), "lr": 1e-4})
    masters = {id(half): master.detach().clone() for half, master in opt.master_weights()}
    return [masters[id(p)] for p in backbone.parameters()]


def test_frozen_weights_are_said_once_in_words_true_when_they_are_unfrozen_later():
    # Review: the word advised release_float32_copies alone; under gradual unfreezing
    # those values are what the masters must start from.
    model, backbone, float32 = _frozen_backbone()
    opt = mp.LossScaleOptimizer(torch.optim.AdamW(model[1].parameters(), 1e-3))
    with pytest.warns(UserWarning, match="no LossScaleOptimizer holds") as caught:
        _steps(model, opt, 3)
    said = [str(w.message) for w in caught if "no LossScaleOptimizer holds" in str(w.message)]
    assert said == [SAID]
    masters = _unfreeze(backbone, opt)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _steps(model, opt, 1)  # said once a model
    # Kept, the masters start from the float32 values.
    assert all(torch.equal(m, f) for m, f in zip(masters, float32, strict=True))

    # Released, as the word says: a weight unfrozen later starts from its 16-bit rounding.
    model, backbone, float32 = _frozen_backbone()
    assert mp.release_float32_copies(backbone) == 8 * (256 * 256 + 256) * 4
    opt = mp.LossScaleOptimizer(torch.optim.AdamW(model[1].parameters(), 1e-3))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # nothing kept: nothing said
        _steps(model, opt, 1)
    masters = _unfreeze(backbone, opt)
    rounded = [f.to(torch.bfloat16).float() for f in float32]
    assert all(torch.equal(m, r) for m, r in zip(masters, rounded, strict=True))
    assert not all(torch.equal(r, f) for r, f in zip(rounded, float32, strict=True))
