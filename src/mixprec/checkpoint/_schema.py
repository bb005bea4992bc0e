"""The mixprec header's schema: every key ``save_checkpoint`` writes, checked for its type,
its value (a policy that parses, a level that exists, masters that are stored) and its
agreement with the other keys before anything is read from the file, so that a damaged or
hand-edited header is a ``CheckpointError`` naming the key rather than a ``KeyError`` deep
inside a load or nonsense that loads."""

from __future__ import annotations

from collections.abc import Container, Mapping
from pathlib import Path
from typing import Any

import torch

from mixprec._errors import shown
from mixprec.checkpoint._safetensors import _Entry, _json
from mixprec.checkpoint.format import (
    _MAX_DEPTH,
    FORMAT,
    FORMAT_VERSION,
    CheckpointError,
    _BadValueError,
    _is_count,
)
from mixprec.levels import LEVELS
from mixprec.policy import is_policy_text

_SKELETON = (
    "null, a bool, number or string, a list, or an object with one key: __tensor__ (a "
    "stored tensor's name), __tuple__ or __dict__ (a list of [key, value] pairs), __float__"
)
_RNG = (
    "null or {'__dict__': [['torch', <uint8 tensor>], ['python', {'__tuple__': [version, "
    "[ints], gauss]}], optionally ['numpy', {'__tuple__': [kind, [ints], pos, has_gauss, "
    "cached]}] and ['cuda', [<uint8 tensor>, ...]]]}"
)
#: Keys of ``Trainer.resume_state()`` that ``fit(resume_from=)`` reads as counters.
_TRAINER_COUNTERS = ("global_step", "epoch", "step_in_epoch")


def _check_skeleton(node: Any, key: str, entries: Mapping[str, _Entry], depth: int = 0) -> None:
    """``node`` is what ``_flatten`` writes: ``_unflatten`` rebuilds it without error."""
    if depth > _MAX_DEPTH:
        raise _BadValueError(key, node, f"at most {_MAX_DEPTH} levels of nesting")
    if node is None or isinstance(node, (bool, int, float, str)):
        return
    if isinstance(node, list):
        for i, item in enumerate(node):
            _check_skeleton(item, f"{key}/{i}", entries, depth + 1)
        return
    if isinstance(node, dict) and len(node) == 1:
        tag, inner = next(iter(node.items()))
        if tag == "__tensor__" and isinstance(inner, str) and inner in entries:
            return
        if tag == "__float__" and inner in ("nan", "inf", "-inf"):
            return
        if tag == "__tuple__" and isinstance(inner, list):
            for i, item in enumerate(inner):
                _check_skeleton(item, f"{key}/{i}", entries, depth + 1)
            return
        if tag == "__dict__" and isinstance(inner, list):
            for pair in inner:
                if not (
                    isinstance(pair, list)
                    and len(pair) == 2
                    and (pair[0] is None or isinstance(pair[0], (bool, int, float, str)))
                ):
                    raise _BadValueError(key, pair, "a [key, value] pair with a scalar key")
                _check_skeleton(pair[1], f"{key}/{pair[0]}", entries, depth + 1)
            return
    raise _BadValueError(key, node, _SKELETON)


def _pairs(node: Any) -> dict[Any, Any] | None:
    """The items of a checked ``{"__dict__": [...]}`` node, or None for any other node."""
    if isinstance(node, dict) and set(node) == {"__dict__"}:
        return dict(node["__dict__"])
    return None


def _is_rng_tensor(node: Any, entries: Mapping[str, _Entry]) -> bool:
    """A reference to a 1-D uint8 tensor, the form of every torch generator state."""
    name = node.get("__tensor__") if isinstance(node, dict) and len(node) == 1 else None
    if not (isinstance(name, str) and name in entries):
        return False
    dtype, shape, _, _ = entries[name]
    return dtype == torch.uint8 and len(shape) == 1


