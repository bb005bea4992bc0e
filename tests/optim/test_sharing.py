"""Two live LossScaleOptimizers over the same weights or the same dynamic scaler
(``mixprec.optim.sharing``): refused at the step that would go wrong, before its unscale;
a wrapper that is no longer stepped, and sequential steps over shared float32 weights, are
left alone."""

from __future__ import annotations

import copy
import pickle

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import mixprec as mp


def _trunk_and_heads(policy: str | None, level: str) -> tuple[nn.Module, ...]:
    """A trunk and two heads, prepared (``policy`` None: float32, as they are)."""
    torch.manual_seed(0)
    models = (nn.Sequential(nn.Linear(8, 16), nn.LayerNorm(16), nn.ReLU()), nn.Linear(16, 4),
              nn.Linear(16, 1))  # fmt: skip
    if policy is None:
        return models
    return tuple(mp.auto_mixed_precision(m, policy, level) for m in models)


def _batch(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(16, 8, generator=g), torch.randint(0, 4, (16,), generator=g)


def test_both_backwards_before_both_steps_over_a_shared_trunk_is_refused():
    """The torch.amp order with a wrapper per loss: the second step divided the shared
    gradients again (a float32 LayerNorm moved half as far as in float32)."""
    trunk, actor, critic = _trunk_and_heads("mixed_float16", "O1")
    a = mp.LossScaleOptimizer(torch.optim.SGD([*trunk.parameters(), *actor.parameters()], 0.1))
    c = mp.LossScaleOptimizer(torch.optim.SGD([*trunk.parameters(), *critic.parameters()], 0.1))
    x, y = _batch(1)
    a.backward(F.cross_entropy(actor(trunk(x)), y))
    c.backward(critic(trunk(x)).pow(2).mean())
    with pytest.raises(mp.MisuseError, match=r"stepped by this LossScaleOptimizer and by "
                       r"another live one: the other's backward is pending .* opt.backward\("
                       r"loss_a \+ loss_b\)"):  # fmt: skip
        a.step()


def test_a_shared_16_bit_weight_is_refused_even_stepped_in_turn():
    """Each wrapper kept its own master of the shared bfloat16 weight, and one's updates
    were lost to the other's rounding (the weight moved by one optimizer's updates alone)."""
    trunk, actor, critic = _trunk_and_heads("mixed_bfloat16", "O2")
    a = mp.LossScaleOptimizer(torch.optim.SGD([*trunk.parameters(), *actor.parameters()], 0.1))
    c = mp.LossScaleOptimizer(torch.optim.SGD([*trunk.parameters(), *critic.parameters()], 0.1))
    x, y = _batch(1)
    a.backward(F.cross_entropy(actor(trunk(x)), y))
    assert a.step().applied
    c.zero_grad()
    c.backward(critic(trunk(x)).pow(2).mean())
    with pytest.raises(mp.MisuseError, match=r"each keeps its own float32 master"):
        c.step()


def test_shared_float32_weights_stepped_in_turn_train_as_in_float32():
    """Backward and step of one wrapper, then of the other: each unscales gradients only
    it produced, as two torch optimizers over one float32 parameter do."""

    def run(mixed: bool) -> list[torch.Tensor]:
        trunk, actor, critic = _trunk_and_heads("mixed_bfloat16" if mixed else None, "O1")
        wrap = mp.LossScaleOptimizer if mixed else (lambda o: o)
        a = wrap(torch.optim.SGD([*trunk.parameters(), *actor.parameters()], 0.1))
        c = wrap(torch.optim.SGD([*trunk.parameters(), *critic.parameters()], 0.05))
        for seed in range(4):
            x, y = _batch(seed)
            losses = (
                (a, lambda x=x, y=y: F.cross_entropy(actor(trunk(x)), y)),
                (c, lambda x=x: critic(trunk(x)).pow(2).mean()),
            )
            for opt, loss in losses:
                opt.zero_grad()
                if mixed:
                    opt.backward(loss())
                else:
                    loss().backward()
                opt.step()
        return [p.detach().clone() for p in trunk.parameters()]

    for got, want in zip(run(True), run(False), strict=True):
        assert torch.allclose(got, want, atol=2e-2), (got - want).abs().max()


def _gan(scaler_g, scaler_d, turns: bool) -> list[torch.Tensor]:
    """Two wrappers over disjoint models, D's first batch past float16 (its step skipped,
    the scale halved); in turns (backward and step of one, then of the other), or with
    both backwards before both steps (torch.amp's order)."""
    g, d = _trunk_and_heads("mixed_float16", "O2")[1:]
    opt_g = mp.LossScaleOptimizer(torch.optim.SGD(g.parameters(), 0.1), loss_scaler=scaler_g)
    opt_d = mp.LossScaleOptimizer(torch.optim.SGD(d.parameters(), 0.1), loss_scaler=scaler_d)
    for i in range(3):
        h = torch.randn(4, 16, generator=torch.Generator().manual_seed(i))
        gain = 1e9 if i == 0 else 1.0
        if turns:
            opt_d.zero_grad()
            opt_d.backward(d(h).sum() * gain)
            opt_d.step()
            opt_g.zero_grad()
            opt_g.backward(g(h).sum())
            opt_g.step()
        else:
            opt_d.zero_grad()
            opt_g.zero_grad()
            opt_d.backward(d(h).sum() * gain)
            opt_g.backward(g(h).sum())
            opt_d.step()
            opt_g.step()
    return [p.detach().clone() for p in (*g.parameters(), *d.parameters())]


def test_one_dynamic_scaler_in_two_wrappers_in_turns_trains_as_two_scalers():
    """A GAN's loop in turns with torch.amp's one scaler: D's overflow halves the scale
    before G's backward, so G's step unscales by G's own scale. Not refused, and the
    weights equal those of two scalers of their own."""
    shared = mp.DynamicLossScaler(init_scale=1024.0)
    apart = [mp.DynamicLossScaler(init_scale=1024.0) for _ in range(2)]
    for a, b in zip(_gan(shared, shared, True), _gan(*apart, True), strict=True):
        assert torch.equal(a, b)


def test_one_dynamic_scaler_moved_between_a_backward_and_its_step_is_refused():
    """Both backwards, then D's step halves the shared scale: G's step would unscale its
    gradients (scaled by 1024) by 512, an update 2x too large. A static scaler is fine."""
    shared = mp.DynamicLossScaler(init_scale=1024.0)
    with pytest.raises(mp.MisuseError, match=r"the other moved the shared scale since this "
                       r"one's backward"):  # fmt: skip
        _gan(shared, shared, False)
    static = mp.StaticLossScaler(128.0)
    assert len(_gan(static, static, False)) == 4


def test_a_wrapper_no_longer_stepped_is_no_partner_and_copies_share_nothing():
    """A second phase's wrapper over the same weights, the first still referenced (a
    notebook, a scheduler), steps freely; so do pickled and deep-copied wrappers."""
    trunk = _trunk_and_heads("mixed_bfloat16", "O2")[0]
    first = mp.LossScaleOptimizer(torch.optim.SGD(trunk.parameters(), 0.1))
    x = torch.randn(4, 8)
    first.backward(trunk(x).sum())
    first.step()
    second = mp.LossScaleOptimizer(torch.optim.AdamW(trunk.parameters(), 1e-3))
    for _ in range(3):
        second.zero_grad()
        second.backward(trunk(x).sum())
        assert second.step().applied
    assert second._book.share.partners
    assert not pickle.loads(pickle.dumps(second))._book.share.partners
    assert not copy.deepcopy(second)._book.share.partners


def test_a_wrapper_left_mid_group_is_no_partner():
    """A first phase that ended between micro-batches leaves its backward pending for good:
    the next phase's wrapper over the same weights was refused at its first step."""
    trunk = _trunk_and_heads("mixed_float16", "O1")[0]
    first = mp.LossScaleOptimizer(torch.optim.SGD(trunk.parameters(), 0.1), accumulation_steps=4)
    x = torch.randn(4, 8)
    for _ in range(2):  # the loop that steps every 4th batch, stopped after 2
        first.backward(trunk(x).sum())
    second = mp.LossScaleOptimizer(torch.optim.SGD(trunk.parameters(), 0.1))
    second.zero_grad()
    second.backward(trunk(x).sum())
    second.step()  # not refused
    assert first._book.fresh  # the first still holds its pending group


def test_the_keras_api_and_a_third_wrapper_are_looked_at_too():
    """apply_gradients skipped the look; and only the latest wrapper per weight was known,
    so a first and a third stepping in turn went unsaid."""
    trunk = _trunk_and_heads("mixed_bfloat16", "O2")[0]
    params = list(trunk.parameters())
    a, _b, c = (mp.LossScaleOptimizer(torch.optim.SGD(params, 0.1)) for _ in range(3))
    x = torch.randn(4, 8)
    grads = torch.autograd.grad(a.get_scaled_loss(trunk(x).sum()), params)
    a.apply_gradients(zip(a.get_unscaled_gradients(grads), params, strict=True))
    grads = torch.autograd.grad(c.get_scaled_loss(trunk(x).sum()), params)
    with pytest.raises(mp.MisuseError, match=r"each keeps its own float32 master"):
        c.apply_gradients(zip(c.get_unscaled_gradients(grads), params, strict=True))


def test_a_shared_scale_moved_within_an_accumulation_group_or_before_an_unscale_is_refused():
    """Only the last backward's scale was compared: D's overflow between G's two
    micro-batches halved the scale, and G's update was 1.7x too large, unsaid; the Keras
    flow (scale_loss, get_unscaled_gradients) recorded no scale at all (2x too large)."""
    shared = mp.DynamicLossScaler(init_scale=1024.0)
    g, d = _trunk_and_heads("mixed_float16", "O2")[1:]
    opt_g = mp.LossScaleOptimizer(torch.optim.SGD(g.parameters(), 0.1), loss_scaler=shared,
                                  accumulation_steps=2)  # fmt: skip
    opt_d = mp.LossScaleOptimizer(torch.optim.SGD(d.parameters(), 0.1), loss_scaler=shared)
    h = torch.randn(4, 16)
    opt_g.backward(g(h).sum())
    assert opt_g.step().accumulating
    opt_d.backward(d(h).sum() * 1e9)
    assert not opt_d.step().applied  # the shared scale halves
    opt_g.backward(g(h).sum())
    with pytest.raises(mp.MisuseError, match=r"moved the shared scale"):
        opt_g.step()
    shared = mp.DynamicLossScaler(init_scale=1024.0)
    keras_g = mp.LossScaleOptimizer(torch.optim.SGD(g.parameters(), 0.1), loss_scaler=shared)
    keras_d = mp.LossScaleOptimizer(torch.optim.SGD(d.parameters(), 0.1), loss_scaler=shared)
    params = list(g.parameters())
    grads = torch.autograd.grad(keras_g.scale_loss(g(h).sum()), params)
    keras_d.backward(d(h).sum() * 1e9)
    assert not keras_d.step().applied
    with pytest.raises(mp.MisuseError, match=r"moved the shared scale"):
        keras_g.get_unscaled_gradients(grads)


def test_a_wrapper_collected_while_a_new_one_looks_for_partners_is_passed_over():
    """Any allocation may run the garbage collector: a dropped wrapper's cycle collected
    between the look for live wrappers and their use raised AttributeError ('NoneType' has
    no attribute 'share') from the new wrapper's constructor (seen once in a full run).
    Simulated: each weak reference dies after its first call."""
    from mixprec.optim import sharing

    class DiesAfterFirstCall:
        def __init__(self, ref):
            self.ref, self.calls = ref, 0

        def __call__(self):
            self.calls += 1
            return self.ref() if self.calls == 1 else None

    model = mp.auto_mixed_precision(nn.Linear(4, 4), "mixed_bfloat16", "O2")
    first = mp.LossScaleOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    for thing, refs in list(sharing._OWNERS.items()):
        sharing._OWNERS[thing] = [DiesAfterFirstCall(r) for r in refs]
    second = mp.LossScaleOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    assert first._book.share.partners and second._book.share.partners  # noted both ways
