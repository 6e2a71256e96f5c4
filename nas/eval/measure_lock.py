"""A node-wide reader-writer lock: latency is timed while nothing else of ours computes on the node.

Two Ray trials that time themselves side by side (or time themselves while another decodes its BLEU
sentences) measure each other: on a 2-core machine a quickstart measured 22-55 ms for archs that took
8.9-18.2 ms alone, and the narrowest sub-Transformer came out slower than the widest. So every process of
this user on this node that scores a trial shares one lock:

- :meth:`MeasureLock.exclusive` around a latency measurement (warm-up and timed passes): no other holder;
- :meth:`MeasureLock.shared` around the rest of the CPU-heavy scoring (BLEU decoding, validation loss):
  any number of holders at once, but never while a measurement runs.

It is ``flock(2)`` on two files in :func:`lock_dir` (``$NAS_LOCK_DIR``, else ``<tmp>/nas-<uid>``), so it
works across processes (Ray runs trials in worker processes of their own), a holder that crashes or is
killed releases it with its file descriptors, and the files are never deleted (deleting a lock file in use
would let a second process lock a new file of the same name). Waiting measurements go first: a shared holder
passes the ``gate`` file, which a measurement holds while it waits for the shared holders to finish, so a
stream of overlapping scorers cannot starve it.

Each hold is recorded (:class:`Hold`: mode, process id, wall-clock start and end from :func:`time.time`,
comparable across processes) in :attr:`MeasureLock.holds`, so a test or a user can check that no two
measurements and no scoring and measurement ever overlapped.

Standard library only; POSIX (``fcntl``). Locks are per open file description, so one process must not ask
for the exclusive lock while it holds the shared one (it would wait for itself).
"""

from __future__ import annotations

import fcntl
import os
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

__all__ = ["LOCK_DIR_ENV", "Hold", "MeasureLock", "lock_dir"]

LOCK_DIR_ENV = "NAS_LOCK_DIR"
"""Environment variable naming the folder of the lock files (every process of the node must see the same)."""


def lock_dir() -> Path:
    """The folder of the node's lock files: ``$NAS_LOCK_DIR`` if set, else ``<tempfile.gettempdir()>/nas-<uid>``
    (one per user: another user's processes cannot open the files, and must not be able to block ours)."""
    configured = os.environ.get(LOCK_DIR_ENV)
    if configured:
        return Path(configured)
    return Path(tempfile.gettempdir()) / f"nas-{os.getuid()}"


@dataclass
class Hold:
    """One holding of the lock. Times are wall-clock seconds since the epoch (:func:`time.time`)."""

    mode: str
    """``"exclusive"`` (a latency measurement) or ``"shared"`` (other scoring work)."""
    pid: int
    start_s: float
    """Taken right after the lock was granted."""
    end_s: float | None = None
    """Taken right before the lock was released; None while held."""

    def overlaps(self, other: "Hold") -> bool:
        """Whether the two holds' intervals share a moment (a hold still held extends to now)."""
        now = time.time()
        end = now if self.end_s is None else self.end_s
        other_end = now if other.end_s is None else other.end_s
        return self.start_s < other_end and other.start_s < end


class MeasureLock:
    """The node-wide measurement lock (see the module docstring).

    Args:
        folder: where the lock files ``measure.lock`` and ``measure.gate`` live (created with mode 0700 when
            missing); default :func:`lock_dir`.
    """

    def __init__(self, folder: str | Path | None = None) -> None:
        self.folder = Path(folder) if folder is not None else lock_dir()
        self.holds: list[Hold] = []
        """Every hold taken through this object, oldest first."""

    def _open(self, name: str) -> int:
        self.folder.mkdir(mode=0o700, parents=True, exist_ok=True)
        return os.open(self.folder / name, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)

    @contextmanager
    def exclusive(self) -> Iterator[Hold]:
        """Hold the lock alone: waits until no shared or exclusive holder is left (new shared holders wait
        behind this one). Yields the :class:`Hold`, whose ``end_s`` is set on leaving.

        Raises:
            OSError: the lock folder or files cannot be created or opened (names the path).
        """
        gate = self._open("measure.gate")
        try:
            fcntl.flock(gate, fcntl.LOCK_EX)  # later shared holders wait at the gate
            main = self._open("measure.lock")
            try:
                fcntl.flock(main, fcntl.LOCK_EX)  # the shared holders already in finish
                with self._record("exclusive") as hold:
                    yield hold
            finally:
                os.close(main)  # closing releases the flock, also when the process dies
        finally:
            os.close(gate)

    @contextmanager
    def shared(self) -> Iterator[Hold]:
        """Hold the lock beside other shared holders, never beside an exclusive one (a waiting exclusive
        holder goes first). Yields the :class:`Hold`, whose ``end_s`` is set on leaving.

        Raises:
            OSError: the lock folder or files cannot be created or opened (names the path).
        """
        main = self._open("measure.lock")
        try:
            gate = self._open("measure.gate")
            try:
                fcntl.flock(gate, fcntl.LOCK_EX)  # no measurement holds or waits for the lock
                fcntl.flock(main, fcntl.LOCK_SH)
            finally:
                os.close(gate)
            with self._record("shared") as hold:
                yield hold
        finally:
            os.close(main)

    @contextmanager
    def _record(self, mode: str) -> Iterator[Hold]:
        hold = Hold(mode, os.getpid(), time.time())
        self.holds.append(hold)
        try:
            yield hold
        finally:
            hold.end_s = time.time()
