"""What the optimizer tests share: an O2 MLP with its optimizer, a loss, a snapshot, a
deep comparison of states, the outermost aten ops a step runs, and a float16 weight about
to be pushed past its range."""

from __future__ import annotations

import copy
from collections import Counter

import torch
from torch import nn
from torch.profiler import ProfilerActivity, profile

import mixprec as mp
from tests.conftest import classification_data, make_mlp


def prepared(policy="mixed_bfloat16", level="O2", **opt_kwargs):
    model = mp.auto_mixed_precision(make_mlp(), policy, level)
    opt = mp.LossScaleOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-2), **opt_kwargs)
    return model, opt


def float16_bias_pushed_over(policy, level):
    """A Linear whose float16 bias (65000) one applied step pushes up to its limit, and a
    second backward whose step would push it past 65504: (model, opt), ready to step."""
    lin = nn.Linear(2, 1)
    lin.bias.data.fill_(65000.0)
    model = mp.auto_mixed_precision(nn.Sequential(lin), policy, level)
    opt = mp.LossScaleOptimizer(
        torch.optim.SGD(model.parameters(), lr=1.0), loss_scaler=mp.StaticLossScaler(1.0)
    )
    opt.zero_grad()
    opt.backward(-model(torch.zeros(4, 2)).float().mean() * 1000)
    assert opt.step().applied
    opt.zero_grad()
    opt.backward(model(torch.zeros(4, 2)).float().mean())
    return model, opt


def loss_of(model, scale=1.0):
    x, y = classification_data(n=32)
    return nn.functional.cross_entropy(model(x), y) * scale


def snapshot(model, opt):
    return (
        copy.deepcopy([p.detach() for p in model.parameters()]),
        copy.deepcopy(opt.state_dict()),
    )


def trained(opt_factory, steps=15):
    """An O2 MLP trained ``steps`` AdamW/SGD steps; its weights and the wrapper."""
    model = mp.auto_mixed_precision(make_mlp(), "mixed_bfloat16", "O2")
    opt = mp.LossScaleOptimizer(opt_factory(model.parameters()))
    for _ in range(steps):
        opt.zero_grad()
        opt.backward(loss_of(model))
        opt.step()
    return [m.detach().clone() for m in opt.master_params()], opt


def same_state(a, b) -> bool:
    """Nested dicts, lists and tensors equal, tensors bit for bit."""
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(same_state(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(same_state(x, y) for x, y in zip(a, b, strict=True))
    if torch.is_tensor(a):
        return torch.equal(a, b)
    return a == b


def aten_ops(step) -> Counter[str]:
    """The aten ops ``step()`` runs, outermost only: what a kernel calls inside itself is
    the kernel's business."""
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        step()
    return Counter(
        e.name
        for e in prof.events()
        if e.name.startswith("aten::")
        and (e.cpu_parent is None or not e.cpu_parent.name.startswith("aten::"))
    )


def step_ops_against_plain(opt, model, plain_opt, plain) -> tuple[Counter[str], Counter[str]]:
    """The outermost aten ops of ``opt.step`` and of the plain optimizer's step, on their
    third step (the first creates the optimizer state; the second is the one that looks
    for writes through ``.data``), each after its own backward."""
    for _ in range(3):
        plain_opt.zero_grad()
        loss_of(plain).backward()
        opt.zero_grad()
        opt.backward(loss_of(model))
        ours, theirs = aten_ops(opt.step), aten_ops(plain_opt.step)
    return ours, theirs
