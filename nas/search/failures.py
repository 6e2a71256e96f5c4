"""The sweep's failure (below the stages that raise it: the runner and level 1 of the two-level search)."""

from __future__ import annotations

__all__ = ["SweepFailed"]


class SweepFailed(RuntimeError):
    """Every search trial failed (or the supernet training did); the message lists the errors."""
