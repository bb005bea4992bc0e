"""Files on disk: atomic writes (temporary file, fsync, rename), the temporary files a killed
writer leaves, whether two paths are one file, opening only a regular file for reading, and
the memory a read may fill."""

from __future__ import annotations

import errno
import os
import re
import stat
from pathlib import Path
from typing import Any, BinaryIO

import torch
from safetensors import SafetensorError
from safetensors.torch import save_file

from mixprec._atomic import FolderSyncError, write_atomically
from mixprec._errors import ArgumentError, shown
from mixprec.checkpoint.format import CheckpointError


def _atomic_write(tensors: dict[str, torch.Tensor], metadata: dict[str, str], path: Path) -> None:
    """``write_atomically``: a failure at any point leaves the previous file (or none),
    never a torn one. A system error while writing (a full disk, a file size limit) raises
    an ``OSError`` with its errno, naming ``path`` and saying what is left there."""
    try:
        write_atomically(path, lambda tmp: save_file(tensors, tmp, metadata))
    except FolderSyncError:
        raise  # after the rename: the new checkpoint is there, not the previous one
    except (OSError, SafetensorError) as err:
        # safetensors reports the system's error in its own exception's text.
        code = err.errno if isinstance(err, OSError) else _os_error(str(err))
        if code is None:
            raise
        left = (
            "the previous checkpoint there is intact"
            if path.exists()
            else "no checkpoint was written there"
        )
        what = "no space left on device" if code == errno.ENOSPC else os.strerror(code)
        raise OSError(code, f"{what} while writing checkpoint {str(path)!r}; {left}") from err


def as_path(who: str, path: Any, argument: str = "path") -> Path:
    """``path`` as a ``Path``, or an ``ArgumentError`` naming it (``None`` or a number
    failed in pathlib's ``TypeError``)."""
    if not isinstance(path, (str, os.PathLike)) or isinstance(path, bytes):
        raise ArgumentError(
            f"{who}: {argument}={shown(path)} is invalid; valid: a file path (a str or a "
            "pathlib.Path)"
        )
    return Path(path)


def writable_path(who: str, path: Any, argument: str = "path") -> Path:
    """``as_path``, refusing a path no file can be written to: an existing directory, or
    one under a file. The raw ``OSError`` came from deep inside the writer, after the
    tensors were gathered, saying "the previous checkpoint there is intact"."""
    target = as_path(who, path, argument)
    if target.is_dir():
        raise ArgumentError(
            f"{who}: {argument} {str(target)!r} is a directory; valid: a file path (e.g. "
            "'ckpt.safetensors') in an existing or new directory"
        )
    for parent in target.parents:
        if parent.exists():
            if not parent.is_dir():
                raise ArgumentError(
                    f"{who}: {argument} {str(target)!r} is under {str(parent)!r}, which is a "
                    "file; valid: a file path in an existing or new directory"
                )
            break
    return target


def _os_error(text: str) -> int | None:
    """The errno in a safetensors error's text ("... (os error 28)"), if any."""
    found = re.search(r"\(os error (\d+)\)", text)
    return int(found.group(1)) if found else None


def same_file(a: str | os.PathLike[str], b: str | os.PathLike[str]) -> bool:
    """Whether ``a`` and ``b`` name one existing file, through links and relative paths."""
    try:
        return os.path.samefile(a, b)
    except OSError:  # one of them does not exist: not the same file
        return False


def temporary_files(folder: Path) -> list[Path]:
    """Temporary files ``_atomic_write`` leaves behind when its process is killed."""
    return sorted(folder.glob(".*.safetensors.*.tmp"))


def _open_regular(file: Path) -> tuple[BinaryIO, int]:
    """``file`` opened for reading, and its size. Only a regular file is opened: a device,
    pipe or socket could block, never end or have effects on open; a file that reads as
    empty (procfs's ``/proc/self/mem``) is refused before it is read. Everything is then
    read from this one handle, so that a file replaced meanwhile is never half read."""
    try:
        before = os.stat(file)
    except FileNotFoundError:
        raise CheckpointError(f"{file}: no such checkpoint file") from None
    except OSError as err:
        raise CheckpointError(f"{file}: cannot be read ({err.strerror})") from None
    if not stat.S_ISREG(before.st_mode):
        raise CheckpointError(f"{file}: not a regular file (a device, pipe or socket); refused")
    try:
        # O_NONBLOCK: should it have become a pipe since the stat, the open returns at once.
        fd = os.open(file, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_BINARY", 0))
    except OSError as err:
        raise CheckpointError(f"{file}: cannot be read ({err.strerror})") from None
    handle = os.fdopen(fd, "rb")
    # What was opened is what is read: a regular file that replaced the one stat'ed (a
    # writer's atomic rename) is simply the newer checkpoint; anything else is refused.
    now = os.fstat(handle.fileno())
    if not stat.S_ISREG(now.st_mode):
        handle.close()
        raise CheckpointError(f"{file}: replaced while being opened; refused")
    if now.st_size == 0:
        handle.close()
        raise CheckpointError(f"{file}: empty (0 bytes): not a checkpoint")
    return handle, now.st_size


def _available_memory() -> int | None:
    """Bytes this process could still fill: the kernel's MemAvailable plus free swap; None
    where unknown. A container's limit can be lower, but its page cache makes any estimate
    of it too low, and a too-low estimate would refuse a checkpoint that fits."""
    try:
        lines = Path("/proc/meminfo").read_text().splitlines()
    except OSError:
        return None
    kib = {}
    for line in lines:
        key, _, rest = line.partition(":")
        value = rest.split()
        if value and value[0].isdigit():
            kib[key] = int(value[0])
    if "MemAvailable" not in kib:
        return None
    return (kib["MemAvailable"] + kib.get("SwapFree", 0)) * 1024
