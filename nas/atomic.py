"""Atomic file writes and safe output folders, written once for the whole tree (torch-free).

A write goes to a temporary sibling (``.<name>.<random>.tmp``), is flushed and ``fsync``-ed,
then moved into place with ``os.replace``, and the folder entry is ``fsync``-ed too. A reader
therefore sees the old file or the new one, never a torn one, even after a crash or ``kill -9``;
a failed write removes its temporary file. A path that is a folder is never written as a file.

An output folder (``nas export --out DIR``) is filled as a temporary sibling and swapped into place
(:func:`output_dir`); the folder it replaces must be an earlier output of the same kind (it holds the
writer's marker file) unless the user forces it, and the current folder, its ancestors and the home
folder are never replaced (:func:`check_output_dir`).

Imports the standard library and :mod:`nas.errors` only (which imports nothing).
"""

from __future__ import annotations

import contextlib
import errno
import os
import re
import shutil
import sys
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import IO

from nas.errors import DiskFullError, OutputPathError, error_chain

__all__ = ["atomic_write_bytes", "atomic_write_text", "atomic_path", "disk_full_errno", "fsync_dir", "check_output_file",
           "check_output_dir", "output_dir", "recover_output_dir"]

_FULL = {errno.ENOSPC, errno.EDQUOT, errno.EFBIG}
"""The system's codes of a write that ran out of room (disk, quota, file-size limit)."""
_FULL_TEXT = re.compile(r"\bos error (%s)\b" % "|".join(map(str, sorted(_FULL))))
"""The same codes as Rust writers (safetensors) print them: their exceptions carry no ``errno``."""

