"""Floating dtype names and aliases, parsing them, and a tensor's largest finite value
against a dtype's range."""

from __future__ import annotations

import difflib

import torch

from mixprec._dist import is_dtensor
from mixprec._errors import ArgumentError

#: The dtypes a policy may use, by canonical name.
CANONICAL: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
}

_ALIASES: dict[str, str] = {
    "f32": "float32",
    "fp32": "float32",
    "float": "float32",
    "single": "float32",
    "f16": "float16",
    "fp16": "float16",
    "half": "float16",
    "bf16": "bfloat16",
}

#: 16-bit floating dtypes: the ones that need float32 master weights and range checks.
HALF_DTYPES: frozenset[torch.dtype] = frozenset({torch.float16, torch.bfloat16})


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.bfloat16`` -> ``"bfloat16"``."""
    return str(dtype).removeprefix("torch.")


def closest(word: str, choices: list[str]) -> str | None:
    """The closest spelling among ``choices``, for error messages."""
    found = difflib.get_close_matches(word, choices, n=1, cutoff=0.4)
    return found[0] if found else None


def parse_dtype(value: str | torch.dtype, *, argument: str = "dtype") -> torch.dtype:
    """Turn ``"bf16"``, ``"torch.float16"`` or ``torch.float32`` into a supported dtype.

    Raises ``ValueError`` naming ``argument``, the value received and the valid names.
    """
    if isinstance(value, torch.dtype):
        if value in CANONICAL.values():
            return value
        raise ArgumentError(
            f"{argument}={value!r} is not supported; valid dtypes: {', '.join(CANONICAL)}"
        )
    if not isinstance(value, str):
        raise ArgumentError(
            f"{argument} must be a str or torch.dtype, got {type(value).__name__}: {value!r}"
        )
    key = value.strip().lower().removeprefix("torch.")
    key = _ALIASES.get(key, key)
    if key in CANONICAL:
        return CANONICAL[key]
    valid = list(CANONICAL) + list(_ALIASES)
    hint = closest(key, valid)
    raise ArgumentError(
        f"{argument}={value!r} is not a known dtype; valid: {', '.join(valid)}"
        + (f" (did you mean {hint!r}?)" if hint else "")
    )


def finfo_max(dtype: torch.dtype) -> float:
    return float(torch.finfo(dtype).max)


def finite_peak(t: torch.Tensor) -> float:
    """The largest finite |value| of ``t`` (0.0 for an empty tensor, one on the meta device,
    or a DTensor, whose values are not all here): one reduction, no copy of the finite
    values. float8 is read in float32 (it has no ``isfinite``)."""
    if not t.numel() or t.is_meta or is_dtensor(t):
        return 0.0
    values = t.detach()
    if values.element_size() == 1:  # float8
        values = values.float()
    return float(torch.where(torch.isfinite(values), values.abs(), 0).amax())
