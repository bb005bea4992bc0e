"""``MixprecTrainer``: mixprec's mixed precision inside Hugging Face ``transformers.Trainer``.

A tiny GPT-2 (2 layers, width 32, vocabulary 100) with seeded random weights and no dropout,
built from its config (nothing is fetched from the Hub), trained on learnable synthetic
sequences of 16 tokens, on the CPU. Mixed runs are compared step by step with a plain
``transformers.Trainer`` in float32 from the same weights on the same batches.

Skipped where ``transformers`` is not installed.
"""

from __future__ import annotations

import inspect
import math
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import mixprec as mp

transformers = pytest.importorskip("transformers")

from mixprec.integrations.transformers import MixprecTrainer  # noqa: E402
from tests._tiny_gpt2 import counting_rows, tiny_gpt2  # noqa: E402

VOCAB, SEQ = 100, 16
POLICIES = ("mixed_bfloat16", "mixed_float16")

# Max per-step |loss - float32 loss| over 24 steps at O2 (losses fall from ~4.6 = ln 100 to
# ~4.15). Measured on the 2-core development CPU (AMD EPYC, AVX2), torch 2.13, transformers
# 5.23: data seed 0 (used here) bfloat16 1.0e-3, float16 7.5e-5; seeds 0-4 at most 1.5e-3
# and 3.6e-4; the eval losses after training differ by at most 5.4e-4 and 1.7e-4. (O1, seeds
# 0-4: at most 1.3e-3 and 3.5e-4, evaluation 5.0e-4 and 1.9e-4.) The bounds are ~3x the
# largest. bfloat16 keeps 8 bits of mantissa (unit roundoff 2**-8), float16 11
# (2**-11): hence the looser bfloat16 bound.
TOLERANCE = {"mixed_bfloat16": 4.5e-3, "mixed_float16": 1.1e-3}


@pytest.fixture(autouse=True)
def _offline(monkeypatch):
    """No Hub access, and no accelerate mixed precision from the environment."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.delenv("ACCELERATE_MIXED_PRECISION", raising=False)
    constants = pytest.importorskip("huggingface_hub.constants")
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)


def build() -> nn.Module:
    return tiny_gpt2(VOCAB, SEQ)


def dataset(n: int = 128, seed: int = 0) -> list[dict[str, torch.Tensor]]:
    return counting_rows(n, VOCAB, SEQ, seed)


def arguments(out: Path, **overrides: Any) -> Any:
    kwargs: dict[str, Any] = {
        "output_dir": str(out),
        "per_device_train_batch_size": 4,
        "max_steps": 24,
        "learning_rate": 3e-3,
        "logging_steps": 1,
        "report_to": [],
        "save_strategy": "no",
        "use_cpu": True,
        "disable_tqdm": True,
        "seed": 0,
    }
    kwargs.update(overrides)
    return transformers.TrainingArguments(**kwargs)


def logged(trainer: Any, key: str) -> list[Any]:
    """``key`` from each training step's log (logging_steps=1)."""
    return [e[key] for e in trainer.state.log_history if "loss" in e]


def float32_values(trainer: MixprecTrainer) -> dict[str, torch.Tensor]:
    """Every parameter's float32 value: the master of a 16-bit parameter, else itself."""
    optimizer = trainer.loss_scale_optimizer
    assert optimizer is not None
    masters = {id(half): master for half, master in optimizer.master_weights()}
    return {
        name: masters.get(id(p), p).detach().clone() for name, p in trainer.model.named_parameters()
    }


def weights(model: nn.Module) -> dict[str, torch.Tensor]:
    return {name: p.detach().clone() for name, p in model.named_parameters()}


def float32_trainer(tmp_path: Path, data: list, **overrides: Any) -> Any:
    trainer = transformers.Trainer(
        model=build(), args=arguments(tmp_path / "f32", **overrides), train_dataset=data
    )
    trainer.train()
    return trainer


