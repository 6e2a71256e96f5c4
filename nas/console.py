"""The one way ``nas`` builds a rich console (standard library and rich only): lines are never hard-wrapped
(an arch string or a path stays whole in a log), nothing is highlighted, and colour codes are written only to a
terminal (rich's own detection; ``NO_COLOR`` and ``FORCE_COLOR`` are honoured)."""

from __future__ import annotations

import sys

from rich.console import Console

__all__ = ["make_console"]


def make_console(stderr: bool = True) -> Console:
    """A rich console on stderr (or stdout) that soft-wraps: a line longer than the terminal is left to the
    terminal, and a log file gets it on one line."""
    stream = sys.stderr if stderr else sys.stdout
    return Console(stderr=stderr, highlight=False, soft_wrap=True,
                   width=None if stream.isatty() else 200)