def _check_rng(value: Any, key: str, entries: Mapping[str, _Entry]) -> None:
    if value is None:
        return
    _check_skeleton(value, key, entries)
    parts = _pairs(value)
    if parts is None or not {"torch", "python"} <= set(parts) <= {
        "torch",
        "python",
        "numpy",
        "cuda",
    }:
        raise _BadValueError(key, value, _RNG)
    if "numpy" in parts:
        saved = parts["numpy"]
        items = saved.get("__tuple__") if isinstance(saved, dict) else None
        if not (
            isinstance(items, list)
            and len(items) == 5
            and items[0] == "MT19937"
            and isinstance(items[1], list)
            and len(items[1]) == 624
            and all(type(v) is int and 0 <= v < 2**32 for v in items[1])
            and all(type(v) is int for v in items[2:4])
            and isinstance(items[4], (float, int))
        ):
            raise _BadValueError(
                f"{key}/numpy",
                saved,
                "numpy.random.get_state(): ('MT19937', 624 ints, pos, has_gauss, cached_gaussian)",
            )
    if not _is_rng_tensor(parts["torch"], entries):
        raise _BadValueError(f"{key}/torch", parts["torch"], "a uint8 tensor (a torch RNG state)")
    python = parts["python"]  # random.getstate(): (version, (625 ints), gauss or None)
    items = python.get("__tuple__") if isinstance(python, dict) else None
    version, internal, gauss = items if isinstance(items, list) and len(items) == 3 else [None] * 3
    internal = internal.get("__tuple__") if isinstance(internal, dict) else internal
    if not (
        type(version) is int
        and isinstance(internal, list)
        and all(type(v) is int for v in internal)
        and (gauss is None or isinstance(gauss, (float, dict)))
    ):
        raise _BadValueError(
            f"{key}/python", python, "random.getstate(): (version, (ints...), gauss)"
        )
    cuda = parts.get("cuda", [])
    cuda = cuda.get("__tuple__") if isinstance(cuda, dict) else cuda
    if not (isinstance(cuda, list) and all(_is_rng_tensor(s, entries) for s in cuda)):
        raise _BadValueError(f"{key}/cuda", parts["cuda"], "a list of uint8 tensors")


def _check_trainer_state(value: Any, key: str, entries: Mapping[str, _Entry]) -> None:
    _check_skeleton(value, key, entries)
    parts = _pairs(value)
    if parts is None:
        raise _BadValueError(key, value, "{'__dict__': [[key, value], ...]} (a dict)")
    for name in _TRAINER_COUNTERS:
        if name in parts and not _is_count(parts[name]):
            raise _BadValueError(f"{key}/{name}", parts[name], "an int from 0 to 2**63 - 1")
    if parts.get("epoch_rng") is not None and not _is_rng_tensor(parts["epoch_rng"], entries):
        raise _BadValueError(f"{key}/epoch_rng", parts["epoch_rng"], "null or a uint8 tensor")


def _check_aliases(value: Any, key: str, stored: Container[str]) -> None:
    if not isinstance(value, dict):
        raise _BadValueError(key, value, "an object mapping a state-dict key to a stored one")
    for alias, canonical in value.items():
        if not (isinstance(canonical, str) and f"model/{canonical}" in stored):
            raise _BadValueError(f"{key}/{alias}", canonical, "the name of a stored model tensor")


def _check_names(value: Any, key: str) -> None:
    if not (isinstance(value, list) and all(isinstance(v, str) for v in value)):
        raise _BadValueError(key, value, "a list of strings")


def _check_text(value: Any, key: str, null: bool = True) -> None:
    if not (isinstance(value, str) or (null and value is None)):
        raise _BadValueError(key, value, "a string or null" if null else "a string")


def _check_policy(value: Any, key: str) -> None:
    """Null, or a policy string that ``Policy`` parses (what ``str(policy)`` writes; a
    preset name is also read). ``"auto"`` names no dtypes: it depends on the reader's
    hardware, so it records nothing."""
    _check_text(value, key)
    if value is None:
        return
    valid = "null or a policy string such as 'params=float32,compute=bfloat16,output=float32'"
    if value.strip().lower() == "auto":
        raise _BadValueError(key, value, valid)
    if not is_policy_text(value):
        raise _BadValueError(key, value, valid)


def _check_level(value: Any, key: str) -> None:
    _check_text(value, key)
    if value is not None and value not in LEVELS:
        raise _BadValueError(key, value, f"null or one of {', '.join(LEVELS)}")


def _is_class_name(value: Any) -> bool:
    """A Python class name (``AdamW``)."""
    return isinstance(value, str) and value.isidentifier()


def _check_kind(value: Any, key: str) -> None:
    _check_text(value, key)
    if not (value is None or _is_class_name(value)):
        raise _BadValueError(key, value, "null or an optimizer's class name")


def _check_classes(value: Any, key: str) -> None:
    if not (
        value is None or (isinstance(value, list) and value and all(map(_is_class_name, value)))
    ):
        raise _BadValueError(
            key, value, "null or a non-empty list of optimizer class names, one per optimizer"
        )


def _check_param_names(value: Any, key: str) -> None:
    groups_of = value if isinstance(value, list) else None
    if value is None:
        return
    if not (
        groups_of
        and all(isinstance(groups, list) for groups in groups_of)
        and all(isinstance(g, list) for groups in groups_of for g in groups)
        and all(isinstance(n, str) for groups in groups_of for g in groups for n in g)
    ):
        raise _BadValueError(
            key, value, "null, or per optimizer a list of param groups, each a list of names"
        )