# -- training -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("policy", "level"),
    [("mixed_bfloat16", "auto"), ("mixed_float16", "auto"), ("mixed_float16", "O1")],
)
def test_trains_like_float32(tmp_path, policy, level):
    data = dataset()
    reference = float32_trainer(tmp_path, data)
    args = arguments(tmp_path / "mixed")
    before = args.to_dict()
    trainer = MixprecTrainer(
        model=build(), args=args, train_dataset=data, policy=policy, level=level
    )
    compute = mp.get_policy(policy).compute_dtype
    seen: set[torch.dtype] = set()
    attn = trainer.model.transformer.h[0].attn.c_attn
    attn.register_forward_hook(lambda m, i, o: seen.add(o.dtype))
    trainer.train()

    assert trainer.level == ("O2" if level == "auto" else level)
    assert seen == {compute}, "the attention projection must compute in 16 bits"
    assert trainer.accelerator.mixed_precision == "no"
    optimizer = trainer.loss_scale_optimizer
    assert optimizer is not None
    dtypes = {name: p.dtype for name, p in trainer.model.named_parameters()}
    if trainer.level == "O1":  # weights stay float32, cast on use: no masters
        assert set(dtypes.values()) == {torch.float32}
        assert optimizer.master_weights() == []
    else:
        # O2: matrix weights (HF's Conv1D, the embeddings) 16-bit, LayerNorm float32...
        assert dtypes["transformer.h.0.attn.c_attn.weight"] == compute
        assert dtypes["transformer.wte.weight"] == compute
        assert dtypes["transformer.h.0.ln_1.weight"] == torch.float32
        # ... and a float32 master behind every 16-bit one, in the inner optimizer.
        pairs = optimizer.master_weights()
        assert len(pairs) == sum(d == compute for d in dtypes.values())
        assert all(h.dtype == compute and m.dtype == torch.float32 for h, m in pairs)
        inner = {id(p) for g in optimizer.optimizer.param_groups for p in g["params"]}
        assert all(id(m) in inner for _, m in pairs)
        # Their float32 gradients are dropped after each step, not kept into the next forward.
        assert all(m.grad is None for _, m in pairs)

    losses, expected = logged(trainer, "loss"), logged(reference, "loss")
    assert len(losses) == 24
    assert logged(trainer, "skipped_steps") == [0] * 24
    scale = 2.0**16 if policy == "mixed_float16" else 1.0
    assert logged(trainer, "loss_scale") == [scale] * 24
    assert losses[-1] < losses[0] - 0.3, losses  # measured: 4.62 -> 4.13
    diffs = [abs(a - b) for a, b in zip(losses, expected, strict=True)]
    assert max(diffs) < TOLERANCE[policy], [f"{d:.1e}" for d in diffs]
    # The learning rate followed the same schedule (every step applied).
    assert logged(trainer, "learning_rate") == logged(reference, "learning_rate")
    # Evaluation runs with the policy too, and its logs carry no scaler state.
    metrics = trainer.evaluate(data[:16])
    assert (
        abs(metrics["eval_loss"] - reference.evaluate(data[:16])["eval_loss"]) < TOLERANCE[policy]
    )
    assert "loss_scale" not in metrics
    assert args.to_dict() == before, "the TrainingArguments were changed"


def test_float32_policy_is_the_plain_trainer(tmp_path):
    """At O0 nothing is added to the Trainer's loop: data order, loss normalisation, the
    schedule and the AdamW step are the plain Trainer's, bit for bit. (Without clipping: with
    it, the gradient norm sums the parameters in the optimizer's order, not the model's, and
    the losses differ by ~5e-7.)"""
    data = dataset()
    reference = float32_trainer(tmp_path, data, max_grad_norm=0.0)
    trainer = MixprecTrainer(
        model=build(),
        args=arguments(tmp_path / "o0", max_grad_norm=0.0),
        train_dataset=data,
        policy="float32",
    )
    trainer.train()
    assert trainer.level == "O0"
    assert logged(trainer, "loss") == logged(reference, "loss")
    assert logged(trainer, "grad_norm") == pytest.approx(logged(reference, "grad_norm"), rel=1e-5)
    for name, value in weights(trainer.model).items():
        assert torch.equal(value, weights(reference.model)[name]), name


