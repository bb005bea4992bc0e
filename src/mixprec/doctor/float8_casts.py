"""The float8 casts torchao's Float8Linear makes, redone and measured: ``cast_stats`` casts a
tensor as torchao does (its own ``tensor_to_scale`` and ``to_fp8_saturated``) and counts the
values it clips, flushes to 0 or leaves subnormal; ``recipe_casts`` reads the casts of a
recipe from its ``Float8LinearConfig``. torchao is imported when a cast is measured."""

from __future__ import annotations

import importlib
import math
from dataclasses import dataclass
from typing import Any

import torch

from mixprec._dtypes import dtype_name
from mixprec._errors import ArgumentError
from mixprec.float8 import torchao_float8
from mixprec.policy import parse_float8_recipe

__all__ = [
    "OPERANDS",
    "CastStats",
    "Float8Cast",
    "cast_stats",
    "config_casts",
    "layer_casts",
    "recipe_casts",
]

#: The casts a float8 Linear makes: (operand, gemm, ``Float8LinearConfig`` attribute, torchao's
#: ``axiswise_dim`` for that cast). Operands are 2-D as torchao casts them: the input and the
#: output gradient flattened to (rows, features), the weight transposed to (in, out).
_CASTS: tuple[tuple[str, str, str, int], ...] = (
    ("input", "output", "cast_config_input", -1),
    ("weight", "output", "cast_config_weight", 0),
    ("grad_output", "grad_input", "cast_config_grad_output", -1),
    ("weight", "grad_input", "cast_config_weight_for_grad_input", -1),
    ("input", "grad_weight", "cast_config_input_for_grad_weight", 0),
    ("grad_output", "grad_weight", "cast_config_grad_output_for_grad_weight", 0),
)
#: What one scale covers under axiswise ("rowwise") scaling, by (operand, axiswise_dim).
_AXIS_NAMES = {
    ("input", -1): "per row",
    ("input", 0): "per in-feature",
    ("weight", 0): "per out-feature",
    ("weight", -1): "per in-feature",
    ("grad_output", -1): "per row",
    ("grad_output", 0): "per out-feature",
}
#: The tensors a float8 Linear casts, in the order its report lists them.
OPERANDS = ("input", "weight", "grad_output")


@dataclass(frozen=True)
class CastStats:
    """What one float8 cast does to a tensor.

    ``amax``: max |value| over the whole tensor (inf/NaN included, as torchao computes it).
    ``scale``: the smallest scale, which belongs to the row (or column) holding ``amax``;
    ``scale_max`` the largest; equal under tensorwise scaling. ``saturated``: fraction of the
    finite values the cast clips at the format's max. ``flushed``: fraction of the finite
    non-zero values that become 0; ``subnormal``: ... that become subnormal (fewer significant
    bits than normal values). ``nonfinite``: count of inf/NaN values.
    """

    amax: float
    scale: float
    scale_max: float
    saturated: float
    flushed: float
    subnormal: float
    nonfinite: int

    @property
    def underflow(self) -> float:
        """Fraction of the non-zero values that flush to 0 or land on a subnormal."""
        return self.flushed + self.subnormal


def _torchao_module(name: str) -> Any:
    torchao_float8()  # the ImportError that says how to install torchao
    return importlib.import_module(name)


