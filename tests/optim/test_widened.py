"""An O2 model widened to float32 (``model.float()``, ``mp.to_float``) while its
optimizer's float32 masters live: the widened weights hold the 16-bit roundings, and
what comes next (a new optimizer for a float32 phase, a float32 evaluation, a save)
started from them, the masters' digits lost unsaid (4.8e-4 off after 5 SGD steps)."""

from __future__ import annotations

import torch
from torch import nn

import mixprec as mp


def _trained() -> tuple[nn.Module, mp.LossScaleOptimizer, list[torch.Tensor]]:
    torch.manual_seed(0)
    model = mp.auto_mixed_precision(
        nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4)), "mixed_bfloat16", "O2"
    )
    opt = mp.LossScaleOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    for _ in range(5):
        opt.zero_grad()
        opt.backward(model(torch.randn(8, 16)).float().square().mean())
        opt.step()
    masters = [m.detach().clone() for _, m in opt.master_weights()]
    assert any(not torch.equal(m.bfloat16().float(), m) for m in masters)  # digits to lose
    return model, opt, masters


def _weights(model: nn.Module) -> list[torch.Tensor]:
    return [p.detach().clone() for p in model.parameters()]


def _same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


def test_to_float_gives_back_the_live_masters_values():
    model, _opt, masters = _trained()
    mp.to_float(model, torch.float32)
    assert all(p.dtype == torch.float32 for p in model.parameters())
    assert _same(_weights(model), masters)


def test_to_float_after_the_optimizer_is_gone_says_the_masters_digits_are_lost():
    """Trained inside a function, its optimizer gone: to_float widened the roundings, and
    the model then evaluated and saved as float32 without the masters' digits, unsaid."""
    import gc

    import pytest

    model, opt, masters = _trained()
    del opt
    gc.collect()
    with pytest.warns(UserWarning, match=r"storing the model in float32 \(mp.to_float\) "
                      r"widens the 16-bit roundings of 4 weight\(s\) whose float32 "
                      r"masters were in a LossScaleOptimizer that is gone") as said:  # fmt: skip
        mp.to_float(model, torch.float32)
    assert [w.filename for w in said if "is gone" in str(w.message)] == [__file__]
    assert not _same(_weights(model), masters)  # the roundings: what the warning says


def test_a_new_wrapper_over_a_widened_model_starts_from_the_masters():
    model, _old, masters = _trained()
    model.float()
    new = mp.LossScaleOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    assert _same(_weights(model), masters)
    new.backward(model(torch.randn(8, 16)).square().mean())
    grads = [p.grad.clone() for p in model.parameters()]
    new.step()  # float32 weights, plain SGD inside: the update lands on the masters
    stepped = [m.add(g, alpha=-0.1) for m, g in zip(masters, grads, strict=True)]
    assert _same(_weights(model), stepped)


def test_a_plain_optimizers_first_step_over_a_widened_model_starts_from_the_masters():
    model, _old, masters = _trained()
    model.float()
    plain = torch.optim.SGD(model.parameters(), lr=0.0)  # lr 0: the step only starts it
    model(torch.randn(8, 16)).square().mean().backward()
    plain.step()
    assert _same(_weights(model), masters)


def test_a_weights_only_save_of_a_widened_model_holds_the_masters(tmp_path):
    model, _opt, masters = _trained()
    model.float()
    mp.save_checkpoint(tmp_path / "w", model)
    fresh = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
    mp.load_checkpoint(tmp_path / "w", fresh)
    assert _same(_weights(fresh), masters)


def test_a_widened_weight_written_since_keeps_the_write():
    """A write after the widening (weights loaded) wins over the masters, as it does for a
    16-bit weight."""
    model, _old, masters = _trained()
    model.float()
    with torch.no_grad():
        model[0].weight.add_(1.0)
    written = _weights(model)
    mp.LossScaleOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    assert torch.equal(model[0].weight, written[0])
    assert _same(_weights(model)[1:], masters[1:])


def test_a_load_before_a_dropped_optimizer_is_collected_is_the_weights_own():
    """The optimizer dropped but kept in a reference cycle until the collector runs: a
    load in between made the weights the load's, yet the master that died after it was
    taken for one whose roundings were left, and to_float said digits were lost."""
    import gc
    import warnings

    other = mp.auto_mixed_precision(
        nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4)), "mixed_bfloat16", "O2"
    )
    gc.disable()
    try:
        model, opt, _ = _trained()
        opt.__dict__["_cycle"] = opt  # kept alive by a cycle alone once dropped
        del opt
        model.load_state_dict(other.state_dict())
    finally:
        gc.enable()
    gc.collect()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        mp.to_float(model, torch.float32)
    assert _same(_weights(model), [p.float() for p in other.parameters()])
