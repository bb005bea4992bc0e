"""The doctor measures with backward passes of its own: under the caller's no_grad they
still run, under inference_mode it says why it cannot, and the caller's input tensors get
no gradient and no hook from it."""

from __future__ import annotations

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
