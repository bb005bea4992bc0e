"""The accelerate recipe of docs/integrations.md: ``auto_mixed_precision`` and
``LossScaleOptimizer`` with ``Accelerator()`` (whose own ``mixed_precision`` stays off).

accelerate has no plugin API, so the recipe is the user's loop: prepare the model and the data
with the Accelerator; the ``LossScaleOptimizer`` scales, unscales, clips, skips and keeps the
float32 masters; the scheduler steps when the optimizer step was applied;
``register_for_checkpointing`` puts masters and scaler in ``save_state``.

A tiny GPT-2 (2 layers, width 32, vocabulary 100) built from its config with seeded random
weights, on the CPU. Skipped where ``accelerate`` or ``transformers`` is not installed.
"""

from __future__ import annotations

import linecache
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader

import mixprec as mp

accelerate = pytest.importorskip("accelerate")
transformers = pytest.importorskip("transformers")

from accelerate.state import AcceleratorState  # noqa: E402

from mixprec._save_guard import guard_saves  # noqa: E402
from tests._tiny_gpt2 import counting_rows, tiny_gpt2  # noqa: E402

VOCAB, SEQ, BATCH = 100, 16, 4
LR = 3e-3

# Max per-step |loss - float32 loss| over 24 steps (losses fall from ~4.6 to ~4.2-4.3).
# Measured on the 2-core development CPU (AMD EPYC, AVX2), torch 2.13, accelerate 1.15:
# data seed 0 (used here) bfloat16 6.4e-4, float16 4.8e-5; seeds 0-4 at most 2.2e-3 and
# 8.3e-4. The bounds are ~3x the largest; bfloat16 keeps 8 bits of mantissa, float16 11.
TOLERANCE = {"mixed_bfloat16": 6.5e-3, "mixed_float16": 2.5e-3}


