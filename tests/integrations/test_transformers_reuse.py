"""Several ``MixprecTrainer``s over one model, as Hugging Face users build them: a second run
with another batch size, a Trainer for evaluation, ``model_init`` returning the same model.

The tiny GPT-2 and the helpers of ``test_transformers``; skipped where ``transformers`` is
not installed.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

import mixprec as mp

transformers = pytest.importorskip("transformers")

from mixprec.integrations.transformers import MixprecTrainer  # noqa: E402
from tests.integrations.test_transformers import (  # noqa: E402
    _offline,  # noqa: F401  (autouse fixture: no Hub, no accelerate mixed precision)
    arguments,
    build,
    dataset,
    float32_values,
    logged,
    weights,
)

POLICY = "mixed_bfloat16"


class _AtTrainBegin(transformers.TrainerCallback):
    """Keeps the trainer's float32 values (masters) and 16-bit weights as training starts."""

    def __init__(self) -> None:
        self.trainer: Any = None
        self.masters: dict[str, torch.Tensor] = {}
        self.weights: dict[str, torch.Tensor] = {}

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.masters = float32_values(self.trainer)
        self.weights = weights(self.trainer.model)


def first_run(tmp_path, data, policy=POLICY):
    trainer = MixprecTrainer(
        model=build(),
        args=arguments(tmp_path / "a", max_steps=8),
        train_dataset=data,
        policy=policy,
    )
    trainer.train()
    return trainer


def second_trainer(tmp_path, model, data, **kwargs):
    start = _AtTrainBegin()
    trainer = MixprecTrainer(
        model=model,
        args=arguments(tmp_path / "b", max_steps=8, per_device_train_batch_size=8),
        train_dataset=data,
        eval_dataset=data[:8],
        callbacks=[start],
        **kwargs,
    )
    start.trainer = trainer
    return trainer, start


@pytest.mark.parametrize("policy", ["mixed_bfloat16", "mixed_float16"])
def test_second_trainer_continues_from_the_first_runs_masters(tmp_path, policy):
    data = dataset()
    first = first_run(tmp_path, data, policy)
    masters, trained = float32_values(first), weights(first.model)
    # The masters carry more than their 16-bit rounding: starting from the weights would lose it.
    half = mp.get_policy(policy).compute_dtype
    assert any(not torch.equal(m, m.to(half).float()) for m in masters.values())

    # The second run trains on one row repeated: its first step's loss is that row's loss
    # under the weights the first run reached.
    row = [data[0]] * 64
    end_of_first = first.evaluate(eval_dataset=row[:8])["eval_loss"]
    second, start = second_trainer(tmp_path, first.model, row, policy=policy)
    second.train()

    for name in masters:
        assert torch.equal(start.masters[name], masters[name]), name
        assert torch.equal(start.weights[name], trained[name]), name
    # The second run (batch 8) starts where the first ended.
    losses = logged(second, "loss")
    assert len(losses) == 8 and all(map(torch.isfinite, torch.tensor(losses)))
    assert losses[0] == pytest.approx(end_of_first, abs=1e-4)
    assert logged(second, "skipped_steps")[-1] == 0
    # It trained: the masters moved on from the first run's.
    after = float32_values(second)
    assert any(not torch.equal(after[n], masters[n]) for n in masters)
    assert second.evaluate()["eval_loss"] < end_of_first


def test_weights_loaded_after_the_first_run_win_over_its_masters(tmp_path):
    data = dataset()
    first = first_run(tmp_path, data)
    fresh = mp.auto_mixed_precision(build(), POLICY, "O2")
    first.model.load_state_dict(fresh.state_dict())
    loaded = weights(first.model)

    second, start = second_trainer(tmp_path, first.model, data, policy=POLICY)
    second.train()
    for name, value in loaded.items():
        assert torch.equal(start.masters[name], value.float()), name


def test_a_trainer_for_evaluation_after_training(tmp_path):
    data = dataset()
    first = first_run(tmp_path, data)
    expected = first.evaluate(eval_dataset=data[:16])["eval_loss"]
    evaluator = MixprecTrainer(
        model=first.model,
        args=arguments(tmp_path / "eval", per_device_eval_batch_size=8),
        eval_dataset=data[:16],
        policy=POLICY,
    )
    assert evaluator.evaluate()["eval_loss"] == pytest.approx(expected, abs=1e-6)
    assert first.model.transformer.h[0].attn.c_attn.weight.dtype == torch.bfloat16


def test_model_init_may_return_the_same_prepared_model(tmp_path):
    """Hyper-parameter search style: model_init hands back one model for every trial."""
    model = mp.auto_mixed_precision(build(), POLICY, "O2")
    for lr in (1e-3, 3e-3):
        trainer = MixprecTrainer(
            model_init=lambda: model,
            args=arguments(tmp_path / str(lr), max_steps=2, learning_rate=lr),
            train_dataset=dataset(),
            policy=POLICY,
        )
        trainer.train()
        assert trainer.model is model
        assert logged(trainer, "skipped_steps") == [0, 0]


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (
            {"policy": "mixed_float16"},
            r"^MixprecTrainer\(policy='mixed_float16', level='O2'\): model was already "
            r"prepared with policy mixed_bfloat16, level O2; a model is prepared once: pass "
            r"policy='mixed_bfloat16', level='O2' to use it as it is, or build the model again$",
        ),
        ({"policy": POLICY, "level": "O1"}, r"level='O1'\).* level O2; .*level='O2'"),
        (
            {"policy": POLICY, "keep_float32": ["lm_head"]},
            r"keeping \[\] in float32, and keep_float32 asks for \['lm_head'\]",
        ),
    ],
)
def test_a_conflicting_preparation_is_refused(tmp_path, kwargs, message):
    model = mp.auto_mixed_precision(build(), POLICY, "O2")
    with pytest.raises(mp.ArgumentError, match=message):
        MixprecTrainer(model=model, args=arguments(tmp_path / "b"), **kwargs)
    with pytest.raises(ValueError, match="model_init\\(\\) was already prepared"):
        MixprecTrainer(model_init=lambda: model, args=arguments(tmp_path / "c"), **kwargs)
