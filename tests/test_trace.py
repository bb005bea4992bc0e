"""Overflow provenance: ``OverflowTracer`` names the first module whose output (forward) or
output gradient (backward) held inf/NaN, in execution order, with the count of non-finite
values and the range of the finite ones; a finite step, an evaluation pass and a removed
tracer report nothing. ``remember_model``/``model_of`` let parameters find their model."""

from __future__ import annotations

import gc
import math

import pytest
import torch
from torch import nn

from mixprec import trace
from mixprec.trace import Overflow, OverflowTracer, model_of, remember_model

# float16's largest finite value is 65504: 60000 * 0.5 fits, 60000 * 2 does not.
GAIN = 60000.0


class HalfGain(nn.Module):
    """Multiplies its input by ``GAIN`` in float16: values above ~1.09 overflow to inf."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (x.half() * GAIN).float()


class _InfGrad(torch.autograd.Function):
    """Identity forward; the backward multiplies the gradient by inf."""

    @staticmethod
    def forward(ctx: object, x: torch.Tensor) -> torch.Tensor:
        return x.clone()

    @staticmethod
    def backward(ctx: object, grad: torch.Tensor) -> torch.Tensor:
        return grad * math.inf


class InfGrad(nn.Module):
    """Finite forward; sends an infinite gradient to the module before it."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _InfGrad.apply(x)


def identity_linear(d: int) -> nn.Linear:
    layer = nn.Linear(d, d)
    with torch.no_grad():
        layer.weight.copy_(torch.eye(d))
        layer.bias.zero_()
    return layer


def test_forward_overflow_names_the_first_module_and_counts_its_values():
    model = nn.Sequential(identity_linear(4), HalfGain(), identity_linear(4))
    tracer = OverflowTracer(model)
    x = torch.tensor([[0.5, 2.0, -0.25, -3.0]], requires_grad=True)
    model(x).sum()
    found = tracer.first_overflow()
    # Module "2" and the model's own output are inf too; "1" came first.
    assert found == Overflow(
        module="1",
        kind="HalfGain",
        phase="forward",
        dtype="float32",
        nonfinite=2,
        finite_min=-15000.0,  # -0.25 * 60000
        finite_max=30000.0,  # 0.5 * 60000
    )
    assert str(found) == (
        "1 (HalfGain) forward: 2 non-finite values in float32; finite values in [-1.5e+04, 3e+04]"
    )