class Snapshots(transformers.TrainerCallback):
    """Float32 values and learning rate before and after each optimizer step."""

    def __init__(self, trainer: MixprecTrainer) -> None:
        self.trainer = trainer
        self.before: dict[int, dict[str, torch.Tensor]] = {}
        self.after: dict[int, dict[str, torch.Tensor]] = {}
        self.lr: dict[int, tuple[float, float]] = {}

    def on_step_begin(self, args, state, control, lr_scheduler=None, **kwargs):
        if self.trainer.loss_scale_optimizer is not None:
            self.before[state.global_step] = {
                **float32_values(self.trainer),
                **{f"16-bit {k}": v for k, v in weights(self.trainer.model).items()},
            }
            self.lr[state.global_step] = (lr_scheduler.get_last_lr()[0], math.nan)

    def on_step_end(self, args, state, control, lr_scheduler=None, **kwargs):
        step = state.global_step - 1
        self.after[step] = {
            **float32_values(self.trainer),
            **{f"16-bit {k}": v for k, v in weights(self.trainer.model).items()},
        }
        self.lr[step] = (self.lr[step][0], lr_scheduler.get_last_lr()[0])


def overflow_on(model: nn.Module, step: int) -> None:
    """Make one weight's gradient inf in backward number ``step`` (0-based): an overflow of
    the gradients only, as float16 produces, with a finite loss."""
    calls = [0]

    def hook(grad: torch.Tensor) -> torch.Tensor:
        calls[0] += 1
        return torch.full_like(grad, math.inf) if calls[0] == step + 1 else grad

    model.transformer.h[0].mlp.c_fc.weight.register_hook(hook)


@pytest.mark.parametrize("policy", POLICIES)
def test_overflow_skips_the_step_and_the_scheduler(tmp_path, policy):
    bad = 3
    trainer = MixprecTrainer(
        model=build(),
        args=arguments(tmp_path, max_steps=6),
        train_dataset=dataset(),
        policy=policy,
    )
    overflow_on(trainer.model, bad)
    snapshots = Snapshots(trainer)
    trainer.add_callback(snapshots)
    trainer.train()

    # The skipped step changed no weight, 16-bit or float32 master, and not the schedule.
    for name, value in snapshots.before[bad].items():
        assert torch.equal(value, snapshots.after[bad][name]), name
    lr_before, lr_after = snapshots.lr[bad]
    assert lr_after == lr_before
    # The steps around it were applied, with the schedule advancing.
    for step in (bad - 1, bad + 1):
        changed = snapshots.before[step]["transformer.h.0.mlp.c_fc.weight"]
        assert not torch.equal(changed, snapshots.after[step]["transformer.h.0.mlp.c_fc.weight"])
        assert snapshots.lr[step][1] < snapshots.lr[step][0]
    assert trainer.lr_scheduler.last_epoch == 5, "5 applied steps of 6"
    assert trainer.state.global_step == 6  # the Trainer counts skipped steps, as with fp16=True
    assert logged(trainer, "skipped_steps") == [0, 0, 0, 1, 1, 1]
    scales = logged(trainer, "loss_scale")
    if policy == "mixed_float16":  # logged after the step: the backoff shows at the bad step
        assert scales == [2.0**16] * 3 + [2.0**15] * 3
    else:
        assert scales == [1.0] * 6
    # The logged learning rate is the one each step used: the step after the skip reuses it.
    rates = logged(trainer, "learning_rate")
    assert rates[bad + 1] == rates[bad] and rates[bad] < rates[bad - 1]
    assert all(math.isfinite(x) for x in logged(trainer, "loss"))


def test_trace_overflow_names_the_module(tmp_path, caplog):
    """A forward overflow (one MLP's output to inf at step 1) is traced to that module."""
    trainer = MixprecTrainer(
        model=build(),
        args=arguments(tmp_path, max_steps=3),
        train_dataset=dataset(),
        policy="mixed_float16",
        trace_overflow=True,
    )
    calls = [0]

    def blow_up(module, inputs, output):
        calls[0] += 1
        return output * math.inf if calls[0] == 2 else output

    trainer.model.transformer.h[1].mlp.c_proj.register_forward_hook(blow_up)
    with caplog.at_level("WARNING", logger="mixprec"):
        trainer.train()
    assert logged(trainer, "skipped_steps") == [0, 1, 1]
    assert "step skipped: overflow first in transformer.h.1.mlp.c_proj" in caplog.text


# -- clipping and accumulation --------------------------------------------------------------