def _check_together(header: dict[str, Any], entries: Mapping[str, _Entry]) -> None:
    """Values that must agree with one another: the masters name stored model tensors; the
    optimizer's kind and classes are there exactly when its state is, one class per
    optimizer whose state it holds."""
    aliases = header.get("aliases", {})
    masters = header.get("masters", [])
    for i, name in enumerate(masters):
        if f"model/{name}" not in entries and name not in aliases:
            raise _BadValueError(f"masters/{i}", name, "the name of a stored model tensor")
    if len(set(masters)) != len(masters):
        raise _BadValueError("masters", masters, "a list of distinct model tensor names")
    state, kind = header.get("optimizer"), header.get("optimizer_kind")
    if "optimizer_kind" in header and (state is None) != (kind is None):
        raise _BadValueError(
            "optimizer_kind", kind, "null exactly when 'optimizer' is (no optimizer state)"
        )
    params = header.get("optimizer_params")
    if "optimizer_params" in header and (state is None) != (params is None):
        raise _BadValueError(
            "optimizer_params", params, "null exactly when 'optimizer' is (no optimizer state)"
        )
    for i, name in enumerate(header.get("buffers", [])):
        if f"model/{name}" not in entries and name not in aliases:
            raise _BadValueError(f"buffers/{i}", name, "the name of a stored model tensor")
    classes = header.get("optimizer_classes")
    if "optimizer_classes" in header and (state is None) != (classes is None):
        raise _BadValueError(
            "optimizer_classes", classes, "null exactly when 'optimizer' is (no optimizer state)"
        )
    if classes is None or kind is None:
        return
    inner = (_pairs(state) or {}).get("optimizers") if kind == "LossScaleOptimizer" else None
    if kind != "LossScaleOptimizer" and classes != [kind]:
        raise _BadValueError("optimizer_classes", classes, f"[{kind!r}], as 'optimizer_kind' says")
    if isinstance(inner, list) and len(inner) != len(classes):
        raise _BadValueError(
            "optimizer_classes", classes, f"{len(inner)} class names, one per optimizer state"
        )


def _check_float8(value: Any, key: str) -> None:
    if value is None:
        return
    if not (isinstance(value, dict) and set(value) == {"recipe", "converted"}):
        raise _BadValueError(key, value, "null or {'recipe': str, 'converted': [layer names]}")
    _check_text(value["recipe"], f"{key}/recipe", null=False)
    _check_names(value["converted"], f"{key}/converted")


def _check_checksum(value: Any, key: str) -> None:
    if not (isinstance(value, str) and len(value) == 64 and set(value) <= set("0123456789abcdef")):
        raise _BadValueError(key, value, "a SHA-256 digest: 64 lowercase hex digits")


def _check_header(header: dict[str, Any], entries: Mapping[str, _Entry]) -> None:
    """``header`` against the schema of what ``save_checkpoint`` writes (``format`` and
    ``format_version`` are checked by the caller). Raises ``_BadValueError``."""
    checks = {
        "format": lambda v, k: None,
        "format_version": lambda v, k: None,
        "mixprec_version": lambda v, k: _check_text(v, k, null=False),
        "torch_version": lambda v, k: _check_text(v, k, null=False),
        "policy": _check_policy,
        "level": _check_level,
        "float8": _check_float8,
        "aliases": lambda v, k: _check_aliases(v, k, entries),
        "masters": _check_names,
        "optimizer": lambda v, k: _check_skeleton(v, k, entries),
        "optimizer_kind": _check_kind,
        "optimizer_classes": _check_classes,
        "optimizer_params": _check_param_names,
        "buffers": _check_names,
        "trainer_state": lambda v, k: _check_trainer_state(v, k, entries),
        "rng": lambda v, k: _check_rng(v, k, entries),
        "checksum": _check_checksum,
    }
    for key, value in header.items():
        if key not in checks:
            raise _BadValueError(key, value, f"only the keys mixprec writes: {', '.join(checks)}")
        checks[key](value, key)
    if "checksum" not in header:
        raise _BadValueError("checksum", None, "a SHA-256 digest: 64 lowercase hex digits")
    _check_together(header, entries)


def _mixprec_header(file: Path, text: str, entries: Mapping[str, _Entry]) -> dict[str, Any]:
    """The mixprec JSON header of ``file``: its format, its version (one this mixprec
    reads) and every key against the schema; any problem is a ``CheckpointError``."""
    header = _json(text, file, "mixprec header")
    if not isinstance(header, dict) or header.get("format") != FORMAT:
        raise CheckpointError(f"{file}: not a {FORMAT} header")
    version = header.get("format_version")
    if type(version) is not int or version < 1:
        raise CheckpointError(
            f"{file}: mixprec header: 'format_version' is {shown(version)}; valid: an int "
            f"from 1 to {FORMAT_VERSION}"
        )
    if version > FORMAT_VERSION:
        raise CheckpointError(
            f"{file}: format version {version} is newer than this mixprec reads "
            f"({FORMAT_VERSION}); upgrade mixprec"
        )
    try:
        _check_header(header, entries)
    except _BadValueError as bad:
        raise CheckpointError(f"{file}: mixprec header: {bad}") from None
    return header
