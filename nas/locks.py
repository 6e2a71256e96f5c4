"""Advisory file locks (``flock``) that name their holder: one per run folder, one per data-cache entry.

A lock is a file opened with ``O_CREAT`` and locked with ``fcntl.flock``; once locked, the holder writes
its pid, host, start time and command into it (one JSON line). The kernel releases the lock when the
holder's file is closed, so a holder killed with ``kill -9`` releases it too: a stale lock file never
blocks anyone (its old contents are overwritten by the next holder). Locks are per open file, so a
second :func:`hold` of the same file in the same process is refused as well.

``flock`` is reliable on local filesystems; on NFS it depends on the mount (``local_lock``), so the
recorded host is what tells two machines apart in the error.

Imports the standard library and :mod:`nas.errors` only.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import socket
import time
from collections.abc import Iterator
from pathlib import Path

from nas.errors import NasError

__all__ = ["RUN_LOCK", "LockHeldError", "RunLockedError", "hold", "holder_text", "is_held", "lock_folder", "run_lock"]

RUN_LOCK = "run.lock"
"""The lock file of a run folder ``<workdir>/<name>/``."""


class LockHeldError(NasError):
    """Another process holds a lock this command needs (names its pid, host and start time)."""


class RunLockedError(LockHeldError):
    """Another ``nas`` process is writing into the same run folder ``<workdir>/<name>/``."""


def _holder_info(command: str) -> dict[str, object]:
    return {"pid": os.getpid(), "host": socket.gethostname(), "since": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "command": command}


def holder_text(path: str | Path) -> str:
    """Who holds (or last held) the lock file ``path``, as ``pid 123 on host h since T (nas sweep)``."""
    try:
        raw = Path(path).read_text(encoding="utf-8", errors="replace").strip()
        info = json.loads(raw) if raw else {}
    except (OSError, ValueError):
        info = {}
    if not isinstance(info, dict) or "pid" not in info:
        return "a process that has not recorded itself yet"
    text = f"pid {info['pid']} on host {info.get('host', '?')} since {info.get('since', '?')}"
    return text + (f" ({info['command']})" if info.get("command") else "")


@contextlib.contextmanager
def hold(path: str | Path, *, command: str = "", blocking: bool = False,
         error: type[LockHeldError] = LockHeldError, message: str = "") -> Iterator[Path]:
    """Hold the lock file ``path`` (created with its folder when missing) for the block.

    Args:
        path: the lock file.
        command: what the holder is doing, recorded for the error of the next one (``nas sweep``).
        blocking: wait for the holder to finish instead of raising.
        error, message: the error raised when held (``message`` is followed by the holder, then a fix).
    Raises:
        LockHeldError (``error``): not ``blocking`` and another open file holds the lock; names the holder.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            if not blocking:
                raise error(f"{message or f'{path} is locked'}: held by {holder_text(path)}; wait for it to "
                            f"finish, or stop that process (its lock {path} is released when it exits) and "
                            "run the command again") from None
            fcntl.flock(fd, fcntl.LOCK_EX)
        os.ftruncate(fd, 0)
        os.pwrite(fd, (json.dumps(_holder_info(command)) + "\n").encode(), 0)
        yield path
    finally:
        os.close(fd)  # releases the lock; the file stays (removing it would race with a new holder)


def is_held(path: str | Path) -> bool:
    """Whether another open file holds the lock ``path`` now (False when the file is missing)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(fd)
    return False


def run_lock(run_dir: str | Path, command: str) -> contextlib.AbstractContextManager[Path]:
    """Hold ``<run_dir>/run.lock`` while a command writes into the run folder ``run_dir`` (created when missing).

    Take it before writing anything into the folder (and before preparing data for it): a second
    ``nas sweep``, ``nas train`` or ``nas fidelity`` on the same folder is then refused at once.

    Args:
        run_dir: ``<workdir>/<name>``.
        command: what writes (``nas sweep``), named in the error of the next process.
    Raises:
        RunLockedError: another process holds it (one line naming its pid, host, start time and command).
    """
    return hold(Path(run_dir) / RUN_LOCK, command=command, error=RunLockedError,
                message=f"run folder {run_dir} is in use by another process")


def lock_folder(run_dir: str | Path, target: str | Path) -> Path:
    """The folder whose :func:`run_lock` guards writing ``target``: ``run_dir`` when ``target`` lies inside it
    (the default output folders), else ``target`` itself (a ``--out`` elsewhere)."""
    run_dir, target = Path(run_dir), Path(target)
    return run_dir if target.resolve().is_relative_to(run_dir.resolve()) else target