@pytest.fixture(autouse=True)
def _fresh_accelerate(monkeypatch):
    """No Hub, no mixed precision from the environment, and a new AcceleratorState per test
    (it is a process-wide singleton)."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.delenv("ACCELERATE_MIXED_PRECISION", raising=False)
    AcceleratorState._reset_state(reset_partial_state=True)
    yield
    AcceleratorState._reset_state(reset_partial_state=True)


def build() -> nn.Module:
    return tiny_gpt2(VOCAB, SEQ)


def dataset(n: int = 96, seed: int = 0) -> list[dict[str, torch.Tensor]]:
    return counting_rows(n, VOCAB, SEQ, seed)


def linear_decay(optimizer: torch.optim.Optimizer, steps: int) -> torch.optim.lr_scheduler.LambdaLR:
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda i: max(0.0, 1 - i / steps))


class Run:
    """The recipe, as docs/integrations.md writes it, with ``policy``; or, with ``policy=None``,
    accelerate's own float32 loop (everything prepared, ``accelerator.backward``,
    ``accelerator.clip_grad_norm_``)."""

    def __init__(
        self,
        policy: str | None,
        steps: int = 24,
        loss_scaler: mp.LossScaler | None = None,
        accumulation: int = 1,
    ) -> None:
        # No mixed_precision= (mixprec's); gradient_accumulation_steps only for accumulate().
        self.accelerator = accelerate.Accelerator(
            cpu=True, gradient_accumulation_steps=accumulation
        )
        model = build()
        # In order: resumable by skipping batches, and the same rows per step whatever the
        # micro-batch size.
        loader = DataLoader(dataset(), batch_size=BATCH // accumulation)
        self.policy = policy
        if policy is None:
            inner = torch.optim.AdamW(model.parameters(), lr=LR)
            self.model, self.optimizer, self.loader = self.accelerator.prepare(model, inner, loader)
        else:
            model = mp.auto_mixed_precision(model.to(self.accelerator.device), policy, "O2")
            self.optimizer = mp.LossScaleOptimizer(
                torch.optim.AdamW(model.parameters(), lr=LR),
                loss_scaler=loss_scaler,
                max_grad_norm=1.0,
                accumulation_steps=accumulation,
            )
            self.model, self.loader = self.accelerator.prepare(model, loader)
        self.scheduler = linear_decay(self.optimizer, steps)
        self.losses: list[float] = []
        self.results: list[mp.StepResult] = []

    def train(self, batches: int, skip: int = 0) -> None:
        loader = self.accelerator.skip_first_batches(self.loader, skip) if skip else self.loader
        for _, batch in zip(range(batches), loader, strict=False):
            loss = self.model(**batch).loss
            self.losses.append(loss.item())
            if self.policy is None:
                self.accelerator.backward(loss)
                self.accelerator.clip_grad_norm_(self.model.parameters(), 1.0)
                self.optimizer.step()
                self.scheduler.step()
            else:
                # accumulate(): DDP's no_sync on all but the last micro-batch of a step.
                with self.accelerator.accumulate(self.model):
                    self.optimizer.backward(loss)  # loss * scale / accumulation_steps
                    result = self.optimizer.step()  # unscale, check, clip, apply or skip
                    self.results.append(result)
                    if result.applied:
                        self.scheduler.step()
                    self.optimizer.zero_grad()  # kept between micro-batches
                continue
            self.optimizer.zero_grad()

    def float32_values(self) -> dict[str, torch.Tensor]:
        """The master of each 16-bit parameter, else the parameter itself."""
        assert isinstance(self.optimizer, mp.LossScaleOptimizer)
        masters = {id(h): m for h, m in self.optimizer.master_weights()}
        model = self.accelerator.unwrap_model(self.model)
        return {n: masters.get(id(p), p).detach().clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("policy", ["mixed_bfloat16", "mixed_float16"])
def test_recipe_trains_like_float32(policy):
    reference = Run(None)
    reference.train(24)
    run = Run(policy)
    assert run.accelerator.mixed_precision == "no"
    compute = mp.get_policy(policy).compute_dtype
    seen: set[torch.dtype] = set()
    model = run.accelerator.unwrap_model(run.model)
    model.transformer.h[0].attn.c_attn.register_forward_hook(lambda m, i, o: seen.add(o.dtype))
    run.train(24)

    assert seen == {compute}
    assert model.transformer.h[0].attn.c_attn.weight.dtype == compute
    assert model.transformer.h[0].ln_1.weight.dtype == torch.float32
    assert all(m.dtype == torch.float32 for _, m in run.optimizer.master_weights())
    assert all(r.applied for r in run.results)
    assert run.scheduler.last_epoch == 24
    assert run.losses[-1] < run.losses[0] - 0.2, run.losses  # measured: 4.61 -> 4.31
    diffs = [abs(a - b) for a, b in zip(run.losses, reference.losses, strict=True)]
    assert max(diffs) < TOLERANCE[policy], [f"{d:.1e}" for d in diffs]


def test_recipe_checkpoint_resumes_masters_and_scale(tmp_path: Path):
    """``register_for_checkpointing(optimizer, scheduler)``: ``save_state`` after 4 steps,
    ``load_state`` in a fresh setup, 4 more steps: bit for bit the run that did not stop,
    the float16 scale (grown from 2**10 to 2**12 by step 4) included."""

    def scaler() -> mp.DynamicLossScaler:
        return mp.DynamicLossScaler(2.0**10, growth_interval=2)

    full = Run("mixed_float16", steps=8, loss_scaler=scaler())
    full.accelerator.register_for_checkpointing(full.optimizer, full.scheduler)
    full.train(4)
    full.accelerator.save_state(str(tmp_path / "state"))
    full.train(4, skip=4)
    assert [r.scale for r in full.results] == [2.0**10] * 2 + [2.0**11] * 2 + [2.0**12] * 2 + [
        2.0**13
    ] * 2

    AcceleratorState._reset_state(reset_partial_state=True)
    resumed = Run("mixed_float16", steps=8, loss_scaler=scaler())
    resumed.accelerator.register_for_checkpointing(resumed.optimizer, resumed.scheduler)
    resumed.accelerator.load_state(str(tmp_path / "state"))
    assert resumed.optimizer.loss_scaler.get_scale() == 2.0**12
    resumed.train(4, skip=4)

    assert resumed.losses == full.losses[4:]
    assert [r.scale for r in resumed.results] == [r.scale for r in full.results[4:]]
    for name, value in resumed.float32_values().items():
        assert torch.equal(value, full.float32_values()[name]), name
    assert resumed.scheduler.get_last_lr() == full.scheduler.get_last_lr()


def test_recipe_accumulates_like_the_doubled_batch():
    """``LossScaleOptimizer(accumulation_steps=2)`` over micro-batches of 2 (inside
    ``accelerator.accumulate``) against batches of 4: one applied step per 2 micro-batches,
    and the same training. Measured: at most 2.8e-4 apart (data seeds 0-4: 4.8e-4; the bound
    is ~3x that): the micro-batches' 16-bit gradients are summed in bfloat16, and their
    matmuls round differently from the whole batch's."""
    whole = Run("mixed_bfloat16", steps=12)
    whole.train(12)
    AcceleratorState._reset_state(reset_partial_state=True)
    accumulated = Run("mixed_bfloat16", steps=12, accumulation=2)
    accumulated.train(24)

    assert [r.accumulating for r in accumulated.results] == [True, False] * 12
    assert sum(r.applied for r in accumulated.results) == 12
    assert accumulated.scheduler.last_epoch == 12
    per_step = [
        (a + b) / 2 for a, b in zip(accumulated.losses[::2], accumulated.losses[1::2], strict=True)
    ]
    diffs = [abs(a - b) for a, b in zip(per_step, whole.losses, strict=True)]
    assert max(diffs) < 1.5e-3, [f"{d:.1e}" for d in diffs]


