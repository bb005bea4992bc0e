"""``mp.autotune``: candidates left out with reasons, the search, the budget, the training
check. Times come from an injected timer (``CostTimer``), so the search is deterministic;
errors and ranges are measured for real."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import mixprec as mp
from mixprec._errors import ArgumentError
from mixprec.autotune import check as check_module
from mixprec.float8 import cpu_kernel_error
from mixprec.levels import applied

F = nn.functional


class CostTimer:
    """Seconds from a table: per layer and dtype (``layer``), and a whole step as the sum of
    its layers' costs (``step``). Each still calls ``run`` once: the numerics are real."""

    def __init__(
        self, costs: dict[str, float], per_layer: dict[tuple[str, str], float] | None = None
    ):
        self.costs, self.per_layer = costs, per_layer or {}
        self.steps: list[dict[str, str]] = []

    def cost(self, name: str, dtype: str) -> float:
        return self.per_layer.get((name, dtype), self.costs[dtype])

    def layer(self, name, dtype, run):
        run()
        return self.cost(name, dtype)

    def step(self, dtypes, level, run):
        run()
        self.steps.append(dict(dtypes))
        return sum(self.cost(n, d) for n, d in dtypes.items()) + (level == "O1") * 0.1


def mlp(seed: int = 0, width: int = 32) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(16, width), nn.ReLU(), nn.Linear(width, width), nn.ReLU(),
                         nn.Linear(width, 4))  # fmt: skip


def batch(n: int = 32):
    g = torch.Generator().manual_seed(1)
    return torch.randn(n, 16, generator=g), torch.randint(0, 4, (n,), generator=g)


def tune(model, **kwargs):
    kwargs.setdefault("check_steps", 5)
    return mp.autotune(model, batch(), F.cross_entropy, **kwargs)


def test_fastest_candidate_within_budget_everywhere_and_model_untouched():
    model = mlp()
    before = copy.deepcopy(model.state_dict())
    timer = CostTimer({"float32": 1.0, "bfloat16": 0.5, "float16": 0.6})
    plan = tune(model, candidates=("float32", "bfloat16", "float16"), timer=timer)
    assert plan.dtypes == {"0": "bfloat16", "2": "bfloat16", "4": "bfloat16"}
    assert plan.level == "O2" and plan.check.passed and plan.check.steps == 5
    assert plan.step_times["float32"] == 3.0 and plan.step_times["bfloat16 O1"] == pytest.approx(
        1.6
    )
    row = plan.layers[0]
    assert set(row.times) == {"float32", "bfloat16", "float16"}
    assert 0 < row.errors["float16"] < row.errors["bfloat16"] < 0.01  # 11 vs 8 mantissa bits
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in before.items())
    assert mp.levels.applied(model) is None


def test_layer_near_float16_range_gets_float32():
    model = mlp()
    with torch.no_grad():
        model[2].weight.mul_(1e4)  # its outputs reach ~1e4, > 2**-4 of float16's 65504
        model[4].weight.mul_(1e-4)  # and the logits stay as they were
    timer = CostTimer({"float32": 1.0, "float16": 0.5})
    sgd = lambda params: torch.optim.SGD(params, lr=0.0)  # noqa: E731 (range, not training)
    plan = tune(model, candidates=("float32", "float16"), timer=timer, optimizer=sgd)
    assert plan.dtypes["0"] == "float16"
    assert plan.dtypes["2"] == "float32" and "float16 range" in plan.layers[1].why
    assert plan.layers[1].headroom > 2**-4


