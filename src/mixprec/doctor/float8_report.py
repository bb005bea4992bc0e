"""What the float8 doctor reports: ``Float8LayerReport`` (one converted Linear layer: its
casts and its own error against bfloat16) and ``Float8Report`` (every layer, the layers to
keep in bfloat16 and the advice), as text, a dict or JSON."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from mixprec.doctor._common import to_json
from mixprec.doctor.float8_casts import Float8Cast

__all__ = ["Float8LayerReport", "Float8Report"]


@dataclass
class Float8LayerReport:
    """One converted Linear layer. ``shape``: its weight's (out_features, in_features).

    ``amax_*``, ``scale_*``: of the cast each operand gets in the forward matmul (the output
    gradient: in the input-gradient matmul); under rowwise recipes ``scale_*`` is the smallest
    row scale. ``saturated_*``, ``flushed_*``, ``subnormal_*``: the worst over the operand's
    casts (see ``CastStats``). ``*_error``: ``||float8 - bfloat16|| / ||bfloat16||`` of the
    layer replayed on the same tensors; ``None`` where not computed (no gradient reached the
    layer, its input needs none, or its weight is frozen). ``casts``: every cast in detail.
    ``reasons``: why float8 hurts it (empty: it does not).
    """

    name: str
    shape: tuple[int, int]
    amax_input: float
    amax_weight: float
    amax_grad_output: float | None
    scale_input: float
    scale_weight: float
    scale_grad_output: float | None
    saturated_input: float
    saturated_weight: float
    saturated_grad_output: float | None
    flushed_input: float
    flushed_weight: float
    flushed_grad_output: float | None
    subnormal_input: float
    subnormal_weight: float
    subnormal_grad_output: float | None
    output_error: float
    grad_input_error: float | None
    grad_weight_error: float | None
    casts: list[Float8Cast] = field(default_factory=list)
    reasons: list[str] = field(default_factory=list)

    @property
    def hurts(self) -> bool:
        """Whether float8 damages this layer beyond its usual rounding (see ``reasons``)."""
        return bool(self.reasons)


@dataclass
class Float8Report:
    """What ``diagnose_float8`` found: per converted layer (forward order), its casts and its
    error against bfloat16; ``recommended_keep_bfloat16`` is the ``keep_bfloat16`` to
    train with: the one diagnosed with (names as given, modules and types as the names
    they matched), then the layers float8 hurts. ``to_dict()``, ``to_json()``."""

    policy: str
    recipe: str
    level: str
    loss_float8: float
    loss_bfloat16: float
    layers: list[Float8LayerReport]
    recommended_keep_bfloat16: list[str]
    not_run: list[str]  # converted layers the batch never called
    advice: list[str]

    @property
    def loss_gap(self) -> float:
        """``loss_float8 - loss_bfloat16`` on the diagnosed batch."""
        return self.loss_float8 - self.loss_bfloat16

    @property
    def healthy(self) -> bool:
        return not any(r.hurts for r in self.layers)

    def __str__(self) -> str:
        lines = [
            f"float8 doctor: policy {self.policy} ({self.recipe}), level {self.level}: loss "
            f"{self.loss_float8:.6g} (bfloat16 {self.loss_bfloat16:.6g}, gap {self.loss_gap:+.3g})",
        ]
        header = (
            f"{'layer':<20} {'shape':>8}  {'amax in/w/go':<22} {'scale in/w/go':<23} "
            f"{'flush% in/w/go':<14} {'subn% in/w/go':<14} {'sat%':>4}  "
            f"{'error out/gin/gw':<17} flags"
        )
        lines += [header, "-" * len(header)]

        def num(value: float | None) -> str:
            return "-" if value is None else f"{value:.2g}"

        def pct(value: float | None) -> str:
            return "-" if value is None else f"{100 * value:.2g}"

        for r in self.layers:
            saturated = max(
                v
                for v in (r.saturated_input, r.saturated_weight, r.saturated_grad_output, 0.0)
                if v is not None
            )
            amax = "/".join(map(num, (r.amax_input, r.amax_weight, r.amax_grad_output)))
            scale = "/".join(map(num, (r.scale_input, r.scale_weight, r.scale_grad_output)))
            flush = "/".join(map(pct, (r.flushed_input, r.flushed_weight, r.flushed_grad_output)))
            subn = "/".join(
                map(pct, (r.subnormal_input, r.subnormal_weight, r.subnormal_grad_output))
            )
            error = "/".join(map(num, (r.output_error, r.grad_input_error, r.grad_weight_error)))
            shape = f"{r.shape[0]}x{r.shape[1]}"
            lines.append(
                f"{r.name[:20]:<20} {shape:>8}  {amax:<22} {scale:<23} {flush:<14} {subn:<14} "
                f"{pct(saturated):>4}  {error:<17} {'; '.join(r.reasons)}".rstrip()
            )
        lines.append("")
        lines += [f"- {a}" for a in self.advice]
        return "\n".join(lines)

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["loss_gap"] = self.loss_gap
        return data

    def to_json(self, **kwargs: Any) -> str:
        return to_json(self.to_dict(), **kwargs)
