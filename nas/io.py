"""Atomic file writes, written once for the whole tree (torch-free, no ``nas`` imports).

A write goes to a temporary sibling (``.<name>.<random>.tmp``), is flushed and ``fsync``-ed,
then moved into place with ``os.replace``, and the folder entry is ``fsync``-ed too. A reader
therefore sees the old file or the new one, never a torn one, even after a crash or ``kill -9``;
a failed write removes its temporary file.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import IO

__all__ = ["atomic_write_bytes", "atomic_write_text", "atomic_path", "fsync_dir"]


def fsync_dir(folder: str | Path) -> None:
    """``fsync`` a folder so that a rename inside it survives a crash (no-op where unsupported)."""
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


@contextlib.contextmanager
def atomic_path(path: str | Path, *, mode: int = 0o644) -> Iterator[Path]:
    """Yield a temporary sibling of ``path`` to write; on success it replaces ``path`` atomically.

    For writers that need a file name (safetensors, pyarrow, torch.save). The temporary file is
    fsync-ed before the rename and removed if the block raises.

    Args:
        path: the destination file; its folder is created when missing.
        mode: permission bits of the new file (``mkstemp`` creates 0600).
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, name = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    os.close(fd)
    tmp = Path(name)
    try:
        yield tmp
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        os.chmod(tmp, mode)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)


def _write(path: str | Path, opener: Callable[[Path], IO], write: Callable[[IO], object], mode: int) -> Path:
    path = Path(path)
    with atomic_path(path, mode=mode) as tmp:
        with opener(tmp) as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
    return path


def atomic_write_text(path: str | Path, text: str, *, mode: int = 0o644) -> Path:
    """Write ``text`` (UTF-8) to ``path`` atomically, with fsync; returns ``path``."""
    return _write(path, lambda p: open(p, "w", encoding="utf-8"), lambda f: f.write(text), mode)


def atomic_write_bytes(path: str | Path, data: bytes, *, mode: int = 0o644) -> Path:
    """Write ``data`` to ``path`` atomically, with fsync; returns ``path``."""
    return _write(path, lambda p: open(p, "wb"), lambda f: f.write(data), mode)