def test_the_dtype_reported_is_the_outputs():
    class HalfOut(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x.half() * GAIN

    model = nn.Sequential(identity_linear(2), HalfOut())
    tracer = OverflowTracer(model)
    model(torch.tensor([[2.0, 0.5]]))
    found = tracer.first_overflow()
    assert found is not None
    assert (found.module, found.dtype, found.nonfinite) == ("1", "float16", 1)
    assert found.finite_min == found.finite_max == 30000.0


def test_nan_counts_as_non_finite():
    class NaNs(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x * torch.tensor([1.0, math.nan, 1.0])

    model = nn.Sequential(identity_linear(3), NaNs())
    tracer = OverflowTracer(model)
    model(torch.ones(2, 3))
    found = tracer.first_overflow()
    assert found is not None
    assert (found.module, found.kind, found.phase, found.nonfinite) == ("1", "NaNs", "forward", 2)
    assert (found.finite_min, found.finite_max) == (1.0, 1.0)


def test_backward_overflow_names_the_module_whose_output_gradient_first_went_bad():
    # Gradients arrive from the output backwards: "4", "3" and "2" (InfGrad's output) get
    # finite gradients; InfGrad's backward makes the gradient of "1"'s output inf, then
    # "0"'s. The first in arrival order is "1", the module next to where it started.
    model = nn.Sequential(
        identity_linear(3), identity_linear(3), InfGrad(), identity_linear(3), identity_linear(3)
    )
    tracer = OverflowTracer(model)
    loss = model(torch.ones(2, 3, requires_grad=True)).sum()
    assert tracer.first_overflow() is None  # the forward was finite
    loss.backward()
    found = tracer.first_overflow()
    assert found is not None
    assert (found.module, found.kind, found.phase) == ("1", "Linear", "backward")
    assert (found.dtype, found.nonfinite) == ("float32", 6)


def test_an_overflow_only_in_a_weights_gradient_names_its_module():
    """One input feature of 6e4 (finite in float16) made the first Linear's weight gradient
    x^T @ grad inf in float16, while every output and output gradient stayed finite: the
    tracer named nothing, and the stuck-at-floor warning said to turn tracing on, which
    was on. The module holding the weight is named, phase "weight gradient"."""
    import mixprec as mp

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
    with torch.no_grad():
        model[0].weight[:, 0].mul_(1e-4)  # the forward stays finite
    model = mp.auto_mixed_precision(model, "mixed_float16", "O2")
    scaler = mp.DynamicLossScaler(init_scale=4.0)
    opt = mp.LossScaleOptimizer(torch.optim.SGD(model.parameters(), lr=0.0), scaler,
                                trace_overflow=True)  # fmt: skip
    x, y = torch.randn(8, 16), torch.arange(8) % 4
    x[:, 0] = 6e4
    out = model(x)
    opt.backward(nn.functional.cross_entropy(out, y) * 50)
    result = opt.step()
    assert torch.isfinite(out).all() and not result.applied
    found = result.overflow
    assert found is not None and (found.module, found.kind) == ("0", "Linear")
    assert (found.phase, found.dtype) == ("weight gradient", "float16") and found.nonfinite > 0


def test_a_forward_overflow_comes_before_the_backward_records():
    model = nn.Sequential(identity_linear(2), HalfGain(), InfGrad(), identity_linear(2))
    tracer = OverflowTracer(model)
    model(torch.tensor([[2.0, 0.5]])).sum().backward()
    found = tracer.first_overflow()
    assert found is not None
    assert (found.module, found.phase) == ("1", "forward")


def test_the_model_itself_is_named_when_it_has_no_children():
    class Blow(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.weight = nn.Parameter(torch.ones(2))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return (x * self.weight).half() * GAIN

    model = Blow()
    tracer = OverflowTracer(model)
    model(torch.tensor([4.0, 0.25]))
    found = tracer.first_overflow()
    assert found is not None
    assert (found.module, found.kind, found.phase) == ("(model)", "Blow", "forward")


def test_a_finite_step_reports_nothing():
    model = nn.Sequential(identity_linear(4), HalfGain(), identity_linear(4))
    tracer = OverflowTracer(model)
    assert tracer.first_overflow() is None  # nothing recorded yet
    x = torch.full((3, 4), 0.5, requires_grad=True)
    model(x).sum().backward()
    assert tracer.first_overflow() is None
    assert x.grad is not None and bool(x.grad.isfinite().all())


def test_clear_forgets_the_last_step():
    model = nn.Sequential(identity_linear(2), HalfGain())
    tracer = OverflowTracer(model)
    model(torch.tensor([[2.0, 0.5]]))
    assert tracer.first_overflow() is not None
    tracer.clear()
    assert tracer.first_overflow() is None
    model(torch.tensor([[0.5, 0.5]]))
    assert tracer.first_overflow() is None


def test_evaluation_under_no_grad_records_nothing():
    # No step follows an evaluation pass: its overflows are not a step's.
    model = nn.Sequential(identity_linear(2), HalfGain())
    tracer = OverflowTracer(model)
    with torch.no_grad():
        model(torch.tensor([[2.0, 0.5]]))
    assert tracer.first_overflow() is None


def test_remove_takes_the_hooks_off():
    model = nn.Sequential(identity_linear(2), HalfGain())
    tracer = OverflowTracer(model)
    tracer.remove()
    model(torch.tensor([[2.0, 0.5]]))
    assert tracer.first_overflow() is None
    tracer.remove()  # twice is harmless


def test_outputs_without_a_floating_tensor_are_skipped_and_containers_are_searched():
    class Pair(nn.Module):
        """Returns (indices, values): the first floating tensor is the one checked."""

        def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            return x.argmax(dim=-1), x.half() * GAIN

    class Indices(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return (x.half() * GAIN).isinf().long()  # integers: nothing to check

    class Named(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.pair = Pair()
            self.indices = Indices()

        def forward(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
            count = self.indices(x)
            _, values = self.pair(x)
            return {"count": count, "values": values}

    model = Named()
    tracer = OverflowTracer(model)
    model(torch.tensor([[2.0, 0.5]]))
    found = tracer.first_overflow()
    assert found is not None
    assert (found.module, found.kind) == ("pair", "Pair")
    assert (found.dtype, found.nonfinite) == ("float16", 1)


def test_empty_outputs_are_recorded_as_finite():
    class Empty(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x[:0]

    model = nn.Sequential(identity_linear(2), Empty())
    tracer = OverflowTracer(model)
    model(torch.ones(1, 2))
    assert tracer.first_overflow() is None


def test_hooks_are_off_under_compile_and_say_so_once(monkeypatch):
    # Dynamo cannot trace the hooks' side effects; under compile they record nothing and
    # warn once per process (the notice is cached: cleared here to see it).
    model = nn.Sequential(identity_linear(2), HalfGain())
    tracer = OverflowTracer(model)
    trace._warn_off_under_compile.cache_clear()
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    try:
        with pytest.warns(UserWarning, match=r"trace_overflow: .*torch.compile.*hooks are off"):
            model(torch.tensor([[2.0, 0.5]]))
    finally:
        trace._warn_off_under_compile.cache_clear()
    assert tracer.first_overflow() is None


def test_parameters_find_their_model_while_it_lives():
    model = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 1))
    remember_model(model)
    params = list(model.parameters())
    assert model_of(params) is model
    assert model_of([torch.ones(1), params[-1]]) is model  # the first that knows it
    assert model_of([torch.ones(1)]) is None
    assert model_of([]) is None
    del model
    gc.collect()
    assert model_of(params) is None  # a weak reference: the model was freed


def test_a_forward_no_backward_followed_is_dropped_at_the_next_forward():
    """An evaluation pass with gradients on, or an abandoned batch, is no step's: its
    records went on piling up until the next step() and were blamed for its overflow."""
    model = nn.Sequential(identity_linear(2), HalfGain(), identity_linear(2))
    tracer = OverflowTracer(model)
    model(torch.tensor([[2.0, 0.5]]))  # overflows in HalfGain; no backward follows
    for _ in range(50):
        model(torch.tensor([[0.5, 0.5]]))
    assert len(tracer._records) == 4  # the last forward alone: its three layers and the model
    x = torch.tensor([[0.5, 0.5]], requires_grad=True)
    model(x).sum().backward()
    assert tracer.first_overflow() is None  # the old overflow is not this step's


def test_records_of_an_accumulation_group_are_all_kept():
    model = nn.Sequential(identity_linear(2), HalfGain())
    tracer = OverflowTracer(model)
    model(torch.tensor([[2.0, 0.5]], requires_grad=True)).sum().backward()  # overflows
    model(torch.tensor([[0.5, 0.5]], requires_grad=True)).sum().backward()
    found = tracer.first_overflow()
    assert found is not None and found.module == "1" and found.phase == "forward"


def test_a_record_with_no_finite_value_says_so():
    found = Overflow("0", "Linear", "forward", "float16", 4, math.inf, -math.inf)
    big = torch.finfo(torch.float32).max
    from_sentinels = Overflow("0", "Linear", "forward", "float16", 4, big, -big)
    assert str(found).endswith("4 non-finite values in float16; no finite value")
    assert str(from_sentinels).endswith("; no finite value")
    assert str(Overflow("0", "Linear", "forward", "float16", 1, -2.0, 3.0)).endswith(
        "finite values in [-2, 3]"
    )


def test_a_model_called_twice_before_one_backward_keeps_both_forwards():
    """Siamese and contrastive steps: the first call's records must survive the second."""
    model = nn.Sequential(identity_linear(2), HalfGain(), identity_linear(2))
    tracer = OverflowTracer(model)
    a = model(torch.tensor([[2.0, 0.5]], requires_grad=True))  # overflows in HalfGain
    b = model(torch.tensor([[0.5, 0.5]], requires_grad=True))
    model(torch.tensor([[0.5, 0.5]]))  # a third forward, discarded: a and b still live
    (a - b).pow(2).sum().backward()
    found = tracer.first_overflow()
    assert found is not None and (found.module, found.phase) == ("1", "forward")


def test_a_dropped_optimizers_tracer_takes_its_hooks_with_it():
    """A cell that builds ``LossScaleOptimizer(..., trace_overflow=True)`` again: each
    dropped tracer kept its hooks on the model and recorded every later step into records
    no step cleared (+1.1 MB a step on a 12-layer transformer)."""
    import mixprec as mp

    model = mp.auto_mixed_precision(
        nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 2)), "mixed_float16", "O2"
    )
    hooks = lambda: sum(len(m._forward_hooks) + len(m._forward_pre_hooks)  # noqa: E731
                        for m in model.modules())  # fmt: skip
    before = hooks()
    opt = mp.LossScaleOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), trace_overflow=True)
    one_tracer = hooks() - before
    for _ in range(3):  # the cell run again
        opt = mp.LossScaleOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                    trace_overflow=True)  # fmt: skip
    gc.collect()
    assert hooks() - before == one_tracer == 5  # 4 modules' forward hooks, the root's pre-hook
    opt.backward(model(torch.full((2, 8), 1e4)).float().sum() * 1e4)
    assert opt.step().overflow is not None  # the live one still traces


