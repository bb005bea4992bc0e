"""``Plan``: applied through ``auto_mixed_precision(plan=...)``, JSON round trips with strict
checks, the table, and checkpoints of a planned model."""

from __future__ import annotations

import copy
import json

import pytest
import torch
from torch import nn

import mixprec as mp
from mixprec._errors import ArgumentError
from mixprec.autotune import LayerChoice, Plan, TrainingCheck
from mixprec.levels import applied
from mixprec.region import get_region


def tiny(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 4)
    )


def measured_plan() -> Plan:
    layers = (
        LayerChoice("0", "Linear", "bfloat16", {"float32": 1e-4, "bfloat16": 5e-5},
                    {"float32": 0.0, "bfloat16": 3e-3}, 1e-5, "fastest within the budget"),
        LayerChoice("2", "Linear", "float16", {"float32": 1e-4}, {"float16": float("inf")}, None,
                    "given"),
        LayerChoice("4", "Linear", "float32", {}, {}, 0.5, "error 0.2 > budget"),
    )  # fmt: skip
    check = TrainingCheck(50, 0.01, 0.002, True, ("4",), "O3")
    return Plan(layers, "O2", {"float8": "needs torchao"}, {"plan": 0.01}, 0.01, check, "CPU")


def test_plan_applies_through_the_levels_keep_float32_and_to_float():
    model = mp.auto_mixed_precision(tiny(), plan=measured_plan())
    state = applied(model)
    assert state.policy.name == "mixed_bfloat16" and state.level == "O2"
    assert state.keep_float32 == ("4",) and state.plan is not None
    # bfloat16 base: O2 stores layer 0 in bfloat16; layer 2 is a float16 to_float region
    # (float32 weights, cast on use); layer 4 a float32 island.
    assert model[0].weight.dtype == torch.bfloat16
    assert model[2].weight.dtype == torch.float32
    assert get_region(model[2]).compute_dtype == torch.float16
    assert model[4].weight.dtype == torch.float32
    assert get_region(model[4]).compute_dtype == torch.float32
    out = model(torch.randn(3, 16))
    assert out.dtype == torch.float32 and torch.isfinite(out).all()


def test_all_float32_plan_is_the_float32_policy():
    plan = Plan.from_dtypes({"0": "float32", "2": "float32", "4": "float32"})
    reference = tiny()
    model = mp.auto_mixed_precision(copy.deepcopy(reference), plan=plan)
    assert applied(model).policy.name == "float32" and applied(model).level == "O0"
    x = torch.randn(5, 16)
    assert torch.equal(model(x), reference(x))


def test_plan_refuses_other_arguments_unknown_names_and_bad_float8():
    plan = Plan.from_dtypes({"0": "bfloat16"})
    with pytest.raises(ArgumentError, match=r"got level='O1' beside it"):
        mp.auto_mixed_precision(tiny(), level="O1", plan=plan)
    with pytest.raises(ArgumentError, match=r"got keep_float32=\['0'\] beside it"):
        mp.auto_mixed_precision(tiny(), keep_float32=["0"], plan=plan)
    with pytest.raises(ArgumentError, match=r"module '9'.*does not have"):
        mp.auto_mixed_precision(tiny(), plan=Plan.from_dtypes({"9": "bfloat16"}))
    with pytest.raises(ArgumentError, match=r"'1' float8, but it is a ReLU"):
        mp.auto_mixed_precision(tiny(), plan=Plan.from_dtypes({"1": "float8"}))
    with pytest.raises(ArgumentError, match=r"must be a mixprec.Plan.*got dict"):
        mp.auto_mixed_precision(tiny(), plan={"0": "bfloat16"})
    with pytest.raises(ArgumentError, match=r"dtype 'float64'; valid: float32, bfloat16"):
        Plan.from_dtypes({"0": "float64"})


