"""Test-only fault injection: the one module that reads ``NAS_TEST_FAULT``.

Production code marks the places a test may break with :func:`point`; unarmed (always, outside
tests) a point costs one ``os.environ`` lookup and does nothing. A test arms the points by
setting the environment variable (Ray workers of a local cluster inherit the driver's
environment, so setting it for ``nas sweep`` reaches the trials)::

    NAS_TEST_FAULT=KIND[:WHEN]

- KIND ``raise``: the point raises ``RuntimeError``; ``oom``: it raises
  ``torch.OutOfMemoryError``; ``nan``: it returns ``"nan"`` and the caller makes a metric NaN (the
  caller's NaN check must then turn it into ``FloatingPointError``).
- WHEN ``always`` (default): every call; ``first``: only a trial's first attempt (counted in the
  ``attempts`` file the caller names, so a retry from ``search.max_failures`` succeeds); ``even``:
  trials with an even number; a number P in (0, 1): each call with probability P.

The points today: ``score_trial`` (:func:`nas.search.trials.score_trial`).
"""

from __future__ import annotations

import os
import random
from pathlib import Path

from nas.io import atomic_write_text

__all__ = ["ENV", "KINDS", "point"]

ENV = "NAS_TEST_FAULT"
"""The environment variable that arms the fault points (tests only)."""
KINDS = ("raise", "nan", "oom")
"""The faults a point can show."""


def point(name: str, *, number: int | None = None, attempts: str | Path | None = None,
          label: str | None = None) -> str | None:
    """A fault point named ``name``: does nothing and returns None unless a test armed it.

    Args:
        name: the point's name (see the module docstring).
        number: the trial's number (for WHEN ``even``).
        attempts: a file counting this trial's attempts (for WHEN ``first``); updated atomically.
        label: what the injected error says failed (default: ``name``).

    Returns:
        ``"nan"`` when the armed fault is ``nan`` (the caller applies it), else None.

    Raises:
        RuntimeError: armed with ``raise``.
        torch.OutOfMemoryError: armed with ``oom``.
        ValueError: a malformed :data:`ENV` value (names it and the grammar), or WHEN ``first``
            without an ``attempts`` file.
    """
    value = os.environ.get(ENV)
    if not value:
        return None
    kind, _, when = value.partition(":")
    grammar = f"{ENV}={value!r}: expected KIND[:WHEN], KIND in {'|'.join(KINDS)}, WHEN always|first|even|P"
    if kind not in KINDS:
        raise ValueError(grammar)
    if not _armed(when or "always", grammar, number, attempts):
        return None
    where = label or name
    if kind == "raise":
        raise RuntimeError(f"{ENV}=raise: injected failure in {where}")
    if kind == "oom":
        import torch  # only when a test armed it: this module stays torch-free

        raise torch.OutOfMemoryError(f"{ENV}=oom: injected out of memory in {where}")
    return kind


def _armed(when: str, grammar: str, number: int | None, attempts: str | Path | None) -> bool:
    if when == "always":
        return True
    if when == "first":
        if attempts is None:
            raise ValueError(f"{ENV}=...:first needs a search trial with a results folder")
        return _count_attempt(Path(attempts)) == 1
    if when == "even":
        return number is not None and int(number) % 2 == 0
    try:
        p = float(when)
    except ValueError:
        raise ValueError(grammar) from None
    return random.random() < p


def _count_attempt(path: Path) -> int:
    """The attempt number (1 = first) counted in ``path``, which is then updated."""
    try:
        attempt = int(path.read_text()) + 1
    except (OSError, ValueError):
        attempt = 1
    atomic_write_text(path, str(attempt))
    return attempt
