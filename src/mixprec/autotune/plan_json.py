"""A ``Plan`` as JSON, and back with every field checked.

The file is one object: ``format`` (``"mixprec-plan"``), ``format_version`` (1), ``level``,
``error_budget`` (number or null), ``machine``, ``layers`` (a list of ``{name, kind, dtype,
times, errors, headroom, why}``), ``left_out`` (dtype -> reason), ``step_times`` (label ->
seconds) and ``check`` (``{steps, budget, max_difference, passed, sent_to_float32,
level_from}`` or null). JSON has no infinity: an infinite error is the string ``"inf"``.
Reading refuses an unknown or missing key, a wrong type or an unknown dtype with one
``ArgumentError`` line that names the field, the value and what is valid."""

from __future__ import annotations

import json
import math
from typing import Any

from mixprec._errors import ArgumentError
from mixprec._plan_apply import PLAN_DTYPES
from mixprec.autotune.plan import LayerChoice, Plan, TrainingCheck
from mixprec.doctor import to_json
from mixprec.levels import LEVELS

__all__ = ["FORMAT", "FORMAT_VERSION", "plan_from_json", "plan_to_json"]

FORMAT = "mixprec-plan"
FORMAT_VERSION = 1

_TOP = ("format", "format_version", "level", "error_budget", "machine", "layers", "left_out",
        "step_times", "check")  # fmt: skip
_LAYER = ("name", "kind", "dtype", "times", "errors", "headroom", "why")
_CHECK = ("steps", "budget", "max_difference", "passed", "sent_to_float32", "level_from")


def plan_to_json(plan: Plan, indent: int | None = 2) -> str:
    """``plan`` in the format of the module docstring."""
    check = plan.check
    data: dict[str, Any] = {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "level": plan.level,
        "error_budget": plan.error_budget,
        "machine": plan.machine,
        "layers": [{k: getattr(layer, k) for k in _LAYER} for layer in plan.layers],
        "left_out": dict(plan.left_out),
        "step_times": dict(plan.step_times),
        "check": None if check is None else {k: getattr(check, k) for k in _CHECK},
    }
    return to_json(data, indent=indent)


class _Reader:
    """Checks of one JSON document, each failure one line naming ``where`` it is."""

    def __init__(self, where: str) -> None:
        self.where = where

    def fail(self, field: str, value: Any, valid: str) -> ArgumentError:
        return ArgumentError(f"plan {self.where}: {field}={value!r} is invalid; {valid}")

    def keys(self, obj: Any, field: str, expected: tuple[str, ...]) -> dict[str, Any]:
        if not isinstance(obj, dict):
            raise self.fail(field, obj, f"expected an object with keys {', '.join(expected)}")
        unknown = [k for k in obj if k not in expected]
        missing = [k for k in expected if k not in obj]
        if unknown or missing:
            what = "; ".join(
                f"{kind} key(s) {', '.join(map(repr, keys))}"
                for kind, keys in (("unknown", unknown), ("missing", missing))
                if keys
            )
            raise ArgumentError(
                f"plan {self.where}: {field} has {what}; expected {', '.join(expected)}"
            )
        return obj

    def text(self, value: Any, field: str) -> str:
        if not isinstance(value, str):
            raise self.fail(field, value, "expected a string")
        return value

    def number(self, value: Any, field: str, optional: bool = False) -> float | None:
        if value is None and optional:
            return None
        if value == "inf":  # JSON's stand-in for an infinite error (to_json)
            return math.inf
        if (
            isinstance(value, bool)
            or not isinstance(value, (int, float))
            or not math.isfinite(value)  # inf is written "inf"; NaN is no measurement
            or value < 0
        ):
            kind = "a finite number >= 0" + (" or null" if optional else "")
            raise self.fail(field, value, f"expected {kind}")
        return float(value)

    def numbers(self, value: Any, field: str) -> dict[str, float]:
        if not isinstance(value, dict):
            raise self.fail(field, value, "expected an object of numbers")
        return {
            self.text(k, f"{field} key"): float(self.number(v, f"{field}[{k!r}]") or 0.0)
            for k, v in value.items()
        }

    def dtype(self, value: Any, field: str) -> str:
        if value not in PLAN_DTYPES:
            raise self.fail(field, value, f"valid: {', '.join(PLAN_DTYPES)}")
        return str(value)

    def dtype_keys(self, value: dict[str, Any], field: str) -> None:
        for key in value:
            self.dtype(key, f"{field} key")