def test_json_round_trip_applies_identically(tmp_path):
    plan = measured_plan()
    loaded = Plan.load(plan.save(tmp_path / "plan.json"))
    assert loaded == plan  # inf errors included
    x = torch.randn(4, 16)
    a = mp.auto_mixed_precision(tiny(), plan=plan)
    b = mp.auto_mixed_precision(tiny(), plan=loaded)
    assert torch.equal(a(x), b(x))
    assert mp.describe(a) == mp.describe(b)


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (lambda d: d.pop("level"), r"missing key\(s\) 'level'"),
        (lambda d: d.update(extra=1), r"unknown key\(s\) 'extra'"),
        (lambda d: d["layers"][0].update(dtype="float64"), r"layers\[0\].dtype='float64'.*float32"),
        (lambda d: d["layers"][1].update(name="0"), r"layers\[1\].name='0'.*once"),
        (lambda d: d["layers"][0]["times"].update(int8=1.0), r"layers\[0\].times key='int8'"),
        (lambda d: d["layers"][0].update(headroom=-1), r"headroom=-1.*number >= 0 or null"),
        (lambda d: d.update(format_version=9), r"format_version=9.*reads 1"),
        (lambda d: d.update(level="O7"), r"level='O7'.*valid: O0, O1, O2, O3"),
        (lambda d: d["check"].update(passed="yes"), r"check.passed='yes'.*true or false"),
        (lambda d: d.update(error_budget=float("nan")), r"error_budget=nan.*finite number >= 0"),
        (lambda d: d["layers"][0]["errors"].update(bfloat16=float("nan")), r"errors\['bfloat16'\]"),
    ],
)  # fmt: skip
def test_load_refuses_a_bad_document_in_one_line(tmp_path, edit, message):
    data = json.loads(measured_plan().to_json())
    edit(data)
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(data))
    with pytest.raises(ArgumentError, match=message) as err:
        Plan.load(path)
    assert "\n" not in str(err.value) and str(path) in str(err.value)


def test_table_lists_layers_candidates_left_out_and_check():
    text = str(measured_plan())
    lines = text.splitlines()
    assert lines[0] == "plan: level O2, error budget 0.01 on CPU"
    assert lines[1].split() == ["layer", "type", "dtype", "ms", "f32", "ms", "bf16", "ms",
                                "f16", "err", "bf16", "err", "f16", "f16", "range",
                                "why"]  # fmt: skip
    assert lines[3].split()[:6] == ["0", "Linear", "bfloat16", "0.1", "0.05", "-"]
    assert "inf" in lines[4]
    assert "left out: float8: needs torchao" in text
    assert "training check: passed: 50 steps" in text
    assert text.endswith(
        "(budget 0.01); level O3 -> O2 (float32 master weights); sent to float32: 4"
    )


def test_checkpoint_of_a_planned_model_round_trips(tmp_path):
    plan = measured_plan()
    model = mp.auto_mixed_precision(tiny(), plan=plan)
    opt = mp.LossScaleOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    x, y = torch.randn(8, 16), torch.randint(0, 4, (8,))
    loss = nn.functional.cross_entropy(model(x), y)
    opt.backward(loss)
    opt.step()
    mp.save_checkpoint(tmp_path / "ckpt", model, opt)

    fresh = mp.auto_mixed_precision(tiny(seed=1), plan=Plan.load(plan.save(tmp_path / "p.json")))
    fresh_opt = mp.LossScaleOptimizer(torch.optim.SGD(fresh.parameters(), lr=0.1))
    report = mp.load_checkpoint(tmp_path / "ckpt", fresh, fresh_opt)
    assert (
        report.metadata["policy"] == str(mp.Policy("mixed_bfloat16"))
        and report.metadata["level"] == "O2"
    )
    for (name, a), b in zip(model.state_dict().items(), fresh.state_dict().values(), strict=True):
        assert a.dtype == b.dtype and torch.equal(a, b), name
    # One more step each from the same state: the same weights after it.
    for m, o in ((model, opt), (fresh, fresh_opt)):
        o.zero_grad()
        o.backward(nn.functional.cross_entropy(m(x), y))
        o.step()
    for a, b in zip(model.parameters(), fresh.parameters(), strict=True):
        assert torch.equal(a, b)


