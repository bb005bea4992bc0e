"""A model is prepared once (``needs_preparation``): the same preparation asked again is a
no-op, another one is refused naming both. build_train_step, MixprecTrainer and the
Lightning plugins call it; their own tests check their prefixes."""

from __future__ import annotations

import re

import pytest

import mixprec as mp
from mixprec._prepare_once import needs_preparation
from mixprec.autotune import Plan
from tests.conftest import make_mlp

WHERE = "caller(x=1)"


def prepared(**kwargs):
    return mp.auto_mixed_precision(make_mlp(), **kwargs)


def test_the_same_preparation_is_a_no_op_and_another_is_refused_naming_both():
    assert needs_preparation(make_mlp(), "mixed_float16", "O2", where=WHERE)  # unprepared
    model = prepared(policy="mixed_bfloat16", level="O2", keep_float32=["3"])
    # What the model has, or nothing asked: use it as it is.
    for asked in (
        {},
        {"policy": "mixed_bfloat16", "level": "o2", "keep_float32": ["3"]},
        {"policy": mp.Policy("mixed_bfloat16"), "level": "auto", "amp_level": "O2"},
    ):
        assert needs_preparation(model, where=WHERE, **asked) is False
    # Another policy, level or MindSpore level: both preparations named, in one line.
    for asked in ({"policy": "mixed_float16"}, {"level": "O3"}, {"amp_level": "O3"}):
        with pytest.raises(
            mp.ArgumentError,
            match=rf"^{re.escape(WHERE)}: the model was already prepared with policy "
            r"mixed_bfloat16, level O2; a model is prepared once: pass policy='mixed_bfloat16', "
            r"level='O2' to use it as it is, or build the model again$",
        ):
            needs_preparation(model, where=WHERE, **asked)
    with pytest.raises(
        mp.ArgumentError,
        match=r"^caller\(x=1\): model_init\(\) was already prepared keeping \['3'\] in float32, "
        r"and keep_float32 asks for \['0', '3'\]; a model is prepared once: leave keep_float32 "
        r"out to use it as it is, or build the model again$",
    ):
        needs_preparation(model, where=WHERE, keep_float32=["0", "3"], subject="model_init()")
    plan = Plan.from_dtypes({"0": "bfloat16", "5": "float32"})
    with pytest.raises(
        mp.ArgumentError,
        match=r"^caller\(x=1\): the model was already prepared with policy mixed_bfloat16; "
        r"build the model again and give the plan once$",
    ):
        needs_preparation(model, where=WHERE, plan=plan)


def test_mindspores_o3_with_masters_is_not_mixprecs_o3_and_plans_are_compared():
    masters = prepared(amp_level="O3")  # MindSpore's O3: float32 masters, mixed_float16
    assert needs_preparation(masters, "mixed_float16", amp_level=" o3", where=WHERE) is False
    with pytest.raises(
        mp.ArgumentError,
        match=r"prepared with policy mixed_float16, level O3 with float32 masters; a model is "
        r"prepared once: pass policy='mixed_float16', amp_level='O3' to use it",
    ):
        needs_preparation(masters, level="O3", where=WHERE)
    with pytest.raises(  # a caller with no amp_level argument is not told to pass one
        mp.ArgumentError,
        match=r"with float32 masters; a model is prepared once: MindSpore's amp_level='O3', "
        r"which this takes no argument for, made it; build the model again$",
    ):
        needs_preparation(masters, level="O3", where=WHERE, takes_amp_level=False)
    plan = Plan.from_dtypes({"0": "bfloat16", "5": "float32"})
    planned = prepared(plan=plan)
    assert needs_preparation(planned, plan=plan, where=WHERE) is False
    assert needs_preparation(planned, plan=Plan.from_dtypes(plan.dtypes), where=WHERE) is False
    with pytest.raises(mp.ArgumentError, match=r"already prepared with another plan; build"):
        needs_preparation(planned, plan=Plan.from_dtypes({"0": "float16"}), where=WHERE)