def test_tiny_layer_is_measured_not_assumed():
    # The timer says bfloat16 costs more than float32 on layer 4 alone (casts on a tiny
    # layer): the search flips it back to float32 because the whole step gets faster.
    timer = CostTimer({"float32": 1.0, "bfloat16": 0.5}, {("4", "bfloat16"): 1.5})
    plan = tune(mlp(), candidates=("float32", "bfloat16"), timer=timer)
    assert plan.dtypes == {"0": "bfloat16", "2": "bfloat16", "4": "float32"}
    assert plan.layers[2].times == {"float32": 1.0, "bfloat16": 1.5}
    assert plan.layers[2].why == "float32: step 20% faster than with bfloat16 (measured)"
    assert plan.step_times["plan"] == 2.0


def test_budget_zero_gives_the_float32_plan():
    plan = tune(mlp(), error_budget=0, timer=CostTimer({"float32": 1.0}))
    assert set(plan.dtypes.values()) == {"float32"}
    assert {row.why for row in plan.layers} == {"error budget 0: float32 only"}


def test_error_over_budget_goes_to_float32():
    timer = CostTimer({"float32": 1.0, "bfloat16": 0.5})
    plan = tune(mlp(), candidates=("float32", "bfloat16"), error_budget=1e-4, timer=timer)
    assert set(plan.dtypes.values()) == {"float32"}
    assert (
        plan.layers[0].why.startswith("bfloat16 error ") and "> budget 0.0001" in plan.layers[0].why
    )


def test_slow_candidate_left_out_with_measured_reason():
    timer = CostTimer({"float32": 1.0, "bfloat16": 0.5, "float16": 3.0})
    plan = tune(mlp(), candidates=("float32", "bfloat16", "float16"), timer=timer)
    assert plan.left_out["float16"].startswith(
        "measured 3.0x float32's time on its largest layer 2 (3e+03 ms against 1e+03 ms)"
    )
    assert "float16" not in plan.layers[0].times


def test_float8_on_cpu_is_left_out_and_says_why():
    pytest.importorskip("torchao")
    timer = CostTimer({"float32": 1.0, "bfloat16": 0.5, "float8": 40.0})
    plan = tune(mlp(), candidates=("float32", "bfloat16", "float8"), timer=timer)
    assert "float8" not in plan.dtypes.values()
    # Timed where the kernel runs: the reference kernel is far slower than float32.
    if cpu_kernel_error(rowwise=False) is None:
        assert "reference kernel" in plan.left_out["float8"]
        assert "on 16 of its input rows" in plan.left_out["float8"]
    else:  # no float8 kernel at all (oneDNN limited to AVX2): left out with torch's error
        assert plan.left_out["float8"].startswith("fails on this machine: ")


def test_a_candidate_with_no_kernel_here_is_left_out_not_raised():
    # oneDNN limited to AVX2 (an AVX2-only CPU) has no float8 matmul: torch._scaled_mm
    # raised "could not create a primitive descriptor" out of autotune.
    class NoKernel(CostTimer):
        def layer(self, name, dtype, run):
            if dtype == "float16":
                raise RuntimeError("could not create a primitive descriptor for the matmul\nmore")
            return super().layer(name, dtype, run)

    timer = NoKernel({"float32": 1.0, "bfloat16": 0.5, "float16": 0.4})
    plan = tune(mlp(), candidates=("float32", "bfloat16", "float16"), timer=timer)
    assert plan.left_out["float16"] == (
        "fails on this machine: could not create a primitive descriptor for the matmul"
    )
    assert set(plan.dtypes.values()) <= {"float32", "bfloat16"}


@pytest.mark.float8  # runs float8 matmuls on the CPU
def test_float8_probe_on_cpu_takes_16_rows_of_the_smallest_layer():
    pytest.importorskip("torchao")
    seen = []

    class Rows(CostTimer):
        def layer(self, name, dtype, run):
            result = run()  # the probe's runs return [output, input grad, weight grad]
            seen.append((dtype, result[0].shape[0] if isinstance(result, list) else None))
            return self.cost(name, dtype)

    timer = Rows({"float32": 1.0, "float8": 40.0})
    plan = mp.autotune(mlp(), batch(256), F.cross_entropy, candidates=("float32", "float8"),
                       timer=timer, check_steps=2)  # fmt: skip
    assert seen[:3] == [("float32", 16), ("float8", 16), ("float32", 16)]  # the same rows
    assert "its smallest layer 0, on 16 of its input rows" in plan.left_out["float8"]


