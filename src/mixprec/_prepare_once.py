"""A model is prepared once: the rule of every caller that prepares the model it is given.

``build_train_step``, ``MixprecTrainer`` and the Lightning plugins call
``auto_mixed_precision`` on a float32 model. Given a model it already prepared (a second
Trainer or ``fit`` over one model, a model the user prepared first), a caller asking for the
same preparation uses it as it is; one asking for another is refused with an
``ArgumentError`` naming both, since ``auto_mixed_precision`` changes a model only once.
What a model was prepared with is ``levels.applied(model)``.
"""

from __future__ import annotations

from collections.abc import Iterable

from torch import nn

from mixprec._errors import ArgumentError
from mixprec._plan_apply import PlanLike
from mixprec.keep import KeepEntry, declared_float32, keep_list, kept_modules
from mixprec.levels import applied, resolve_level
from mixprec.policy import PolicyLike, get_policy

__all__ = ["needs_preparation"]


def needs_preparation(
    model: nn.Module,
    policy: PolicyLike = None,
    level: str | None = None,
    *,
    where: str,
    amp_level: str | None = None,
    keep_float32: Iterable[KeepEntry] = (),
    plan: PlanLike | None = None,
    subject: str = "the model",
    takes_amp_level: bool = True,
) -> bool:
    """Whether ``model`` still needs ``auto_mixed_precision``: ``True`` when it is not
    prepared, ``False`` when it was prepared as asked; prepared otherwise, ``ArgumentError``
    naming both, after ``where`` (the caller and the arguments it got) and ``subject``.

    What is asked: ``policy`` (a ``Policy`` or name), ``level`` (mixprec's: O3 without
    master weights), ``amp_level`` (MindSpore's: its O3 keeps float32 masters), the modules
    ``keep_float32`` resolves to, and ``plan``. ``None``, ``level="auto"`` and an empty
    ``keep_float32`` ask nothing: whatever the model has is accepted. A caller that has no
    ``amp_level`` argument (``takes_amp_level=False``) is not told to pass one.
    """
    done = applied(model)
    if done is None:
        return True
    was = f"{where}: {subject} was already prepared"
    if plan is not None and done.plan != plan:
        prepared = "another plan" if done.plan is not None else f"policy {done.policy.name}"
        raise ArgumentError(f"{was} with {prepared}; build the model again and give the plan once")
    has = (done.level, done.o3_masters)
    asked: list[bool] = []  # one entry per thing asked: whether the model has it
    if policy is not None:
        asked.append(get_policy(policy) == done.policy)
    if level is not None and level != "auto":
        asked.append((resolve_level(level, done.policy), False) == has)
    if amp_level is not None:
        key = str(amp_level).strip().upper()
        asked.append((key, key == "O3") == has)
    if not all(asked):
        kw, masters = ("amp_level", " with float32 masters") if done.o3_masters else ("level", "")
        use = f"pass policy={done.policy.name!r}, {kw}={done.level!r} to use it as it is, or "
        if done.o3_masters and not takes_amp_level:
            use = "MindSpore's amp_level='O3', which this takes no argument for, made it; "
        raise ArgumentError(
            f"{was} with policy {done.policy.name}, level {done.level}{masters}; a model is "
            f"prepared once: {use}build the model again"
        )
    keep = keep_list(keep_float32)
    if keep:  # with the modules a Hugging Face model declares float32, as preparation added
        declared = declared_float32(model, done.policy.compute_dtype) if done.level != "O0" else []
        keep = (*keep, *declared)
    wanted = tuple(sorted(kept_modules(model, keep))) if keep else done.keep_float32
    if wanted != done.keep_float32:
        raise ArgumentError(
            f"{was} keeping {list(done.keep_float32)} in float32, and keep_float32 asks for "
            f"{list(wanted)}; a model is prepared once: leave keep_float32 out to use it as "
            "it is, or build the model again"
        )
    return False
