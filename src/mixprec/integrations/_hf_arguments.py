"""What ``MixprecTrainer`` refuses in ``TrainingArguments``: the arguments that turn on a
second mixed precision system (accelerate's autocast and scaler, DeepSpeed's)."""

from __future__ import annotations

import os

from transformers import TrainingArguments

from mixprec._errors import ArgumentError
from mixprec.policy import Policy

__all__ = ["refuse_second_mixed_precision"]


def refuse_second_mixed_precision(args: TrainingArguments | None, policy: Policy) -> None:
    """accelerate's mixed precision (autocast in the forward, its own GradScaler) on top of
    mixprec's would cast twice and scale twice: refuse the arguments that turn it on."""
    ours = f"MixprecTrainer(policy={policy.name!r})"
    fix = "MixprecTrainer does the mixed precision"
    if args is not None:
        for flag in ("bf16", "fp16"):
            if getattr(args, flag, False):
                raise ArgumentError(
                    f"TrainingArguments({flag}=True) with {ours}: two mixed precision systems "
                    f"at once (accelerate's autocast and mixprec's policy); drop {flag}=True, "
                    f"{fix}"
                )
        for flag in ("bf16_full_eval", "fp16_full_eval"):
            if getattr(args, flag, False):
                raise ArgumentError(
                    f"TrainingArguments({flag}=True) with {ours}: it casts the whole prepared "
                    "model for evaluation, float32 modules and all; drop it (evaluation runs "
                    "with the policy's dtypes)"
                )
        if getattr(args, "deepspeed", None):
            raise ArgumentError(
                f"TrainingArguments(deepspeed={args.deepspeed!r}) with {ours}: DeepSpeed brings "
                "its own mixed precision and optimizer wrapper, which MixprecTrainer does not "
                "support; use transformers.Trainer with DeepSpeed's bf16/fp16 settings"
            )
    # TrainingArguments reads ACCELERATE_MIXED_PRECISION when it is built (args.mixed_precision);
    # `accelerate launch --mixed_precision` and `accelerate config` set it.
    env = os.environ.get("ACCELERATE_MIXED_PRECISION", "no")
    read = getattr(args, "mixed_precision", "no") if args is not None else "no"
    for value, note in ((env, ""), (read, ", which these TrainingArguments read when built")):
        if str(value).strip().lower() not in ("", "no"):
            raise ArgumentError(
                f"ACCELERATE_MIXED_PRECISION={value!r}{note} (accelerate's mixed precision, as "
                f"`accelerate launch --mixed_precision` sets it) with {ours}: two mixed "
                "precision systems at once; unset it or set it to 'no' (then build the "
                f"TrainingArguments), {fix}"
            )
