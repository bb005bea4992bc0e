"""What the two doctors (the 16-bit and the float8 one) share: taking the float32 model
they diagnose, and writing reports as JSON."""

from __future__ import annotations

import json
import math
import warnings
from typing import Any

from torch import nn

from mixprec.levels import applied


def float32_model(model: Any, who: str) -> nn.Module:
    """The float32 model behind ``model``: the module inside a ``torch.compile`` wrapper
    (the doctors' hooks run eagerly, with a warning); refused if already prepared."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"{who}(model=...) needs an nn.Module, got {type(model).__name__}")
    module: nn.Module = model
    original = getattr(module, "_orig_mod", None)  # torch.compile's OptimizedModule
    if isinstance(original, nn.Module):
        warnings.warn(
            f"{who} runs the model eagerly (its hooks do not compile): it uses the module "
            "inside torch.compile's wrapper; the figures are eager mode's",
            UserWarning,
            stacklevel=3,
        )
        module = original
    if applied(module) is not None:
        raise ValueError(f"{who} needs the float32 model, before auto_mixed_precision")
    return module


def _json_safe(value: Any) -> Any:
    """JSON has no inf/NaN: they become strings ("inf", "nan")."""
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, dict):
        return {k: _json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_json_safe(v) for v in value]
    return value


def to_json(data: dict[str, Any], **kwargs: Any) -> str:
    return json.dumps(_json_safe(data), **kwargs)
