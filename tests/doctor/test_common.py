"""What both doctors share (``mixprec.doctor._common``): the relative error they compare runs
by, including a reference that is exactly zero, the recorder of each module's first call,
JSON without inf/NaN, and the refusal of a batch that is non-finite itself."""

from __future__ import annotations

import json
import math
import re

import pytest
import torch
from torch import nn

from mixprec.doctor._common import Recorder, check_finite_batch, relative_error, to_json


def test_relative_error_is_the_norm_of_the_difference_over_the_references():
    reference = torch.tensor([3.0, 4.0])  # norm 5
    assert relative_error(reference.clone(), reference) == 0.0
    assert relative_error(torch.tensor([3.0, 5.0]), reference) == pytest.approx(1 / 5, rel=1e-6)
    # Relative to the reference, not symmetric: the same difference over norm 1 instead.
    assert relative_error(reference, torch.tensor([0.0, 1.0])) == pytest.approx(
        math.sqrt(9 + 9) / 1, rel=1e-6
    )


def test_relative_error_against_an_all_zero_reference():
    zero = torch.zeros(4)
    # Both zero: the runs agree exactly.
    assert relative_error(torch.zeros(4), zero) == 0.0
    assert relative_error(-torch.zeros(4), zero) == 0.0  # -0.0 equals 0.0
    # A non-zero value against a zero reference: the ratio grows without bound as the
    # reference shrinks, so inf, however small the value (not 0, which hid it).
    assert relative_error(torch.tensor([0.0, 1e-30, 0.0, 0.0]), zero) == math.inf
    assert relative_error(torch.ones(4), zero) == math.inf


def test_relative_error_of_tiny_and_huge_tensors():
    # Their squares underflow (1e-30) or overflow (3e38) float32; the error does not care.
    tiny = torch.tensor([1e-30, 0.0])
    assert relative_error(tiny * 2, tiny) == pytest.approx(1.0, rel=1e-6)
    assert relative_error(tiny, torch.zeros(2)) == math.inf
    huge = torch.tensor([3e38, 2e38])
    assert relative_error(torch.tensor([3e38, 3e38]), huge) == pytest.approx(
        1 / math.sqrt(13), rel=1e-6
    )
    # Far apart but finite: a difference float32 could not hold is not an overflow.
    assert relative_error(-huge, huge) == pytest.approx(2.0, rel=1e-6)


@pytest.mark.parametrize("bad", [math.inf, -math.inf, math.nan])
def test_relative_error_of_a_nonfinite_value_is_inf(bad):
    reference = torch.ones(3)
    assert relative_error(torch.tensor([1.0, bad, 1.0]), reference) == math.inf
    # inf/NaN in the reference too: the runs are not comparable either way.
    assert relative_error(reference, torch.tensor([1.0, bad, 1.0])) == math.inf


def test_relative_error_reads_16_bit_and_float8_values_exactly():
    reference = torch.linspace(-2.0, 2.0, 101)
    for dtype in (torch.float16, torch.bfloat16, torch.float8_e4m3fn):
        value = reference.to(dtype)
        expected = float((value.float() - reference).norm() / reference.norm())
        assert relative_error(value, reference) == pytest.approx(expected, rel=1e-6)
        assert 0 < relative_error(value, reference) < 0.1
    # float16 values past float16's range are inf there: that is an overflow, not an error.
    assert relative_error(torch.tensor([7e4]).half(), torch.tensor([7e4])) == math.inf


def test_relative_error_takes_tensors_that_require_grad_and_returns_a_float():
    value = torch.tensor([1.0, 2.0], requires_grad=True)
    error = relative_error(value * 2, torch.tensor([2.0, 4.5]))
    assert type(error) is float and error == pytest.approx(0.5 / math.sqrt(4 + 4.5**2))


class Twice(nn.Module):
    """Calls ``inner`` twice; the recorder keeps the first call."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(10, 4)
        self.inner = nn.Linear(4, 4)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.inner(self.inner(self.embed(tokens)))


def test_recorder_keeps_each_modules_first_call_and_its_gradients():
    torch.manual_seed(0)
    model = Twice()
    tokens = torch.tensor([[1, 2, 3]])
    modules = {name or "(model)": m for name, m in model.named_modules()}
    with Recorder(modules) as recorder:
        out = model(tokens)
        assert all(entry["grad"] is None for entry in recorder.calls.values())
        out.sum().backward()
    assert sum(len(m._forward_hooks) for m in model.modules()) == 0  # removed on exit
    calls = recorder.calls
    # Execution order: a module's hook runs when its forward returns.
    assert list(calls) == ["embed", "inner", "(model)"]
    assert [calls[n]["order"] for n in calls] == [0, 1, 2]
    assert calls["inner"]["kind"] == "Linear" and calls["inner"]["module"] is model.inner
    embed = calls["embed"]
    # Integer token ids are not floating point: no input is recorded.
    assert embed["input"] is None and not embed["input_needs_grad"]
    inner = calls["inner"]
    first = model.embed(tokens)
    assert torch.equal(inner["input"], first) and inner["input_needs_grad"]
    assert torch.equal(inner["output"], model.inner(first))  # the first call, not the second
    assert not inner["output"].requires_grad  # detached
    # The gradient of the first call's output: back through the second call, d(sum)/d(out).
    expected = torch.ones(1, 3, 4) @ model.inner.weight
    assert torch.allclose(inner["grad"], expected)
    assert torch.allclose(inner["input_grad"], expected @ model.inner.weight)
    assert torch.equal(calls["(model)"]["grad"], torch.ones(1, 3, 4))


def test_recorder_removes_its_hooks_when_the_pass_raises():
    model = nn.Linear(4, 4)
    with pytest.raises(RuntimeError), Recorder({"fc": model}):
        model(torch.ones(2, 5))  # wrong width
    assert not model._forward_hooks


def test_to_json_writes_inf_and_nan_as_strings():
    data = {"error": math.inf, "nested": [{"x": -math.inf}, (math.nan, 1.5)], "ok": 2}
    assert json.loads(to_json(data)) == {
        "error": "inf",
        "nested": [{"x": "-inf"}, ["nan", 1.5]],
        "ok": 2,
    }
    assert to_json({"a": 1}, indent=2) == '{\n  "a": 1\n}'


def test_a_non_finite_batch_is_refused_naming_where():
    fine = torch.ones(2, 3)
    check_finite_batch(fine, torch.tensor([0, 1]), "diagnose")  # integer targets: fine
    check_finite_batch((fine, "a note", None), {"y": fine}, "diagnose")
    bad = fine.clone()
    bad[0, 0], bad[1, 2] = math.inf, -math.nan
    for inputs, targets, where in (
        (bad, fine, "inputs"),
        ((fine, bad), fine, "inputs[1]"),
        ({"ids": torch.tensor([1]), "mask": bad}, fine, "inputs['mask']"),
        (fine, [fine, {"aux": bad}], "targets[1]['aux']"),
    ):
        with pytest.raises(ValueError, match=(
            rf"^diagnose: the batch itself is non-finite: {re.escape(where)} holds 2 inf/NaN "
            r"values \(of 6\); the float32 run would be non-finite too, so no precision fixes "
            r"it: clean or mask the data$"
        )):  # fmt: skip
            check_finite_batch(inputs, targets, "diagnose")