def test_a_traced_model_pickles_and_its_copies_do_not_record_into_the_tracer():
    """The hooks were closures: torch.save(model) raised "Can't pickle local object"
    under trace_overflow (also from a callback at the step the Trainer traces itself), and
    a deep copy kept hooks recording into the original's tracer, which then blamed the
    copy's forward overflow on the original's layer."""
    import copy
    import io

    model = nn.Sequential(identity_linear(4), HalfGain(), identity_linear(4))
    tracer = OverflowTracer(model)
    buffer = io.BytesIO()
    torch.save(model, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)
    forked = copy.deepcopy(model)
    x = torch.full((1, 4), 2.0, requires_grad=True)  # overflows in HalfGain
    for other in (loaded, forked):
        other(x).sum().backward()
    assert tracer.first_overflow() is None  # the copies' passes are not the model's
    model(x).sum()
    assert tracer.first_overflow().module == "1"  # the model itself is still traced


def test_trace_overflow_true_traces_every_model_one_optimizer_steps():
    """mixprec's advice for two models in one loop is one LossScaleOptimizer over both;
    trace_overflow=True hooked the first model alone, and an overflow in the second
    skipped the step with overflow None, unsaid."""
    import mixprec as mp

    a = mp.auto_mixed_precision(nn.Sequential(nn.Linear(4, 4)), "mixed_float16", "O2")
    b = mp.auto_mixed_precision(
        nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 1)), "mixed_float16", "O2"
    )
    opt = mp.LossScaleOptimizer(
        [torch.optim.SGD(a.parameters(), lr=0.1), torch.optim.SGD(b.parameters(), lr=0.1)],
        trace_overflow=True,
    )
    with torch.no_grad():
        b[0].weight.fill_(2e4)  # 4 inputs of 1: 8e4, past float16's 65504
    x = torch.ones(2, 4)
    opt.backward(a(x).float().sum() + b(x).float().sum())
    result = opt.step()
    assert not result.applied
    assert result.overflow is not None and result.overflow.module == "0"
    assert result.overflow.phase == "forward" and result.overflow.kind == "Linear"


def test_a_backward_no_step_followed_is_not_blamed_for_the_next_steps_overflow():
    """User code raised between backward and step; the loop went on. The tracer kept the
    abandoned batch's records, and the next overflowing step named its module."""
    import mixprec as mp

    model = mp.auto_mixed_precision(
        nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 1)), "mixed_float16", "O2"
    )
    opt = mp.LossScaleOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), trace_overflow=True)
    with torch.no_grad():
        model[0].weight.fill_(1.0)
    opt.backward(model(torch.full((2, 4), 1e5)).float().sum())  # overflows in '0'; no step
    opt.zero_grad()
    with torch.no_grad():
        model[2].weight.fill_(3e4)  # '0' gives about 4 each: 4 * 4 * 3e4 overflows in '2'
    opt.backward(model(torch.ones(2, 4)).float().sum())  # finite until '2'
    found = opt.step().overflow
    assert found is not None and found.module == "2", found