def test_trainer_takes_a_planned_model():
    model = mp.auto_mixed_precision(tiny(), plan=measured_plan())
    trainer = mp.Trainer(model, "sparse_categorical_crossentropy", "sgd", device="cpu")
    x, y = torch.randn(32, 16), torch.randint(0, 4, (32,))
    history = trainer.fit(x, y, batch_size=16, epochs=1, verbose=0)
    assert applied(model).plan is not None and model[0].weight.dtype == torch.bfloat16
    assert len(history.history["loss"]) == 1


def test_trainer_and_build_train_step_take_plan_and_refuse_another():
    plan = measured_plan()
    model = tiny()
    trainer = mp.Trainer(model, "sparse_categorical_crossentropy", "sgd", device="cpu", plan=plan)
    assert applied(model).plan == plan and model[0].weight.dtype == torch.bfloat16
    x, y = torch.randn(32, 16), torch.randint(0, 4, (32,))
    assert len(trainer.fit(x, y, batch_size=16, epochs=1, verbose=0).history["loss"]) == 1
    # The same plan again is accepted; a model prepared otherwise is refused in one line.
    mp.build_train_step(model, "sgd", "mse", plan=plan)
    other = mp.auto_mixed_precision(tiny(), "mixed_bfloat16", "O2")
    with pytest.raises(mp.ArgumentError, match=r"plan=: the model was already prepared with "
                       r"policy mixed_bfloat16; build the model again"):  # fmt: skip
        mp.build_train_step(other, "sgd", "mse", plan=plan)
    beside = r"sets the policy, level and per-module dtypes itself; got policy='mixed_bfloat16'"
    with pytest.raises(mp.ArgumentError, match=beside):
        mp.Trainer(tiny(), "mse", "sgd", "mixed_bfloat16", plan=plan)  # plan alone


def test_a_plan_on_a_model_whose_layers_moved_is_refused():
    """A Dropout inserted before the head shifts a Sequential's names: the plan's float32
    head '4' became a ReLU's region and the real head ran in bfloat16, without a word."""
    shifted = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 32), nn.Dropout(0.0),
                            nn.ReLU(), nn.Linear(32, 4))  # fmt: skip
    moved = r"plan gives '4' \(a Linear when tuned\) dtype 'float32', but the model's '4' is a ReLU"
    with pytest.raises(ArgumentError, match=moved):
        mp.auto_mixed_precision(shifted, plan=measured_plan())


def test_plan_entries_a_level_or_an_outer_entry_would_ignore_are_refused():
    with pytest.raises(ArgumentError, match=r"plan level O0 computes everything in float32, but"):
        mp.auto_mixed_precision(tiny(), plan=Plan.from_dtypes({"0": "bfloat16"}, level="O0"))
    nested = nn.Sequential(nn.Sequential(nn.Linear(16, 16), nn.ReLU()), nn.Linear(16, 4))
    with pytest.raises(ArgumentError, match=r"plan gives '0' float32 and '0.0', inside it, "):
        mp.auto_mixed_precision(nested, plan=Plan.from_dtypes({"0": "float32", "0.0": "bfloat16"}))
    same = Plan.from_dtypes({"0": "bfloat16", "0.0": "bfloat16"})
    assert mp.auto_mixed_precision(nested, plan=same)[0][0].weight.dtype == torch.bfloat16


def test_a_plan_that_failed_its_training_check_warns_when_applied():
    failed = TrainingCheck(3, 0.05, 0.87, False)
    plan = Plan(measured_plan().layers, "O2", check=failed)
    with pytest.warns(UserWarning, match=r"this plan failed its training check \(loss 0.87 from "
                                         r"float32's, budget 0.05\)") as seen:  # fmt: skip
        mp.auto_mixed_precision(tiny(), plan=plan)
    assert seen[0].filename == __file__
