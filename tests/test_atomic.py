"""Files written whole or not at all: a failed write of a plan, a doctor report or bench
results left the previous file truncated (they were written in place)."""

from __future__ import annotations

import errno
import os
from pathlib import Path

import pytest
import torch
from torch import nn

import mixprec as mp
from mixprec import _atomic, cli


def _failing_write_text(self: Path, text: str, encoding: str | None = None) -> int:
    with open(self, "w", encoding=encoding) as f:
        f.write(text[: len(text) // 2])  # half of it, then the disk is full
    raise OSError(errno.EFBIG, "File too large")


def test_a_failed_write_leaves_the_previous_file_and_no_temporary_one(tmp_path, monkeypatch):
    target = tmp_path / "plan.json"
    target.write_text('{"old": true}\n')
    monkeypatch.setattr(Path, "write_text", _failing_write_text)
    with pytest.raises(OSError, match="File too large"):
        _atomic.write_text_atomically(target, '{"new": true, "longer": "text"}\n')
    monkeypatch.undo()
    assert target.read_text() == '{"old": true}\n'
    assert [p.name for p in tmp_path.iterdir()] == ["plan.json"]


def test_the_doctors_json_is_written_whole_or_not_at_all(tmp_path, monkeypatch, capsys):
    report = tmp_path / "d.json"
    report.write_text("previous report")
    monkeypatch.setattr(Path, "write_text", _failing_write_text)
    args = ["doctor", "--data", "synthetic", "--batch-size", "16", "--json", str(report)]
    assert cli.main(args) != 0
    assert "File too large" in capsys.readouterr().err
    monkeypatch.undo()
    assert report.read_text() == "previous report"


def test_a_symlink_stays_and_its_target_is_replaced(tmp_path):
    target = tmp_path / "real.json"
    target.write_text("old")
    link = tmp_path / "link.json"
    link.symlink_to(target)
    _atomic.write_text_atomically(link, "new")
    assert link.is_symlink() and target.read_text() == "new"


def test_a_folder_sync_that_fails_after_the_rename_says_the_new_file_is_there(
    tmp_path, monkeypatch
):
    """The folder's fsync raising EIO after the rename: save_checkpoint said "the previous
    checkpoint there is intact" while the file held the new checkpoint."""
    model = nn.Linear(2, 2)
    path = mp.save_checkpoint(tmp_path / "c.safetensors", model)
    real_fsync = os.fsync

    def fsync(fd: int) -> None:
        if os.path.isdir(f"/proc/self/fd/{fd}"):
            raise OSError(errno.EIO, "Input/output error")
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    with torch.no_grad():
        model.weight.fill_(3.0)
    with pytest.raises(OSError, match=r"was written, but syncing its folder failed") as err:
        mp.save_checkpoint(path, model)
    assert "intact" not in str(err.value) and err.value.errno == errno.EIO
    monkeypatch.setattr(os, "fsync", real_fsync)
    fresh = nn.Linear(2, 2)
    mp.load_checkpoint(path, fresh)
    assert torch.equal(fresh.weight, torch.full((2, 2), 3.0))  # the new one is there
