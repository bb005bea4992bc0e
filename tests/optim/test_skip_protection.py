"""What every step path guarantees: a non-finite gradient on any step reaches no weight, no
float32 master and no optimizer state, eagerly and under ``torch.compile(opt.step)``; and the
default bfloat16 step (O2, on CPU) runs plain training's kernels plus two copies and the
finiteness check, nothing else."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import mixprec as mp
from tests.conftest import make_mlp
from tests.optim._helpers import loss_of, same_state, step_ops_against_plain

_OPTIMIZERS = {
    "adamw-fused": lambda params: torch.optim.AdamW(params, lr=0.01, fused=True),
    "adam": lambda params: torch.optim.Adam(params, lr=0.01),
    "sgd-momentum": lambda params: torch.optim.SGD(params, lr=0.1, momentum=0.9),
}


def _snapshot(model: nn.Module, opt: mp.LossScaleOptimizer) -> tuple[list, list, dict]:
    weights = [p.detach().clone() for p in model.parameters()]
    masters = [m.detach().clone() for g in opt.param_groups for m in g["params"]]
    return weights, masters, copy.deepcopy([o.state_dict() for o in opt.optimizers])


@pytest.mark.parametrize("bad_step", [0, 2], ids=["first-step", "later-step"])
@pytest.mark.parametrize(
    ("policy", "level", "optimizer", "compiled"),
    [
        ("float32", "O0", "adamw-fused", False),
        ("mixed_bfloat16", "O1", "adamw-fused", False),
        ("mixed_bfloat16", "O2", "adamw-fused", False),  # the default on a fast-bf16 CPU
        ("mixed_bfloat16", "O2", "sgd-momentum", False),
        ("mixed_bfloat16", "O3", "sgd-momentum", False),
        ("mixed_float16", "O2", "adam", False),
        ("mixed_bfloat16", "O2", "adamw-fused", True),
        ("mixed_float16", "O2", "adam", True),
    ],
)
def test_a_non_finite_gradient_reaches_no_weight_and_no_optimizer_state(
    policy, level, optimizer, compiled, bad_step
):
    torch.manual_seed(0)
    model = mp.auto_mixed_precision(make_mlp(), policy, level)
    opt = mp.LossScaleOptimizer(_OPTIMIZERS[optimizer](model.parameters()))
    step = torch.compile(opt.step, backend="eager") if compiled else opt.step
    for i in range(4):
        opt.zero_grad()
        opt.backward(loss_of(model))
        if i == bad_step:
            grad = next(model.parameters()).grad
            assert grad is not None
            grad.view(-1)[3] = float("nan")
            before = _snapshot(model, opt)
        result = step()
        if i == bad_step:
            assert (result.applied, result.found_inf) == (False, True)
            after = _snapshot(model, opt)
            assert same_state(after[0], before[0]), "a 16-bit or float32 model weight changed"
            assert same_state(after[1], before[1]), "a float32 master changed"
            assert same_state(after[2], before[2]), "the optimizer state changed"
        else:
            assert result.applied
    assert opt.loss_scaler.state.skipped_steps == 1
    assert all(bool(p.isfinite().all()) for p in model.parameters())


def test_default_bfloat16_step_is_plain_training_plus_two_copies_and_the_check():
    # Issue 30: the O2 bfloat16 step on CPU makes one pass more than float32 training's
    # AdamW (the read-only check, one sum and one read per gradient), and the two copies
    # between the 16-bit weights and their masters that O2 exists for. No flag tensors,
    # concatenations, collectives or host reads beyond the sums'.
    torch.manual_seed(0)
    plain = make_mlp()
    model = mp.auto_mixed_precision(copy.deepcopy(plain), "mixed_bfloat16", "O2")
    theirs_opt = torch.optim.AdamW(plain.parameters(), lr=0.01, fused=True)
    opt = mp.LossScaleOptimizer(torch.optim.AdamW(model.parameters(), lr=0.01, fused=True))
    ours, theirs = step_ops_against_plain(opt, model, theirs_opt, plain)
    grads = len(list(model.parameters()))
    extra = ours - theirs
    assert not theirs - ours
    assert set(extra) <= {"aten::_foreach_copy_", "aten::empty_like", "aten::sum", "aten::item",
                          "aten::_local_scalar_dense"}  # fmt: skip
    assert extra["aten::_foreach_copy_"] == 2  # gradients in, weights out: one kernel each
    assert extra["aten::sum"] == grads and extra["aten::item"] == grads
