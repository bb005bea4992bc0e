"""Writing a file so that a failure at any point leaves the previous one (or none), never a
torn one: a temporary file in the same folder, fsync, the old file's mode, rename, fsync
the folder. Checkpoints, plans, doctor reports and bench results are written this way."""

from __future__ import annotations

import os
import stat
import tempfile
from collections.abc import Callable
from pathlib import Path

__all__ = ["FolderSyncError", "write_atomically", "write_text_atomically"]


class FolderSyncError(OSError):
    """The new file is in place, but the sync of its folder failed: the rename may not
    survive a power loss. (Not the "previous file intact" of a failure before it.)"""


def write_atomically(path: Path, write: Callable[[str], object]) -> None:
    """``write(temporary_path)`` fills a temporary file beside ``path``, which then
    replaces ``path``; whatever ``write`` raises leaves ``path`` as it was and no
    temporary file behind. Through a symlink the file it points to is replaced (the link
    stays); a ``path`` that is no regular file (``/dev/stdout``) is written directly."""
    path = Path(os.path.realpath(path))
    if path.exists() and not path.is_file():
        write(str(path))
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    os.close(fd)
    try:
        write(tmp)
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())
        # mkstemp makes the file 0600: a replaced file keeps its own mode (a private
        # checkpoint stays private), a new one gets the mode any new file would.
        try:
            mode = stat.S_IMODE(os.stat(path).st_mode)
        except FileNotFoundError:
            mode = 0o666 & ~_umask()
        os.chmod(tmp, mode)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    if hasattr(os, "O_DIRECTORY"):
        try:
            dir_fd = os.open(path.parent, os.O_RDONLY | os.O_DIRECTORY)
            try:
                os.fsync(dir_fd)
            finally:
                os.close(dir_fd)
        except OSError as err:
            raise FolderSyncError(
                err.errno,
                f"{path} was written, but syncing its folder failed ({err.strerror}): the "
                "new file is in place, and may not survive a power loss",
            ) from err


def write_text_atomically(path: str | os.PathLike[str], text: str) -> Path:
    """``text`` (UTF-8) to ``path``, atomically; returns the path written."""
    target = Path(path)
    write_atomically(target, lambda tmp: Path(tmp).write_text(text, encoding="utf-8"))
    return target


def _umask() -> int:
    mask = os.umask(0)  # the only way to read it; set back at once
    os.umask(mask)
    return mask