@pytest.mark.parametrize("max_grad_norm", [0.25, 0.0])
def test_max_grad_norm_clips_the_unscaled_master_gradients(tmp_path, max_grad_norm):
    """float16 with a 2**16 loss scale and SGD: one step moves the float32 values by exactly
    lr * clipped gradient. Clipping the scaled 16-bit gradients instead would move them
    2**16 times less; not clipping, by lr * |g| (~1.5)."""
    lr = 0.1
    overrides = {
        "max_steps": 1,
        "optim": "sgd",
        "learning_rate": lr,
        "lr_scheduler_type": "constant",
        "max_grad_norm": max_grad_norm,
    }
    data = dataset()
    reference = float32_trainer(tmp_path, data, **overrides)
    start = weights(build())
    trainer = MixprecTrainer(
        model=build(),
        args=arguments(tmp_path / "mixed", **overrides),
        train_dataset=data,
        policy="mixed_float16",
    )
    trainer.train()
    norm = logged(trainer, "grad_norm")[0]
    # The logged norm is the unscaled one, before clipping, as float32 training logs it
    # (from float16 gradients: measured within 1.3e-4 relative, data seeds 0-2).
    assert norm == pytest.approx(logged(reference, "grad_norm")[0], rel=5e-4)
    assert norm > 1.0
    moved = torch.linalg.vector_norm(
        torch.stack(
            [
                torch.linalg.vector_norm(value - start[name])
                for name, value in float32_values(trainer).items()
            ]
        )
    ).item()
    expected = lr * (min(max_grad_norm, norm) if max_grad_norm else norm)
    # float32 arithmetic on the masters: measured within 7.3e-7 relative.
    assert moved == pytest.approx(expected, rel=1e-5)


def test_gradient_accumulation_matches_the_doubled_batch(tmp_path):
    """2 micro-batches of 2 per step against batches of 4: the same samples per step (the
    sampler's order does not depend on the batch size), the Trainer's loss normalisation
    (by the token count of the whole step), one unscale per step."""
    data = dataset()
    policy = "mixed_bfloat16"
    whole = MixprecTrainer(
        model=build(),
        args=arguments(tmp_path / "whole", max_steps=12),
        train_dataset=data,
        policy=policy,
    )
    whole.train()
    accumulated = MixprecTrainer(
        model=build(),
        args=arguments(
            tmp_path / "acc",
            max_steps=12,
            per_device_train_batch_size=2,
            gradient_accumulation_steps=2,
        ),
        train_dataset=data,
        policy=policy,
    )
    accumulated.train()
    optimizer = accumulated.loss_scale_optimizer
    assert optimizer is not None
    # 12 optimizer steps, each over 2 micro-batches: the scaler saw 12 steps, not 24.
    assert accumulated.state.global_step == 12
    assert optimizer.loss_scaler.state.steps == 12
    assert accumulated.lr_scheduler.last_epoch == 12
    losses, expected = logged(accumulated, "loss"), logged(whole, "loss")
    assert len(losses) == 12
    # Measured: 3.3e-4 apart at most (data seeds 0-4: 4.9e-4); the bound is ~3x that. The
    # 16-bit gradients of two micro-batches are summed in bfloat16, and the micro-batches'
    # matmuls round differently from the whole batch's.
    diffs = [abs(a - b) for a, b in zip(losses, expected, strict=True)]
    assert max(diffs) < 1.5e-3, [f"{d:.1e}" for d in diffs]


# -- checkpoints ----------------------------------------------------------------------------


@pytest.mark.parametrize("policy", POLICIES)
def test_resume_equals_the_uninterrupted_run(tmp_path, policy):
    """Save at step 4 of 8, resume in a new Trainer from that checkpoint: the float32
    masters, the 16-bit weights and the losses of steps 5-8 are those of the run that did
    not stop, bit for bit, and so is the loss scale (grown from 2**10 to 2**12 by then)."""
    data = dataset()
    float16 = policy == "mixed_float16"

    def run(name: str, resume: str | None = None) -> MixprecTrainer:
        trainer = MixprecTrainer(
            model=build(),
            args=arguments(tmp_path / name, max_steps=8, save_strategy="steps", save_steps=4),
            train_dataset=data,
            policy=policy,
            # float16: a scale that changes before the checkpoint, so that restoring shows.
            loss_scaler=mp.DynamicLossScaler(2.0**10, growth_interval=2) if float16 else None,
        )
        trainer.train(resume_from_checkpoint=resume)
        return trainer

    full = run("full")
    checkpoint = tmp_path / "full" / "checkpoint-4"
    saved = torch.load(checkpoint / "optimizer.pt", weights_only=True)
    assert {"optimizers", "master_weights", "loss_scaler"} <= set(saved)
    assert all(m.dtype == torch.float32 for m in saved["master_weights"])
    resumed = run("resumed", str(checkpoint))

    assert resumed.state.global_step == 8
    # The log history resumes with the checkpoint's (steps 1-4): all 8 steps compare.
    assert logged(resumed, "loss") == logged(full, "loss")
    for name, value in float32_values(resumed).items():
        assert torch.equal(value, float32_values(full)[name]), name
    for name, value in weights(resumed.model).items():
        assert torch.equal(value, weights(full.model)[name]), name
    scales = logged(resumed, "loss_scale")
    assert scales == logged(full, "loss_scale")
    assert scales[4] == (2.0**12 if float16 else 1.0)  # the first step after the resume
    assert resumed.lr_scheduler.get_last_lr() == full.lr_scheduler.get_last_lr()