def test_failed_training_check_sends_the_worst_layer_to_float32(monkeypatch):
    real = check_module.difference
    calls = iter([0.5])  # the first comparison fails, the rest are measured
    monkeypatch.setattr(check_module, "difference", lambda a, b: next(calls, None) or real(a, b))
    timer = CostTimer({"float32": 1.0, "bfloat16": 0.5})
    plan = tune(mlp(), candidates=("float32", "bfloat16"), timer=timer)
    (moved,) = plan.check.sent_to_float32
    assert plan.check.passed and plan.dtypes[moved] == "float32"
    row = next(r for r in plan.layers if r.name == moved)
    assert row.why == (
        "bfloat16 failed the training check: loss 5.0e-01 from float32's > budget 0.05 (the "
        "largest error of its own)"
    )
    assert row.errors["bfloat16"] == max(r.errors["bfloat16"] for r in plan.layers)
    assert plan.step_times["plan"] == 2.0  # timed again after the check changed it


def test_the_check_trains_past_an_update_when_the_budget_is_spent(monkeypatch):
    # One step's loss comes before any update: a one-step check compared forward rounding
    # alone and could not fail for training's sake, yet said "passed".
    monkeypatch.setattr(check_module.time, "monotonic", _slow_clock())
    timer = CostTimer({"float32": 1.0, "bfloat16": 0.5})
    plan = tune(mlp(), candidates=("float32", "bfloat16"), timer=timer, check_steps=50)
    assert plan.check.steps == check_module.MIN_STEPS == 2


def _slow_clock():
    """A clock that jumps an hour at each read: every deadline is past at once."""
    now = [0.0]

    def monotonic() -> float:
        now[0] += 3600.0
        return now[0]

    return monotonic


def test_plan_round_trips_json_and_applies_identically(tmp_path):
    timer = CostTimer({"float32": 1.0, "bfloat16": 0.5})
    plan = tune(mlp(), candidates=("float32", "bfloat16"), timer=timer)
    loaded = mp.Plan.load(plan.save(tmp_path / "plan.json"))
    assert loaded == plan
    x, _ = batch()
    a = mp.auto_mixed_precision(mlp(), plan=plan)
    b = mp.auto_mixed_precision(mlp(), plan=loaded)
    assert torch.equal(a(x), b(x))


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"candidates": "bfloat16"}, r"candidates='bfloat16' is invalid; give a tuple"),
        ({"candidates": ("int8",)}, r"candidates holds 'int8'; valid dtypes: float32"),
        ({"error_budget": -1}, r"error_budget=-1 is invalid"),
        ({"error_budget": float("nan")}, r"error_budget=nan is invalid; give a number >= 0"),
        ({"time_budget_s": float("nan")}, r"time_budget_s=nan is invalid; .* >= 0, finite"),
        ({"time_budget_s": float("inf")}, r"time_budget_s=inf is invalid; .* >= 0, finite"),
        ({"check_steps": 0}, r"check_steps=0 is invalid"),
        ({"check_steps": 1}, r"check_steps=1 is invalid; it must be an int >= 2"),
    ],
)
def test_bad_arguments_one_line(kwargs, message):
    with pytest.raises(ArgumentError, match=message):
        tune(mlp(), timer=CostTimer({"float32": 1.0}), **kwargs)


def test_prepared_model_and_bad_batch_refused():
    prepared = mp.auto_mixed_precision(mlp(), "mixed_bfloat16")
    with pytest.raises(ArgumentError, match="needs the float32 model"):
        tune(prepared)
    with pytest.raises(ArgumentError, match=r"needs \(inputs, targets\)"):
        mp.autotune(mlp(), torch.randn(2, 16), F.cross_entropy)


