"""Hostile checkpoint files, written by hand in the safetensors framing: an 8-byte
little-endian header length, the JSON header, the tensor data. Each must be refused with a
``CheckpointError`` before a tensor is read or hashed."""

from __future__ import annotations

import json
import os
import struct

import pytest

import mixprec as mp
from mixprec.checkpoint import _files, _safetensors, read
from tests.conftest import make_mlp

GiB = 2**30


def _write(path, entries, data=b"", metadata=None):
    header = dict(entries)
    if metadata is not None:
        header["__metadata__"] = metadata
    text = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(text)) + text + data)
    return path


def _f32(n, begin=0):
    return {"dtype": "F32", "shape": [n], "data_offsets": [begin, begin + 4 * n]}


@pytest.fixture
def no_reading(monkeypatch):
    """Fails the test if a tensor is read or hashed."""

    def forbidden(*args, **kwargs):
        raise AssertionError("a tensor was read or hashed")

    # Patched where they are looked up when called: tensors are read and the checksum
    # taken in read.
    monkeypatch.setattr(read, "_read_tensors", forbidden)
    monkeypatch.setattr(read, "_checksum", forbidden)


def test_many_empty_entries_are_refused_before_any_hashing(tmp_path, no_reading):
    # 200k here (1.2 M exhausted memory): the header's parse stops at the 1025th entry,
    # before any is read or hashed.
    count = 200_000
    empty = '{"dtype":"F32","shape":[0],"data_offsets":[0,0]}'
    text = ("{" + ",".join(f'"t{i}":{empty}' for i in range(count)) + "}").encode()
    path = tmp_path / "empty.safetensors"
    path.write_bytes(struct.pack("<Q", len(text)) + text)
    match = r"more than 1024 tensor entries for 0 bytes of tensor data; refused before reading"
    with pytest.raises(mp.CheckpointError, match=match):
        mp.read_checkpoint(path)  # what `mixprec inspect` calls
    with pytest.raises(mp.CheckpointError, match=match):
        mp.load_checkpoint(path, make_mlp())


def test_huge_dimensions_are_refused(tmp_path):
    path = _write(tmp_path / "huge.safetensors", {"w": {
        "dtype": "F32", "shape": [0, 2**63], "data_offsets": [0, 0]}})  # fmt: skip
    # A CheckpointError, not torch's TypeError from reshape().
    with pytest.raises(
        mp.CheckpointError,
        match=r"tensor 'w' has shape \[0, 9223372036854775808\]; valid: a list of ints >= 0 "
        r"whose product is at most 2\*\*63 - 1",
    ):
        mp.read_checkpoint(path)
    _write(path, {"w": {"dtype": "F32", "shape": [2**62, 4, 0], "data_offsets": [0, 0]}})
    with pytest.raises(mp.CheckpointError, match=r"has shape \[4611686018427387904, 4, 0\]"):
        mp.read_checkpoint(path)  # torch: "numel: integer multiplication overflow"


@pytest.mark.skipif(not os.path.exists("/proc/self/mem"), reason="needs procfs")
def test_only_regular_files_with_contents_are_opened(tmp_path):
    mem = tmp_path / "mem.safetensors"
    mem.symlink_to("/proc/self/mem")
    # A CheckpointError, not an OSError [Errno 5] from reading it.
    with pytest.raises(mp.CheckpointError, match=r"mem.safetensors: empty \(0 bytes\)"):
        mp.load_checkpoint(mem, make_mlp())
    zero = tmp_path / "zero.safetensors"
    zero.symlink_to("/dev/zero")
    with pytest.raises(mp.CheckpointError, match="zero.safetensors: not a regular file"):
        mp.read_checkpoint(zero)
    fifo = tmp_path / "fifo.safetensors"
    os.mkfifo(fifo)
    with pytest.raises(mp.CheckpointError, match="fifo.safetensors: not a regular file"):
        mp.read_checkpoint(fifo)  # opening it for reading would block