# -- saves that lose the masters, and the optimizer given to prepare -------------------------


def _tiny_run(register: bool, guard: bool = False) -> Any:
    """The recipe on a tiny float16 O2 model, one step; ``register``: the LossScaleOptimizer
    is registered for checkpointing; ``guard``: the save guard is installed by hand."""
    accelerator = accelerate.Accelerator(cpu=True)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.LayerNorm(8), nn.Linear(8, 2))
    model = mp.auto_mixed_precision(model, "mixed_float16", "O2")
    if guard:
        guard_saves(model)
    scaler = mp.DynamicLossScaler(2.0**10)
    optimizer = mp.LossScaleOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), scaler)
    model = accelerator.prepare(model)
    if register:
        accelerator.register_for_checkpointing(optimizer)
    optimizer.backward(model(torch.randn(4, 8)).float().sum())
    assert optimizer.step().applied
    return accelerator


def _save_state(accelerator: Any, path: Path) -> list[tuple[str, str]]:
    """The warnings of ``save_state``: (the line they point at, message)."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        accelerator.save_state(str(path))
    return [(linecache.getline(w.filename, w.lineno).strip(), str(w.message)) for w in caught]


def _check_lossy_save_warns_once(accelerator: Any, tmp_path: Path) -> None:
    ((line, message),) = _save_state(accelerator, tmp_path / "a")
    assert line == "accelerator.save_state(str(path))"  # the user's call
    assert message.startswith(
        "accelerator.save_state() saves this mixprec model without the float32 master weights "
        "and the loss scale, which its LossScaleOptimizer holds: call "
        "accelerator.register_for_checkpointing(optimizer)"
    )
    assert _save_state(accelerator, tmp_path / "b") == []  # once per model


def test_save_state_without_the_optimizer_warns_once_with_the_guard(tmp_path):
    """The model's save guard (``guard_saves``), installed by hand."""
    accelerator = _tiny_run(register=False, guard=True)
    _check_lossy_save_warns_once(accelerator, tmp_path)


def test_save_state_without_the_optimizer_warns_once(tmp_path):
    accelerator = _tiny_run(register=False)
    _check_lossy_save_warns_once(accelerator, tmp_path)


def test_save_state_with_the_optimizer_registered_does_not_warn(tmp_path):
    """The recipe's save (its resume is test_recipe_checkpoint_resumes_masters_and_scale)."""
    accelerator = _tiny_run(register=True, guard=True)
    assert _save_state(accelerator, tmp_path / "a") == []


def test_prepare_refuses_a_loss_scale_optimizer():
    """accelerate's wrapper would hide ``step()``'s ``StepResult`` (``None``: the recipe's
    ``result.applied`` fails) and let ``clip_grad_norm_`` clip the scaled 16-bit gradients."""
    accelerator = accelerate.Accelerator(cpu=True)
    model = mp.auto_mixed_precision(nn.Linear(8, 2), "mixed_bfloat16", "O2")
    optimizer = mp.LossScaleOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    with pytest.raises(mp.ArgumentError, match=r"accelerator\.prepare\(\) got a mixprec "):
        accelerator.prepare(model, optimizer)