@pytest.mark.parametrize("save_masters", [True, False])
def test_save_model_writes_the_float32_masters(tmp_path, save_masters):
    """``save_model()`` at O2 writes the float32 masters, the values training reached, so
    ``from_pretrained`` gives them back in float32; the prepared model stays 16-bit.
    ``save_masters=False`` writes the weights as the model stores them."""
    trainer = MixprecTrainer(
        model=build(),
        args=arguments(tmp_path / "run", max_steps=3),
        train_dataset=dataset(),
        policy="mixed_bfloat16",
        save_masters=save_masters,
    )
    trainer.train()
    masters, stored = float32_values(trainer), weights(trainer.model)
    out = tmp_path / "final"
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the save the user asked for: nothing to say
        trainer.save_model(str(out))
    assert weights(trainer.model).keys() == stored.keys()
    assert all(torch.equal(p, stored[n]) for n, p in weights(trainer.model).items())
    from safetensors.torch import load_file

    written = load_file(out / "model.safetensors")
    attn = "transformer.h.0.attn.c_attn.weight"
    assert written[attn].dtype == (torch.float32 if save_masters else torch.bfloat16)
    expected = masters if save_masters else stored
    for name, value in written.items():
        if name in expected:  # parameters; the rest are buffers
            assert torch.equal(value, expected[name]), name
    loaded = type(trainer.model).from_pretrained(str(out))
    if save_masters:
        assert {p.dtype for p in loaded.parameters()} == {torch.float32}
        for name, value in weights(loaded).items():
            assert torch.equal(value, masters[name]), name
        # The model's own save_pretrained writes its 16-bit weights: said, with the fix.
        with pytest.warns(
            UserWarning, match=r"save_pretrained\(\) writes this mixprec .*save_model"
        ):
            trainer.model.save_pretrained(str(tmp_path / "own"))


def test_an_evaluation_only_trainer_saves_the_float32_weights_it_was_given(tmp_path):
    """With no optimizer, ``save_model()`` wrote the bfloat16 roundings of the pretrained
    float32 weights: the float32 values kept at preparation are written instead."""
    model = build()
    original = weights(model)
    trainer = MixprecTrainer(
        model=model,
        args=arguments(tmp_path / "run", per_device_eval_batch_size=8),
        eval_dataset=dataset(16),
        policy="mixed_bfloat16",
    )
    assert math.isfinite(trainer.evaluate()["eval_loss"])
    assert trainer.model.transformer.h[0].attn.c_attn.weight.dtype == torch.bfloat16
    out = tmp_path / "final"
    trainer.save_model(str(out))
    from safetensors.torch import load_file

    written = load_file(out / "model.safetensors")
    for name, value in original.items():
        if name in written:  # tied lm_head.weight is written once
            assert written[name].dtype == torch.float32 and torch.equal(written[name], value)
    loaded = type(trainer.model).from_pretrained(str(out))
    assert all(torch.equal(p, original[n]) for n, p in weights(loaded).items())


# -- refusals and bad arguments -------------------------------------------------------------