def test_plan_slower_than_float32_falls_back_to_float32():
    # Layers 2 and 4 must stay float32 (float16's range); the timer makes any mixed plan
    # slow (the casts between float32 and float16 layers): the plan is float32, and says why.
    class MixedIsSlow(CostTimer):
        def step(self, dtypes, level, run):
            mixed = len(set(dtypes.values())) > 1
            return super().step(dtypes, level, run) + 10.0 * mixed

    model = mlp()
    with torch.no_grad():
        model[2].weight.mul_(1e4)
        model[4].weight.mul_(1e-4)
    timer = MixedIsSlow({"float32": 1.0, "float16": 0.5})
    sgd = lambda params: torch.optim.SGD(params, lr=0.0)  # noqa: E731 (range, not training)
    plan = tune(model, candidates=("float32", "float16"), timer=timer, optimizer=sgd)
    assert set(plan.dtypes.values()) == {"float32"}
    # The level it is applied at, not the uniform plan's (O2), which does not run.
    assert plan.level == "O0" == applied(mp.auto_mixed_precision(mlp(), plan=plan)).level
    assert plan.layers[0].why == "the plan timed slower than float32 (1.25e+04 ms against 3e+03 ms)"
    assert plan.step_times["plan"] == 3.0


def test_no_time_left_gives_float32_and_a_two_step_check():
    timer = CostTimer({"float32": 1.0, "bfloat16": 0.5})
    plan = tune(mlp(), candidates=("float32", "bfloat16"), time_budget_s=0, timer=timer)
    assert set(plan.dtypes.values()) == {"float32"} and plan.check.steps == 2
    assert plan.layers[1].times == {"float32": 1.0, "bfloat16": 0.5}  # the probe (largest)
    assert plan.layers[0].times == {} and plan.layers[0].errors == {}  # not measured
    assert plan.layers[0].why == "not measured within the time budget"


def test_failed_check_at_o3_tries_o2_before_moving_layers(monkeypatch):
    class O3Fastest(CostTimer):
        def step(self, dtypes, level, run):
            return super().step(dtypes, level, run) - 0.2 * (level == "O3")

    real = check_module.difference
    calls = iter([0.5])  # O3's curve fails; O2's is measured (and passes)
    monkeypatch.setattr(check_module, "difference", lambda a, b: next(calls, None) or real(a, b))
    plan = tune(
        mlp(),
        candidates=("float32", "bfloat16"),
        timer=O3Fastest({"float32": 1.0, "bfloat16": 0.5}),
    )
    assert plan.level == "O2" and plan.check.level_from == "O3"
    assert plan.check.sent_to_float32 == () and set(plan.dtypes.values()) == {"bfloat16"}
    assert "level O3 -> O2 (float32 master weights)" in str(plan)
    assert plan.step_times["plan"] == 1.5  # timed again, at O2


def test_an_all_float32_plan_is_not_trained_twice_in_its_check(monkeypatch):
    # The float32 plan is the check's reference: its curve is trained once, not again as
    # "the plan" (a float32 fallback spent up to 2/3 of the time left on a copy).
    calls = []
    real = check_module.curve

    def counting(search, dtypes, level, steps):
        calls.append((tuple(sorted(set(dtypes.values()))), level, steps))
        return real(search, dtypes, level, steps)

    monkeypatch.setattr(check_module, "curve", counting)
    plan = tune(mlp(), candidates=("float32",), timer=CostTimer({"float32": 1.0}))
    assert set(plan.dtypes.values()) == {"float32"} and plan.check.passed
    assert plan.check.max_difference == 0.0
    assert calls == [(("float32",), "O0", 1), (("float32",), "O0", plan.check.steps)]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (none here)")