def _level_from(r: _Reader, value: Any) -> str | None:
    if value is not None and value not in LEVELS:
        raise r.fail("check.level_from", value, f"valid: {', '.join(LEVELS)} or null")
    return None if value is None else str(value)


def plan_from_json(text: str, where: str = "JSON") -> Plan:
    """The ``Plan`` written by ``plan_to_json``; ``where`` names the source in errors."""
    r = _Reader(where)
    try:
        data = json.loads(text)
    except json.JSONDecodeError as err:
        raise ArgumentError(f"plan {where}: not JSON ({err})") from None
    data = r.keys(data, "the document", _TOP)
    if data["format"] != FORMAT:
        raise r.fail("format", data["format"], f"expected {FORMAT!r}")
    if data["format_version"] != FORMAT_VERSION:
        raise r.fail(
            "format_version", data["format_version"], f"this mixprec reads {FORMAT_VERSION}"
        )
    if data["level"] not in LEVELS:
        raise r.fail("level", data["level"], f"valid: {', '.join(LEVELS)}")
    if not isinstance(data["layers"], list):
        raise r.fail("layers", data["layers"], "expected a list of layer objects")
    layers = []
    names: set[str] = set()
    for i, raw in enumerate(data["layers"]):
        at = f"layers[{i}]"
        layer = r.keys(raw, at, _LAYER)
        name = r.text(layer["name"], f"{at}.name")
        if name in names:
            raise r.fail(f"{at}.name", name, "each layer may appear once")
        names.add(name)
        times, errors = (
            r.numbers(layer["times"], f"{at}.times"),
            r.numbers(layer["errors"], f"{at}.errors"),
        )
        r.dtype_keys(times, f"{at}.times")
        r.dtype_keys(errors, f"{at}.errors")
        layers.append(
            LayerChoice(
                name=name,
                kind=r.text(layer["kind"], f"{at}.kind"),
                dtype=r.dtype(layer["dtype"], f"{at}.dtype"),
                times=times,
                errors=errors,
                headroom=r.number(layer["headroom"], f"{at}.headroom", optional=True),
                why=r.text(layer["why"], f"{at}.why"),
            )
        )
    left_out = data["left_out"]
    if not isinstance(left_out, dict):
        raise r.fail("left_out", left_out, "expected an object of dtype -> reason")
    r.dtype_keys(left_out, "left_out")
    for key, reason in left_out.items():
        r.text(reason, f"left_out[{key!r}]")
    check = None
    if data["check"] is not None:
        c = r.keys(data["check"], "check", _CHECK)
        steps, passed, moved = c["steps"], c["passed"], c["sent_to_float32"]
        if isinstance(steps, bool) or not isinstance(steps, int) or steps < 0:
            raise r.fail("check.steps", steps, "expected an int >= 0")
        if not isinstance(passed, bool):
            raise r.fail("check.passed", passed, "expected true or false")
        if not isinstance(moved, list) or not all(isinstance(n, str) for n in moved):
            raise r.fail("check.sent_to_float32", moved, "expected a list of layer names")
        check = TrainingCheck(
            steps=steps,
            budget=r.number(c["budget"], "check.budget") or 0.0,
            max_difference=r.number(c["max_difference"], "check.max_difference") or 0.0,
            passed=passed,
            sent_to_float32=tuple(moved),
            level_from=_level_from(r, c["level_from"]),
        )
    return Plan(
        layers=tuple(layers),
        level=data["level"],
        left_out=dict(left_out),
        step_times=r.numbers(data["step_times"], "step_times"),
        error_budget=r.number(data["error_budget"], "error_budget", optional=True),
        check=check,
        machine=r.text(data["machine"], "machine"),
    )