def test_sparse_huge_files_are_refused_before_reading(tmp_path, no_reading, monkeypatch):
    # Four bytes of tensor, then a 64 GiB hole (sparse: no disk is used).
    tail = _write(tmp_path / "tail.safetensors", {"w": _f32(1)}, b"\0" * 4)
    os.truncate(tail, 64 * GiB)
    # Refused before safetensors maps the 64 GiB (a MemoryError under an address-space limit).
    with pytest.raises(
        mp.CheckpointError, match=r"truncated or corrupt: the tensors end at byte 4 of the data"
    ):
        mp.read_checkpoint(tail)
    # A header that declares the 64 GiB: consistent, and more than the memory there is.
    whole = _write(tmp_path / "whole.safetensors", {"w": {
        "dtype": "U8", "shape": [64 * GiB], "data_offsets": [0, 64 * GiB]}})  # fmt: skip
    os.truncate(whole, whole.stat().st_size + 64 * GiB)
    if os.path.exists("/proc/meminfo"):
        assert _files._available_memory() > 0
    monkeypatch.setattr(_safetensors, "_available_memory", lambda: 16 * GiB)
    with pytest.raises(
        mp.CheckpointError,
        match=r"its tensors hold 64.0 GiB, more than the 16.0 GiB of memory available; refused",
    ):
        mp.load_checkpoint(whole, make_mlp())


@pytest.mark.parametrize(
    ("entry", "match"),
    [
        ({"dtype": "F4", "shape": [2], "data_offsets": [0, 1]}, r"has dtype 'F4'; valid: BOOL"),
        ({"dtype": "F32", "shape": [-1], "data_offsets": [0, 4]}, r"has shape \[-1\]"),
        ({"dtype": "F32", "shape": [2], "data_offsets": [0, 4]},
         r"data_offsets \[0, 4\]; valid: \[begin, begin \+ 8\] for its 2 float32 values"),
        ({"dtype": "F32", "shape": [1], "data_offsets": [4, 8]},
         r"tensor 'w' starts at byte 4 of the data, not 0"),
        ({"dtype": "F32", "shape": 1, "data_offsets": [0, 4]}, r"has shape 1"),
        ("F32", r"corrupt safetensors entry 'w': 'F32'; valid: an object with dtype"),
    ],
)  # fmt: skip
def test_malformed_entries_are_refused(tmp_path, entry, match):
    path = _write(tmp_path / "bad.safetensors", {"w": entry}, b"\0" * 8)
    with pytest.raises(mp.CheckpointError, match=match):
        mp.read_checkpoint(path)


def test_deeply_nested_json_is_a_checkpoint_error(tmp_path):
    deep = "[" * 100_000 + "]" * 100_000
    mixprec = f'{{"format": "mixprec-checkpoint", "format_version": 2, "rng": {deep}}}'
    path = _write(tmp_path / "deep.safetensors", {"w": _f32(1)}, b"\0" * 4, {"mixprec": mixprec})
    # A CheckpointError, not a RecursionError.
    with pytest.raises(mp.CheckpointError, match=r"corrupt mixprec header \(JSON nested too"):
        mp.load_checkpoint(path, make_mlp())
    text = ('{"w": ' + deep + "}").encode()
    path.write_bytes(struct.pack("<Q", len(text)) + text)
    with pytest.raises(mp.CheckpointError, match=r"corrupt safetensors header \(JSON nested"):
        mp.read_checkpoint(path)


def test_plain_safetensors_aliases_are_checked(tmp_path):
    path = _write(tmp_path / "a.safetensors", {"w": _f32(1)}, b"\0" * 4, {"aliases": "{not"})
    # A CheckpointError, not json's JSONDecodeError nor a KeyError for an alias to nothing.
    with pytest.raises(mp.CheckpointError, match="a.safetensors: corrupt aliases metadata"):
        mp.read_checkpoint(path)
    _write(path, {"w": _f32(1)}, b"\0" * 4, {"aliases": '{"v": "nope"}'})
    with pytest.raises(
        mp.CheckpointError, match=r"metadata 'aliases/v' is 'nope'; valid: the name of a stored"
    ):
        mp.read_checkpoint(path)