def test_on_cuda_each_candidate_is_timed_and_the_plan_trains_there():
    """Issue 34 item 5: the same code on a GPU, with wall-clock timings (the timer waits for
    CUDA work) and float8 decided per Linear by measurement, where torchao can run it."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(256, 512), nn.ReLU(), nn.Linear(512, 256)).cuda()
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(512, 256, generator=g).cuda(), torch.randn(512, 256, generator=g).cuda()
    plan = mp.autotune(model, (x, y), F.mse_loss, check_steps=5, time_budget_s=60)
    assert plan.check is not None and plan.check.passed
    for row in plan.layers:
        timed = set(row.times) | set(plan.left_out)
        assert {"float32", "bfloat16", "float16", "float8"} <= timed
        assert all(t > 0 for t in row.times.values())
    assert "CUDA" in plan.machine
    tuned = mp.auto_mixed_precision(copy.deepcopy(model), plan=plan)
    assert torch.isfinite(F.mse_loss(tuned(x).float(), y))


def test_a_plan_whose_training_check_failed_in_the_time_left_is_returned_with_a_warning(
    monkeypatch,
):
    import importlib

    from mixprec.autotune import TrainingCheck

    tune_module = importlib.import_module("mixprec.autotune.tune")

    failed = TrainingCheck(1, 0.05, 0.87, False)
    monkeypatch.setattr(tune_module, "training_check", lambda search, steps, deadline: failed)
    said = r"the plan failed its training check in the time left \(loss 0.87 from float32's"
    costs = {"float32": 1.0, "bfloat16": 0.5, "float16": 0.6, "float8": 0.4}
    with pytest.warns(UserWarning, match=said):
        plan = tune(mlp(), timer=CostTimer(costs))
    assert plan.check is failed


def test_a_layer_the_batch_never_calls_is_planned_float32_and_says_why():
    # Left out of the plan, it followed the plan's float16 policy, unmeasured.
    class Branches(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.fc1, self.fc2, self.rare = nn.Linear(16, 32), nn.Linear(32, 4), nn.Linear(32, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = torch.relu(self.fc1(x))
            return self.rare(h) if x.shape[0] == 1 else self.fc2(h)

    timer = CostTimer({"float32": 1.0, "float16": 0.5})
    plan = mp.autotune(Branches(), batch(), F.cross_entropy, candidates=("float32", "float16"),
                       check_steps=3, timer=timer)  # fmt: skip
    assert plan.dtypes == {"fc1": "float16", "fc2": "float16", "rare": "float32"}
    (rare,) = [r for r in plan.layers if r.name == "rare"]
    assert rare.why == "not called by the tuning batch: float32, not measured"
    assert rare.kind == "Linear" and rare.times == {} and rare.headroom is None
    model = mp.auto_mixed_precision(Branches(), plan=plan)
    assert model.rare.weight.dtype == torch.float32 and model.fc2.weight.dtype == torch.float16


@pytest.mark.parametrize(
    ("kwargs", "said"),
    [
        ({"loss_fn": "cross_entropy"}, r"autotune\(loss_fn='cross_entropy'\) is invalid"),
        ({"optimizer": "adam"}, r"autotune\(optimizer='adam'\) is invalid; valid: a factory"),
        ({"optimizer": torch.optim.SGD(nn.Linear(2, 2).parameters(), lr=0.1)},
         r"autotune\(optimizer=<a SGD>\) is invalid"),
        ({"progress": 5}, r"autotune\(progress=5\) is invalid"),
    ],
)  # fmt: skip
def test_a_callable_argument_that_is_not_one_is_refused_before_any_pass(kwargs, said):
    """Each was called only after the reference pass and the per-layer measurements (0.6 s
    in, "'str' object is not callable")."""
    timer = CostTimer({"float32": 1.0})
    given = {"loss_fn": F.cross_entropy, **kwargs}
    with pytest.raises(ArgumentError, match=said):
        mp.autotune(mlp(), batch(), timer=timer, check_steps=5, **given)
    assert timer.steps == []
