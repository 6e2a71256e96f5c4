"""Counting the Ray clusters and the Ray sweeps a test session really started (printed at its end).

Every local Ray start, in the pytest process or in any subprocess (``nas sweep``, ``ray start --head``), creates a
session folder ``$RAY_TMPDIR/ray/session_<time>_<pid>``, and every ``tune.Tuner.fit`` on that cluster stages its
experiment in ``<session>/artifacts/<timestamp>/<experiment>`` (``ray.train.constants._get_ray_train_session_dir``).
The test session points ``RAY_TMPDIR`` (inherited by subprocesses) at a folder of its own, so the folders it finds
there at the end are its own, counted from what Ray wrote rather than from the tests' code:

- Ray starts: session folders;
- Ray sweeps: session folders in which Ray Tune ran (a ``nas sweep`` starts one local Ray and runs its supernet,
  level-1, search and fine-tune stages on it; a sweep that joins a running cluster is counted with that cluster);
- Tune experiments: the ``Tuner.fit`` calls.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

ENV = "RAY_TMPDIR"
"""The variable Ray reads for its temporary folder (``ray._common.utils.get_default_system_temp_dir``)."""
XDIST_PREFIX = "gw"
"""pytest-xdist's worker ids: ``gw0``, ``gw1``, ..."""


@dataclass(frozen=True)
class RayCounts:
    """What the Ray session folders created since :class:`RayCounter` started show."""

    starts: int
    """Local Ray clusters started (session folders)."""
    sweeps: int
    """Of those, the clusters on which Ray Tune ran at least one experiment."""
    experiments: int
    """``Tuner.fit`` calls (staged experiment folders)."""

    def line(self) -> str:
        return (f"{self.sweeps} Ray sweeps started ({self.starts} local Ray clusters, {self.experiments} Ray Tune "
                f"experiments), counted from the session folders in ${ENV}")


class RayCounter:
    """Points :data:`ENV` at a fresh folder for this process and its children (or keeps one already set, counting
    only the sessions created after this call); :meth:`counts` reads the folder, :meth:`close` removes an own one.

    ``worker`` (a pytest-xdist worker id, ``gw0``, ...) with :data:`ENV` already set (by xdist's controller, whose
    counter the workers inherit): the worker's Ray gets the subfolder ``<ENV>/<worker>``, so that neither worker's
    Ray finds the other's cluster (``ray_current_cluster``) and the controller still counts both."""

    def __init__(self, worker: str | None = None) -> None:
        preset = os.environ.get(ENV)
        self.owned = not preset
        # short, under /tmp: Ray's socket paths (<tmp>/ray/session_.../sockets/plasma_store) must fit in 107 bytes
        self.root = Path(preset) if preset else Path(tempfile.mkdtemp(prefix="nas-ray-", dir="/tmp"))
        if worker and preset:
            if not worker.startswith(XDIST_PREFIX):
                raise ValueError(f"worker {worker!r}: an xdist worker id starts with {XDIST_PREFIX!r} (gw0, gw1, ...), "
                                 "or pass None outside xdist")
            self.root = self.root / worker
            self.root.mkdir(exist_ok=True)
            self.owned = False  # the controller removes its folder, this one with it
        os.environ[ENV] = str(self.root)
        self.before = set(self._sessions())

    def _sessions(self) -> list[Path]:
        """Ray's session folders under the root, and under its pytest-xdist workers' subfolders (``gw0/``, ...: each
        worker points its Ray at one, ``tests/conftest.py``), so that xdist's controller counts both workers'."""
        folders = [self.root / "ray", *self.root.glob(f"{XDIST_PREFIX}*/ray")]
        return [p for folder in folders if folder.is_dir()
                for p in folder.glob("session_*") if p.is_dir() and not p.is_symlink()]  # not session_latest

    def counts(self) -> RayCounts:
        sessions = [p for p in self._sessions() if p not in self.before]
        experiments = [[e for e in (p / "artifacts").glob("*/*") if e.is_dir()] for p in sessions]
        return RayCounts(starts=len(sessions), sweeps=sum(1 for e in experiments if e),
                         experiments=sum(len(e) for e in experiments))

    def sessions_with_tune(self) -> set[Path]:
        """The session folders (new since the start) in which Ray Tune ran."""
        return {p for p in self._sessions() if p not in self.before and any(e.is_dir() for e in (p / "artifacts").glob("*/*"))}

    def close(self) -> None:
        if self.owned:
            shutil.rmtree(self.root, ignore_errors=True)
