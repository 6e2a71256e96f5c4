"""The sweep's failure (below the stages that raise it: the runner and level 1 of the two-level search)."""

from __future__ import annotations

import signal

__all__ = ["SweepFailed", "SweepStopped"]


class SweepFailed(RuntimeError):
    """Every search trial failed (or the supernet training did); the message lists the errors."""


class SweepStopped(KeyboardInterrupt):
    """Ctrl-C (SIGINT) or SIGTERM (``kill PID``, a job scheduler's stop) reached the sweep's driver: raised in
    its main thread at a safe point (:mod:`nas.search.stop`); the sweep's RUNNING MLflow runs are marked KILLED
    and Ray is shut down, and running the sweep again resumes it. A ``KeyboardInterrupt``, so that what stops
    on Ctrl-C stops on it too. ``signum`` is the signal's number.
    """

    def __init__(self, signum: int):
        super().__init__(f"stopped by {signal.Signals(signum).name}")
        self.signum = signum