_SHOWN_ENTRIES = 5
"""Entries of a refused folder named in the error."""


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
    Raises:
        OutputPathError: ``path`` is a folder (:func:`check_output_file`).
    """
    path = check_output_file(path)
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
    except BaseException as e:
        tmp.unlink(missing_ok=True)
        code = disk_full_errno(e)
        if code is not None:
            raise DiskFullError(f"cannot write {path}: {os.strerror(code)} ({_free(path.parent)}); "
                                f"{'the previous ' + path.name + ' is kept' if path.exists() else 'nothing was written'}. "
                                "Free space there, or write to another folder (the YAML's workdir, or --out)",
                                code) from e
        raise
    fsync_dir(path.parent)


def disk_full_errno(error: BaseException) -> int | None:
    """The ``ENOSPC``/``EDQUOT``/``EFBIG`` code behind ``error`` (an ``OSError``, or a writer's exception whose
    message or cause carries it, as safetensors' does), or None when it is another error."""
    for link in error_chain(error):
        if isinstance(link, OSError) and link.errno in _FULL:
            return link.errno
        match = _FULL_TEXT.search(str(link))
        if match:
            return int(match.group(1))
    return None


def _free(folder: Path) -> str:
    """``"N MiB free"`` on the disk of ``folder`` (or ``"free space unknown"``)."""
    try:
        return f"{shutil.disk_usage(folder).free / 2**20:.1f} MiB free"
    except OSError:
        return "free space unknown"


def check_output_file(path: str | Path) -> Path:
    """``path`` as a file to write (or replace): it must not be an existing folder.

    Raises:
        OutputPathError: ``path`` is a folder (names it and the fix).
    """
    path = Path(path)
    if path.is_dir():
        raise OutputPathError(f"{path} is a folder, not a file; give the path of a file to write (a new name, "
                              f"or an existing file to replace), e.g. {os.path.join(path, 'NAME')}")
    return path


def _protected(folder: Path) -> str | None:
    """Why ``folder`` (absolute) must never be replaced, or None: the filesystem root, the current folder,
    an ancestor of it, the home folder or an ancestor of that."""
    cwd = Path.cwd().resolve()
    if folder == Path(folder.anchor):
        return "the filesystem root"
    if folder == cwd:
        return "the current folder"
    if folder in cwd.parents:
        return f"an ancestor of the current folder {cwd}"
    try:
        home = Path.home().resolve()
    except (KeyError, RuntimeError):  # no $HOME and no passwd entry
        return None
    if folder == home:
        return "your home folder"
    if folder in home.parents:
        return f"an ancestor of your home folder {home}"
    return None


def check_output_dir(path: str | Path, *, marker: str, force: bool = False) -> Path:
    """``path`` as an output folder to write (or replace) as a whole; returns it made absolute.

    It may be missing, empty, or an earlier output of the same writer (it holds the file ``marker``);
    any other folder is replaced only with ``force``. The filesystem root, the current folder and its
    ancestors, and the home folder and its ancestors are refused even with ``force``.

    Args:
        path: the folder the user gave (``--out``).
        marker: the file every output of this writer holds (``export.json`` for an export folder).
        force: replace a non-empty folder that is not an earlier output (``--force``).
    Raises:
        OutputPathError: ``path`` is protected, is a file, or holds files without ``marker`` and not
            ``force`` (names the folder, a few of its entries and the fix).
    """
    out = Path(os.path.abspath(path))
    for folder in dict.fromkeys((out, out.resolve())):
        why = _protected(folder)
        if why:
            raise OutputPathError(f"refusing to replace {path}: it is {why} (not even with --force); "
                                  f"choose a new folder below it, e.g. {os.path.join(path, 'NAME')}")
    if os.path.lexists(out) and not out.is_dir():
        raise OutputPathError(f"{path} is a file, not a folder; choose a folder path, or remove the file first")
    if out.is_dir() and not force and not (out / marker).is_file():
        entries = sorted(p.name for p in out.iterdir())
        if entries:
            shown = ", ".join(entries[:_SHOWN_ENTRIES])
            more = f", ... ({len(entries)} entries)" if len(entries) > _SHOWN_ENTRIES else ""
            raise OutputPathError(f"{path} is not empty and is no earlier output (it has no {marker}): {shown}{more}; "
                                  "choose a new or empty folder, or pass --force to replace it and all it holds")
    return out


@contextlib.contextmanager
def output_dir(path: str | Path, *, marker: str, force: bool = False) -> Iterator[Path]:
    """Yield a new empty folder beside ``path`` to fill; when the block ends, it takes ``path``'s place.

    ``path`` is checked first (:func:`check_output_dir`), and again just before the swap. The swap never
    leaves zero copies: the old folder is renamed aside (``.<name>.<random>.old``), the new one renamed
    into place, then the old one deleted; if the second rename fails, the old one is renamed back. Until
    the swap, the old folder is untouched; if the block raises, the new folder is deleted. A kill
    between the two renames leaves ``path`` missing and the old folder aside: the next call renames it
    back before anything else (:func:`recover_output_dir`).

    Args:
        path, marker, force: see :func:`check_output_dir`; the block must write ``marker``.
    Raises:
        OutputPathError: see :func:`check_output_dir`.
        RuntimeError: the block wrote no ``marker`` (a writer's bug).
    """
    for line in recover_output_dir(path, marker=marker):
        print(f"nas: {line}", file=sys.stderr)
    out = check_output_dir(path, marker=marker, force=force)
    out.parent.mkdir(parents=True, exist_ok=True)
    new = _sibling(out, "tmp")
    new.mkdir()
    try:
        yield new
        if not (new / marker).is_file():
            raise RuntimeError(f"the writer of {out} left no {marker} in it")
        _replace_dir(new, check_output_dir(path, marker=marker, force=force))
    except BaseException:
        shutil.rmtree(new, ignore_errors=True)
        raise


def recover_output_dir(path: str | Path, *, marker: str) -> list[str]:
    """Undo what a kill during :func:`output_dir`'s swap left beside ``path``; returns what was done, a line each.

    - ``path`` missing and exactly one old folder aside (``.<name>.<random>.old``): it is renamed back, so
      the earlier output is where the user left it.
    - ``path`` present: an old folder aside that holds ``marker`` (an earlier output this writer replaced)
      is deleted; one without it (replaced with ``force``) is kept and named, for the user to look at.

    Nothing else is touched: a ``.tmp`` sibling may belong to a writer still running.
    """
    out = Path(os.path.abspath(path))
    if not out.parent.is_dir():
        return []
    asides = sorted(out.parent.glob(f".{out.name}.*.old"))
    done: list[str] = []
    if not os.path.lexists(out):
        if len(asides) == 1:
            os.rename(asides[0], out)
            fsync_dir(out.parent)
            done.append(f"{out}: restored from {asides[0].name}, left aside by an interrupted replacement")
        elif asides:
            done.append(f"{out} is missing and {len(asides)} earlier outputs lie beside it "
                        f"({', '.join(a.name for a in asides)}): rename the one to keep back to {out.name}")
        return done
    for aside in asides:
        if aside.is_symlink():
            aside.unlink()
            done.append(f"{aside}: a stale link left by an interrupted replacement, removed")
        elif (aside / marker).is_file():
            shutil.rmtree(aside, ignore_errors=True)
            done.append(f"{aside}: an earlier output left by an interrupted replacement, removed")
        else:
            done.append(f"{aside}: left by an interrupted replacement of {out.name}; kept (it is no output of "
                        f"this writer): delete it once you have looked at it")
    return done


def _sibling(path: Path, kind: str) -> Path:
    """A hidden, unused name beside ``path``: ``.<name>.<random>.<kind>``."""
    return path.with_name(f".{path.name}.{os.urandom(4).hex()}.{kind}")


def _replace_dir(new: Path, out: Path) -> None:
    """Rename the folder ``new`` to ``out`` (absolute), replacing what is there (see :func:`output_dir`)."""
    if not os.path.lexists(out):
        os.rename(new, out)
        fsync_dir(out.parent)
        return
    aside = _sibling(out, "old")
    os.rename(out, aside)
    try:
        os.rename(new, out)
    except BaseException:
        os.rename(aside, out)
        raise
    fsync_dir(out.parent)
    if aside.is_dir() and not aside.is_symlink():
        shutil.rmtree(aside, ignore_errors=True)
    else:  # a symbolic link to a folder: the link goes, its target stays
        aside.unlink(missing_ok=True)


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