def cast_stats(
    tensor: torch.Tensor,
    float8_dtype: torch.dtype,
    *,
    axis: int | None = None,
    round_scales_to_power_of_2: bool = False,
    scale: float | torch.Tensor | None = None,
) -> CastStats:
    """Cast ``tensor`` to ``float8_dtype`` as torchao does and measure the damage.

    ``axis``: ``None`` for one scale over the tensor (tensorwise); else the dim torchao
    reduces the amax over (``axiswise_dim``: -1 gives one scale per row of a 2-D tensor).
    ``scale``: use this scale instead of torchao's dynamic ``max_of_format / amax``.
    """
    utils = _torchao_module("torchao.float8.float8_utils")
    granularity = _torchao_module("torchao.float8.config").ScalingGranularity
    if float8_dtype not in utils.FP8_TYPES:
        raise ArgumentError(
            f"float8_dtype={float8_dtype!r} is not a float8 dtype; valid: "
            + ", ".join(sorted(dtype_name(d) for d in utils.FP8_TYPES))
        )
    x = tensor.detach()
    if scale is None:
        scale_t = utils.tensor_to_scale(
            x,
            float8_dtype,
            scaling_granularity=granularity.TENSORWISE if axis is None else granularity.AXISWISE,
            axiswise_dim=axis,
            round_scales_to_power_of_2=round_scales_to_power_of_2,
        )
    else:
        scale_t = torch.as_tensor(scale, dtype=torch.float32, device=x.device)
    # Exactly torchao's cast (_ToFloat8ConstrFunc): scale in float32, then a saturating cast.
    scaled = x.to(torch.float32) * scale_t
    cast = utils.to_fp8_saturated(scaled, float8_dtype).to(torch.float32)
    info = torch.finfo(float8_dtype)
    # Clipped, not rounded: beyond max plus half a unit in the last place at max (E4M3: 464,
    # E5M2: 61440). Values up to there round to max anyway; and the float32 rounding of a
    # dynamic scale can put the amax itself a hair above max, which is not a clip.
    clip = info.max + info.eps * 2.0 ** math.floor(math.log2(info.max)) / 2
    finite = torch.isfinite(x)
    nonzero = finite & (x != 0)
    n_finite, n_nonzero = int(finite.sum()), int(nonzero.sum())
    saturated = int(((scaled.abs() > clip) & finite).sum())
    flushed = int(((cast == 0) & nonzero).sum())
    subnormal = int(((cast != 0) & (cast.abs() < info.tiny) & nonzero).sum())
    amax = float(x.abs().max()) if x.numel() else 0.0
    return CastStats(
        amax=amax,
        scale=float(scale_t.min()),
        scale_max=float(scale_t.max()),
        saturated=saturated / n_finite if n_finite else 0.0,
        flushed=flushed / n_nonzero if n_nonzero else 0.0,
        subnormal=subnormal / n_nonzero if n_nonzero else 0.0,
        nonfinite=x.numel() - n_finite,
    )


@dataclass(frozen=True)
class Float8Cast:
    """One cast a float8 Linear makes: which operand, for which of its three matmuls
    (``output``, ``grad_input``, ``grad_weight``), to which dtype, at which granularity
    (``tensorwise``, or what one rowwise scale covers), and its ``CastStats``."""

    operand: str
    gemm: str
    dtype: str
    granularity: str
    stats: CastStats


def recipe_casts(recipe: str) -> list[tuple[str, str, torch.dtype, int | None, bool]]:
    """The float8 casts of torchao's ``recipe``, read from its ``Float8LinearConfig``:
    ``(operand, gemm, dtype, axis or None, round_scales_to_power_of_2)``; operands a gemm
    takes in high precision (``rowwise_with_gw_hp``'s weight gradient) are left out."""
    recipe = parse_float8_recipe(recipe, argument="recipe")
    return config_casts(torchao_float8().Float8LinearConfig.from_recipe_name(recipe))


def config_casts(config: Any) -> list[tuple[str, str, torch.dtype, int | None, bool]]:
    """The float8 casts a ``Float8LinearConfig`` makes, as ``recipe_casts`` lists them."""
    kinds = _torchao_module("torchao.float8.config")
    casts = []
    for operand, gemm, attribute, axiswise_dim in _CASTS:
        cast = getattr(config, attribute)
        if cast.scaling_type is kinds.ScalingType.DISABLED:
            continue
        axiswise = cast.scaling_granularity is kinds.ScalingGranularity.AXISWISE
        axis = axiswise_dim if axiswise else None
        power_of_2 = bool(config.round_scales_to_power_of_2)
        casts.append((operand, gemm, cast.target_dtype, axis, power_of_2))
    return casts


def _operand_2d(operand: str, tensors: dict[str, torch.Tensor]) -> torch.Tensor:
    t = tensors[operand]
    return t.t() if operand == "weight" else t.reshape(-1, t.shape[-1])


def layer_casts(config: Any, tensors: dict[str, torch.Tensor]) -> list[Float8Cast]:
    """Every float8 cast of torchao's ``config`` on the layer's recorded operands. A
    tensorwise cast that two gemms share (same operand, same dtype) is measured once, under
    the first."""
    out: list[Float8Cast] = []
    seen: set[tuple[str, torch.dtype, int | None]] = set()
    for operand, gemm, dtype, axis, power_of_2 in config_casts(config):
        if operand not in tensors or (operand, dtype, axis) in seen:
            continue
        seen.add((operand, dtype, axis))
        stats = cast_stats(
            _operand_2d(operand, tensors), dtype, axis=axis, round_scales_to_power_of_2=power_of_2
        )
        granularity = "tensorwise" if axis is None else _AXIS_NAMES[(operand, axis)]
        out.append(Float8Cast(operand, gemm, dtype_name(dtype), granularity, stats))
    return out