@pytest.mark.parametrize("flag", ["bf16", "fp16"])
def test_refuses_accelerates_mixed_precision_flags(tmp_path, flag):
    args = arguments(tmp_path, **{flag: True})
    with pytest.raises(ValueError) as raised:
        MixprecTrainer(model=build(), args=args, policy="mixed_bfloat16")
    assert str(raised.value) == (
        f"TrainingArguments({flag}=True) with MixprecTrainer(policy='mixed_bfloat16'): two "
        "mixed precision systems at once (accelerate's autocast and mixprec's policy); drop "
        f"{flag}=True, MixprecTrainer does the mixed precision"
    )


def test_refuses_accelerate_mixed_precision_from_the_environment(tmp_path, monkeypatch):
    monkeypatch.setenv("ACCELERATE_MIXED_PRECISION", "bf16")
    args = arguments(tmp_path)
    assert args.mixed_precision == "bf16"  # what the Trainer would hand to its Accelerator
    with pytest.raises(ValueError) as raised:
        MixprecTrainer(model=build(), args=args, policy="mixed_float16")
    assert str(raised.value) == (
        "ACCELERATE_MIXED_PRECISION='bf16' (accelerate's mixed precision, as `accelerate "
        "launch --mixed_precision` sets it) with MixprecTrainer(policy='mixed_float16'): two "
        "mixed precision systems at once; unset it or set it to 'no' (then build the "
        "TrainingArguments), MixprecTrainer does the mixed precision"
    )
    # Unset after the arguments were built: they carry it all the same.
    monkeypatch.delenv("ACCELERATE_MIXED_PRECISION")
    with pytest.raises(ValueError, match="which these TrainingArguments read when built"):
        MixprecTrainer(model=build(), args=args, policy="mixed_float16")
    # "no" is no mixed precision: accepted.
    monkeypatch.setenv("ACCELERATE_MIXED_PRECISION", "no")
    MixprecTrainer(model=build(), args=arguments(tmp_path), policy="mixed_float16")


def prepared_model() -> nn.Module:
    return mp.auto_mixed_precision(build(), "mixed_bfloat16", "O2")


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        ({"policy": "mixed_bfloat17"}, ValueError, "policy='mixed_bfloat17' is not a known"),
        ({"level": "O4"}, ValueError, "level='O4' is not a known level; valid: O0, O1, O2, O3"),
        ({"loss_scaler": "dynamic"}, TypeError, "loss_scaler must be a mixprec"),
        ({"trace_overflow": "yes"}, TypeError, "trace_overflow must be True or False"),
        ({"save_masters": 1}, TypeError, "save_masters must be True or False, got 1"),
        (
            {"model": prepared_model, "policy": "mixed_float16"},
            ValueError,
            "model was already prepared with policy mixed_bfloat16, level O2",
        ),
        ({"optimizers": "lso"}, TypeError, r"optimizers=\(LossScaleOptimizer\(...\), ...\)"),
        ({"keep_float32": ["lm_haed"]}, ValueError, "closest: 'lm_head'"),
    ],
)
def test_bad_arguments_are_named(tmp_path, kwargs, error, message):
    kwargs = dict(kwargs)
    model = kwargs.pop("model", build)()
    if kwargs.get("optimizers") == "lso":
        inner = torch.optim.AdamW(prepared_model().parameters())
        kwargs["optimizers"] = (mp.LossScaleOptimizer(inner), None)
    with pytest.raises(error, match=message):
        MixprecTrainer(model=model, args=arguments(tmp_path), **kwargs)


def test_an_optimizer_over_another_model_is_refused(tmp_path):
    """Built over another model's parameters, it would step and log grad_norm 0 while the
    model stays as it was."""
    model, other = build(), build()
    optimizer = torch.optim.AdamW(other.parameters(), lr=1e-3)
    trainable = sum(p.requires_grad for p in model.parameters())
    with pytest.raises(mp.ArgumentError) as err:
        MixprecTrainer(model=model, args=arguments(tmp_path), optimizers=(optimizer, None))
    assert str(err.value).startswith(
        f"MixprecTrainer(optimizers=(AdamW, ...)): the optimizer holds {trainable} parameters "
        f"and none of the model's {trainable} trainable ones"
    )
    assert "torch.optim.AdamW(model.parameters())" in str(err.value)


