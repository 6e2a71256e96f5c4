"""nas.io: atomic writes leave the old file or the new one, never a torn one or a temporary file."""

from __future__ import annotations

import os

import pytest

from nas import io


def test_atomic_write_text_replaces_and_leaves_no_temporary(tmp_path):
    path = tmp_path / "a" / "b.json"
    io.atomic_write_text(path, "old")
    io.atomic_write_text(path, "new")
    assert path.read_text() == "new"
    assert sorted(p.name for p in path.parent.iterdir()) == ["b.json"]
    assert oct(path.stat().st_mode & 0o777) == oct(0o644)


def test_failed_write_keeps_the_old_file_and_removes_the_temporary(tmp_path, monkeypatch):
    path = tmp_path / "b.bin"
    io.atomic_write_bytes(path, b"old")

    def boom(fd):
        raise OSError("disk full")

    monkeypatch.setattr(os, "fsync", boom)
    with pytest.raises(OSError, match="disk full"):
        io.atomic_write_bytes(path, b"new")
    monkeypatch.undo()
    assert path.read_bytes() == b"old"
    assert [p.name for p in tmp_path.iterdir()] == ["b.bin"]


def test_atomic_path_fsyncs_before_the_rename(tmp_path, monkeypatch):
    synced: list[int] = []
    real = os.fsync
    monkeypatch.setattr(os, "fsync", lambda fd: synced.append(fd) or real(fd))
    with io.atomic_path(tmp_path / "w.bin") as tmp:
        tmp.write_bytes(b"x" * 10)
        assert not (tmp_path / "w.bin").exists()
    assert (tmp_path / "w.bin").read_bytes() == b"x" * 10
    assert synced  # the file (and its folder) were fsync-ed


def test_atomic_path_removes_the_temporary_when_the_block_raises(tmp_path):
    with pytest.raises(RuntimeError):
        with io.atomic_path(tmp_path / "w.bin") as tmp:
            tmp.write_bytes(b"half")
            raise RuntimeError("writer crashed")
    assert list(tmp_path.iterdir()) == []
