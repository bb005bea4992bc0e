"""``read_checkpoint``: the tensors and header of a mixprec checkpoint, a plain safetensors
file or a ``torch.save`` state dict, with the file treated as hostile until checked.

Only a regular file is opened, once: the framing, the header and the tensors are all read
from that one handle. The safetensors framing and the mixprec header are checked before a
tensor is read or hashed; then the checksum. A ``torch.save`` file is read with
``weights_only=True``: nothing in it is unpickled but tensors and plain containers.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, BinaryIO

import torch

from mixprec._dtypes import HALF_DTYPES, dtype_name
from mixprec._warn import warn_at_caller
from mixprec.checkpoint._files import _open_regular, as_path
from mixprec.checkpoint._safetensors import _json, _read_tensors, _safetensors_header
from mixprec.checkpoint._schema import _check_aliases, _mixprec_header
from mixprec.checkpoint._tree import _unflatten
from mixprec.checkpoint.format import CheckpointError, _BadValueError, _checksum


def _read_torch_file(
    path: Path, handle: BinaryIO
) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """The ``torch.save`` file open as ``handle``, read with ``weights_only=True``: tensors
    and plain containers only; anything else is refused before it can run. A state dict
    nested under ``state_dict``/``model``/``model_state_dict`` (Lightning, training scripts)
    is read; the header's ``other_entries`` names the keys beside it (an optimizer, an
    epoch), which a weights-only conversion drops. A tensor safetensors cannot hold as it
    is (meta, sparse, quantized, complex other than complex64) is refused, naming it,
    before anything is done."""
    try:
        obj = torch.load(handle, map_location="cpu", weights_only=True)
    except Exception as err:  # UnpicklingError, RuntimeError, EOFError...
        raise CheckpointError(
            f"{path}: refused: not a plain tensor state dict ({type(err).__name__}: "
            f"{str(err).splitlines()[0] if str(err) else ''}); mixprec never unpickles objects"
        ) from None
    header: dict[str, Any] = {}
    for key in ("state_dict", "model", "model_state_dict"):
        if isinstance(obj, dict) and isinstance(obj.get(key), dict):
            header["other_entries"] = sorted(str(k) for k in obj if k != key)
            _say_if_masters_beside(path, obj, key)
            obj = obj[key]
            break
    if not isinstance(obj, dict) or not all(isinstance(v, torch.Tensor) for v in obj.values()):
        raise CheckpointError(f"{path}: holds no state dict of tensors")
    for name, t in obj.items():
        kind = _unstorable(t)
        if kind:
            raise CheckpointError(
                f"{path}: tensor {name!r} is {kind}, which a checkpoint file cannot hold as it "
                "is; convert it to a dense real tensor (complex64 for a complex one) or leave "
                "it out first"
            )
    return {f"model/{k}": v for k, v in obj.items()}, header


def _say_if_masters_beside(path: Path, obj: dict[Any, Any], key: str) -> None:
    """A training script's ``{"model": model.state_dict(), "optimizer": opt.state_dict()}``
    at O2: its model entry holds the 16-bit weights, and their float32 masters are in the
    ``LossScaleOptimizer``'s state, in its order, which no reader can match to names.
    ``load_checkpoint`` and ``mixprec convert`` gave the roundings (9.6e-4 off), saying
    "0 tensors converted"."""
    beside = [
        str(k) for k, v in obj.items()
        if k != key and isinstance(v, dict) and v.get("master_weights")  # O2's, not O1/O3's
    ]  # fmt: skip
    weights = obj[key].values()
    if beside and any(torch.is_tensor(t) and t.dtype in HALF_DTYPES for t in weights):
        warn_at_caller(
            f"{path}: its {key!r} entry holds 16-bit weights whose float32 masters are in "
            f"its {beside[0]!r} entry (a LossScaleOptimizer's state), which cannot be "
            "matched to names: what is read are the 16-bit roundings. Resume it as it was "
            f"saved (model.load_state_dict(ckpt[{key!r}]), "
            f"opt.load_state_dict(ckpt[{beside[0]!r}])), or save with mp.save_checkpoint, "
            "which writes the masters under their weights' names"
        )


def _unstorable(t: torch.Tensor) -> str:
    """What makes ``t`` one that safetensors cannot hold as it is; "" if nothing."""
    if t.is_meta:
        return "on the meta device (no values)"
    if t.is_nested:
        return "nested (not dense)"
    if t.layout != torch.strided:
        return f"{str(t.layout).removeprefix('torch.')} (not dense)"
    if t.is_quantized:
        return f"quantized ({dtype_name(t.dtype)})"
    if t.is_complex() and t.dtype != torch.complex64:  # safetensors' only complex type
        return dtype_name(t.dtype)
    return ""


def read_checkpoint(path: str | os.PathLike[str]) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """``(tensors, header)`` of a mixprec checkpoint, a plain ``.safetensors`` file or a
    ``torch.save`` state dict (model tensors are named ``model/<key>``).

    Before a tensor is read: the file must be a regular file; the safetensors framing
    (dtypes, shapes, offsets, the entry count against the data's bytes, the data against
    free memory) and the mixprec header (its schema, its format version) are checked. Then
    the checksum (header and tensors; tensors only for format 1). Any problem is a
    ``CheckpointError``."""
    file = as_path("read_checkpoint", path)
    if file.is_dir():
        found = sorted(p.name for p in file.glob("*.safetensors"))
        hint = f" (it holds {', '.join(found[:4])})" if found else ""
        raise CheckpointError(f"{str(file)!r} is a directory, not a checkpoint file{hint}")
    handle, size = _open_regular(file)
    # Everything is read from this one handle: a writer that replaces the file meanwhile
    # (an atomic rename) leaves this reader with one whole checkpoint, the one it opened.
    with handle:
        try:
            head = handle.read(9)
            # safetensors: an 8-byte little-endian header length, then the JSON header. Test
            # for it first: its length's first byte can be 0x80, a pickle's first byte.
            header_end = 8 + int.from_bytes(head[:8], "little") if len(head) == 9 else -1
            if not (head[8:9] == b"{" and header_end <= size):
                if head[:4] == b"PK\x03\x04" or head[:1] == b"\x80":
                    handle.seek(0)
                    return _read_torch_file(file, handle)
                raise CheckpointError(f"{file}: truncated, corrupt, or not a checkpoint")
            handle.seek(0)
            entries, meta = _safetensors_header(handle, file, size)
        except OSError as err:
            raise CheckpointError(f"{file}: cannot be read ({err.strerror})") from None
        if "mixprec" not in meta:  # plain weights, e.g. from export_weights or another library
            aliases = _json(meta["aliases"], file, "aliases metadata") if "aliases" in meta else {}
            try:
                _check_aliases(aliases, "aliases", {f"model/{k}" for k in entries})
            except _BadValueError as bad:
                raise CheckpointError(f"{file}: metadata {bad}") from None
            tensors = _read_tensors(handle, file, entries)
            return {f"model/{k}": v for k, v in tensors.items()}, {"aliases": aliases}
        header = _mixprec_header(file, meta["mixprec"], entries)
        tensors = _read_tensors(handle, file, entries)
    covered = header if header["format_version"] >= 2 else None
    if _checksum(tensors, covered) != header["checksum"]:
        what = "header or tensors" if covered is not None else "tensors"
        raise CheckpointError(f"{file}: checksum mismatch: the {what} were modified or damaged")
    return tensors, header


def trainer_state(header: dict[str, Any], tensors: dict[str, torch.Tensor]) -> dict[str, Any]:
    """The Trainer's state a checkpoint stores (counters, history, callbacks), rebuilt from
    ``read_checkpoint``'s header and tensors; empty when the checkpoint has none."""
    state = _unflatten(header.get("trainer_state", {"__dict__": []}), tensors)
    return state if isinstance(state, dict) else {}