def test_an_optimizer_over_part_of_the_model_warns(tmp_path):
    model = build()
    part = torch.optim.AdamW(model.transformer.h.parameters(), lr=1e-3)
    trainable = sum(p.requires_grad for p in model.parameters())
    held = len(list(model.transformer.h.parameters()))
    with pytest.warns(UserWarning) as caught:
        MixprecTrainer(model=model, args=arguments(tmp_path), optimizers=(part, None))
    (warning,) = [w for w in caught if "trainable" in str(w.message)]
    assert str(warning.message).startswith(
        f"optimizer holds {held} of the model's {trainable} trainable parameters; these will "
        "not train: transformer.wte.weight, transformer.wpe.weight"
    )
    assert warning.filename == __file__  # the MixprecTrainer(...) line
    # Over the whole model: nothing to say.
    whole = build()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        MixprecTrainer(
            model=whole,
            args=arguments(tmp_path),
            optimizers=(torch.optim.AdamW(whole.parameters()), None),
        )


def test_a_16bit_model_gets_float32_masters_and_norms(tmp_path):
    """A model in bfloat16 is brought to O2's storage by auto_mixed_precision (float32 norms,
    float32 masters behind the 16-bit matrix weights), with its note at the user's line."""
    model = build().to(torch.bfloat16)
    with pytest.warns(UserWarning, match=r"upcast to float32 so that O2 has float32") as caught:
        trainer = MixprecTrainer(
            model=model,
            args=arguments(tmp_path, max_steps=2),
            train_dataset=dataset(16),
            policy="mixed_bfloat16",
        )
    assert [w.filename for w in caught if "upcast" in str(w.message)] == [__file__]
    block = model.transformer.h[0]
    assert block.ln_1.weight.dtype == torch.float32
    assert block.attn.c_attn.weight.dtype == torch.bfloat16
    trainer.train()
    masters = trainer.loss_scale_optimizer.master_weights()
    assert masters and all(m.dtype == torch.float32 for _, m in masters)
    assert logged(trainer, "skipped_steps") == [0, 0]


def test_model_init_models_are_prepared(tmp_path):
    trainer = MixprecTrainer(
        model_init=build,
        args=arguments(tmp_path, max_steps=2),
        train_dataset=dataset(),
        policy="mixed_bfloat16",
    )
    trainer.train()
    assert trainer.model.transformer.h[0].attn.c_attn.weight.dtype == torch.bfloat16
    assert logged(trainer, "skipped_steps") == [0, 0]


def test_private_overrides_match_the_installed_trainer():
    """The Trainer internals MixprecTrainer relies on, read from the installed transformers
    and accelerate: if one changes, this names it (the behaviour tests above would fail too,
    less clearly)."""
    from accelerate import Accelerator

    trainer = transformers.Trainer
    for name, params in (
        ("_clip_grad_norm", ["self", "model"]),
        ("_get_grad_norm", ["self", "model", "grad_norm"]),
        ("_save", ["self", "output_dir", "state_dict"]),
    ):
        assert list(inspect.signature(getattr(trainer, name)).parameters) == params, name
    loop = inspect.getsource(trainer._run_epoch)
    for call in (
        "grad_norm = self._clip_grad_norm(model)",
        "grad_norm = self._get_grad_norm(model, grad_norm=grad_norm)",
        "self.optimizer.step()",
        "if not self.accelerator.optimizer_step_was_skipped:",
        "self.lr_scheduler.step()",
    ):
        assert call in loop, call
    assert "self._save(output_dir)" in inspect.getsource(trainer.save_model)
    assert "save_pretrained(output_dir, state_dict=state_dict" in inspect.getsource(trainer._save)
    assert "self.accelerator.backward(loss, **kwargs)" in inspect.getsource(trainer.training_step)
    assert "self.scaler.scale(loss).backward(**kwargs)" in inspect.getsource(Accelerator.backward)


def test_the_best_model_loaded_at_the_end_keeps_its_float32_masters(tmp_path):
    """``load_best_model_at_end``: the Trainer loads the best checkpoint's weights (the
    float32 masters ``_save`` wrote) into the 16-bit model; the masters take them whole,
    not their rounding, so ``save_model()`` then writes the best checkpoint's values."""
    from safetensors.torch import load_file

    args = arguments(
        tmp_path / "run", max_steps=4, eval_strategy="steps", eval_steps=2, save_strategy="steps",
        save_steps=2, load_best_model_at_end=True, metric_for_best_model="loss",
    )  # fmt: skip
    data = dataset()
    trainer = MixprecTrainer(model=build(), args=args, train_dataset=data,
                             eval_dataset=data[:8], policy="mixed_bfloat16")  # fmt: skip
    trainer.train()
    best = load_file(Path(trainer.state.best_model_checkpoint) / "model.safetensors")
    masters = float32_values(trainer)
    attn = "transformer.h.0.attn.c_attn.weight"
    assert best[attn].dtype == torch.float32
    assert not torch.equal(best[attn].bfloat16().float(), best[attn])  # digits to keep
    for name, value in masters.items():
        if name in best:
            assert torch.equal(value, best[name]), name


def test_a_resumed_run_saves_its_frozen_weights_float32_as_an_uninterrupted_one(tmp_path):
    """Frozen 16-bit weights (PEFT-style) have no master: a save writes their kept float32
    values. The resume's load into the 16-bit weights made those stale, and the resumed
    run's save wrote bfloat16 roundings of the frozen weights."""
    from safetensors.torch import load_file

    def frozen_model() -> nn.Module:
        model = build()
        for name, p in model.named_parameters():
            p.requires_grad = name.startswith("transformer.h.1.mlp")
        return model

    original = weights(frozen_model())
    saves = {}
    for run, resume in (("full", None), ("resumed", str(tmp_path / "full" / "checkpoint-2"))):
        trainer = MixprecTrainer(
            model=frozen_model(),
            args=arguments(tmp_path / run, max_steps=4, save_strategy="steps", save_steps=2),
            train_dataset=dataset(),
            policy="mixed_bfloat16",
        )
        trainer.train(resume_from_checkpoint=resume)
        trainer.save_model(str(tmp_path / f"{run}-final"))
        saves[run] = load_file(tmp_path / f"{run}-final" / "model.safetensors")
    frozen = "transformer.h.0.attn.c_attn.weight"
    assert torch.equal(saves["full"][frozen], original[frozen])
    assert torch.equal(saves["resumed"][frozen], original[frozen])
    assert saves["full"].keys() == saves["resumed"].keys()
    for key, value in saves["full"].items():
        assert torch.equal(saves["resumed"][key], value), key


def test_each_train_starts_from_the_loss_scaler_as_given(tmp_path):
    """One scaler object served every train() (model_init trials): the second started
    from the first's scale and counters (scales 4096... against 1024...)."""
    trainer = MixprecTrainer(
        model_init=build,
        args=arguments(tmp_path / "run", max_steps=4),
        train_dataset=dataset(),
        policy="mixed_float16",
        loss_scaler=mp.DynamicLossScaler(2.0**10, growth_interval=2),
    )
    trainer.train()
    first = logged(trainer, "loss_scale")
    trainer.train()
    assert logged(trainer, "loss_scale")[-4:] == first == [1024.0, 2048.0, 2048.0, 4096.0]


def test_activation_checkpointing_recomputes_as_the_forward_did(tmp_path: Path) -> None:
    # torch's recompute ran the float32 functions in bfloat16 and failed in the backward
    # ("Recomputed values ... have different metadata"): the layers now checkpoint through
    # mp.activation_checkpoint.
    data = dataset(32)

    def losses(**overrides: Any) -> list[float]:
        trainer = MixprecTrainer(
            model=build(), args=arguments(tmp_path / "gc", max_steps=4, **overrides),
            train_dataset=data, policy="mixed_bfloat16",
        )  # fmt: skip
        trainer.train()
        return logged(trainer, "loss")

    assert losses(gradient_checkpointing=True) == losses()
    # The arguments are left as given (a function in them broke report_to's JSON, and
    # torch_compile takes a context_fn for selective checkpointing).
    args = arguments(tmp_path / "gc", max_steps=1, gradient_checkpointing=True)
    MixprecTrainer(model=build(), args=args, train_dataset=data).train()
    assert args.to_json_string() and not args.gradient_checkpointing_kwargs
    # The reentrant variant takes no context_fn: it trains, and says what its recompute does
    # (once in a process: the flag is reset for this test).
    import mixprec.recompute

    mixprec.recompute._SAID_REENTRANT.clear()
    with pytest.warns(UserWarning, match="use_reentrant=True inside a prepared model"):
        reentrant = losses(
            gradient_checkpointing=True, gradient_checkpointing_kwargs={"use_reentrant": True}
        )
    assert all(math.isfinite(v) for v in reentrant)
