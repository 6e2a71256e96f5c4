"""Test-only fault injection: the one module that reads ``NAS_TEST_FAULT``.

Production code marks the places a test may break with :func:`point`; unarmed (always, outside
tests) a point costs one ``os.environ`` lookup and does nothing. A test arms the points by
setting the environment variable (Ray workers of a local cluster inherit the driver's
environment, so setting it for ``nas sweep`` reaches the trials)::

    NAS_TEST_FAULT=KIND[:WHEN][,KIND[:WHEN]...]

- KIND ``raise``: the point raises ``RuntimeError``; ``oom``: it raises
  ``torch.OutOfMemoryError``; ``nan``: it returns ``"nan"`` and the caller makes a metric NaN (the
  caller's NaN check must then turn it into ``FloatingPointError``).
- WHEN ``always`` (default): every call; ``first``: only a trial's first attempt (counted in the
  ``attempts`` file the caller names, so a retry from ``search.max_failures`` succeeds); ``even``:
  trials with an even number; ``trialN``: the trial numbered N only; ``trialNfirst``: the first attempt of the
  trial numbered N only (a retry of it succeeds, while other trials of the sweep keep their own faults); a number P
  in (0, 1): each call with probability P.
- Several faults, comma-separated, arm one point together: the first whose WHEN holds fires, so one sweep can
  carry independent faults, e.g. ``raise:trial0,nan:trial1,oom:trial2,raise:trial3first``.

The points today: ``score_trial`` (:func:`nas.search.trials.score_trial`).

Kill points (:func:`kill_point`) are armed by a second variable, for the kill tests of
``benchmarks/bench_resume.py``::

    NAS_TEST_KILL=POINT[:N]      # SIGKILL the process the N-th time (default 1) it passes POINT

POINT is one of :data:`KILL_POINTS`: ``data_prepare`` (after each training shard the data preparation
writes, and once the cache's temporary folder is filled, not yet published), ``checkpoint_write`` (a checkpoint's temporary file is written, not yet renamed into place),
``mlflow_write`` (before an MLflow ``log_batch``), ``after_tell`` (Optuna was told a trial's result, its MLflow
run not yet ended), ``level1_batch`` (the evolution's level 1 told Optuna a scored batch of candidates). Passes are counted per process. Before the kill, the point appends ``POINT pid`` to the
file ``NAS_TEST_KILL_LOG`` names (if set), so a test knows where its kill landed.

Unset, empty or an "off" value (``0``, ``off``, ``false``, ``no``, ``none``; any case) arms nothing, so
``NAS_TEST_FAULT=0`` left in a shell never fails a user's sweep. Any other value that is not
``KIND[:WHEN]`` is refused by :func:`check`, which ``nas sweep`` calls before anything starts (exit 2,
one line), rather than failing every trial.
"""

from __future__ import annotations

import os
import random
from pathlib import Path

from nas.errors import NasError
from nas.atomic import atomic_write_text

__all__ = ["ENV", "KILL_ENV", "KILL_LOG_ENV", "KILL_POINTS", "KINDS", "OFF", "FaultSpecError", "check", "kill_point",
           "parse", "parse_kill", "point"]

ENV = "NAS_TEST_FAULT"
"""The environment variable that arms the fault points (tests only)."""
KINDS = ("raise", "nan", "oom")
"""The faults a point can show."""
OFF = ("", "0", "off", "false", "no", "none")
"""Values (stripped, lower-cased) that arm nothing, as if :data:`ENV` were unset."""
KILL_ENV = "NAS_TEST_KILL"
"""The environment variable that arms one kill point (tests only)."""
KILL_LOG_ENV = "NAS_TEST_KILL_LOG"
"""A file a kill point appends ``POINT pid`` to before it kills its process."""
KILL_POINTS = ("data_prepare", "checkpoint_write", "mlflow_write", "after_tell", "level1_batch")
"""The places a kill test may SIGKILL a process (see the module docstring)."""
_passes: dict[str, int] = {}


class FaultSpecError(NasError):
    """:data:`ENV` holds a value that is neither off nor ``KIND[:WHEN][,...]`` (names it, the grammar and how to
    unset it)."""


def parse(value: str | None) -> list[tuple[str, str]] | None:
    """The ``(kind, when)`` faults armed by the :data:`ENV` value ``value``, in order, or None when it arms nothing
    (unset or :data:`OFF`).

    Raises:
        FaultSpecError: any other value that is not ``KIND[:WHEN][,KIND[:WHEN]...]`` (names it and the grammar).
    """
    if value is None or value.strip().lower() in OFF:
        return None
    armed = []
    for item in value.split(","):
        kind, _, when = item.strip().partition(":")
        when = when or "always"
        if kind not in KINDS or not (when in ("always", "first", "even") or _trial(when) is not None
                                     or _trial_first(when) is not None or _probability(when) is not None):
            raise FaultSpecError(f"{ENV}={value!r}: expected KIND[:WHEN][,KIND[:WHEN]...], KIND in "
                                 f"{'|'.join(KINDS)}, WHEN always|first|even|trialN|trialNfirst|P with 0 < P < 1 "
                                 f"(a test-only hook: unset it, or set it to 0, to run without injected faults)")
        armed.append((kind, when))
    return armed


def check() -> None:
    """Refuse a malformed :data:`ENV` or :data:`KILL_ENV` before anything starts (``nas sweep`` calls it first).

    Raises:
        FaultSpecError: see :func:`parse` and :func:`parse_kill`.
    """
    parse(os.environ.get(ENV))
    parse_kill(os.environ.get(KILL_ENV))


def parse_kill(value: str | None) -> tuple[str, int] | None:
    """``(point, n)`` armed by the :data:`KILL_ENV` value ``value``, or None when it arms nothing (unset or
    :data:`OFF`).

    Raises:
        FaultSpecError: any other value that is not ``POINT[:N]`` with POINT in :data:`KILL_POINTS`, N >= 1.
    """
    if value is None or value.strip().lower() in OFF:
        return None
    name, _, n = value.strip().partition(":")
    if name in KILL_POINTS and (not n or (n.isdigit() and int(n) >= 1)):
        return name, int(n or 1)
    raise FaultSpecError(f"{KILL_ENV}={value!r}: expected POINT[:N], POINT in {'|'.join(KILL_POINTS)}, N >= 1 "
                         f"(a test-only hook: unset it, or set it to 0, to run without kills)")


def kill_point(name: str) -> None:
    """A kill point named ``name`` (one of :data:`KILL_POINTS`): does nothing unless :data:`KILL_ENV` arms it;
    then, on the armed pass, logs ``name pid`` to :data:`KILL_LOG_ENV` and SIGKILLs this process.

    Raises:
        FaultSpecError: a malformed :data:`KILL_ENV` (see :func:`parse_kill`).
    """
    armed = parse_kill(os.environ.get(KILL_ENV))
    if armed is None or armed[0] != name:
        return
    _passes[name] = _passes.get(name, 0) + 1
    if _passes[name] != armed[1]:
        return
    log = os.environ.get(KILL_LOG_ENV)
    if log:
        fd = os.open(log, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            os.write(fd, f"{name} {os.getpid()}\n".encode())
            os.fsync(fd)
        finally:
            os.close(fd)
    import signal

    os.kill(os.getpid(), signal.SIGKILL)


def _probability(when: str) -> float | None:
    try:
        p = float(when)
    except ValueError:
        return None
    return p if 0.0 < p < 1.0 else None


def point(name: str, *, number: int | None = None, attempts: str | Path | None = None,
          label: str | None = None) -> str | None:
    """A fault point named ``name``: does nothing and returns None unless a test armed it.

    Args:
        name: the point's name (see the module docstring).
        number: the trial's number (for WHEN ``even``, ``trialN`` and ``trialNfirst``).
        attempts: a file counting this trial's attempts (for WHEN ``first`` and ``trialNfirst``); updated
            atomically.
        label: what the injected error says failed (default: ``name``).

    Returns:
        ``"nan"`` when the fault that fires is ``nan`` (the caller applies it), else None.

    Raises:
        RuntimeError: armed with ``raise``.
        torch.OutOfMemoryError: armed with ``oom``.
        FaultSpecError: a malformed :data:`ENV` value (see :func:`parse`).
        ValueError: WHEN ``first`` (or ``trialNfirst`` on trial N) without an ``attempts`` file.
    """
    armed = parse(os.environ.get(ENV))
    kind = next((kind for kind, when in armed or () if _armed(when, number, attempts)), None)
    if kind is None:
        return None
    where = label or name
    if kind == "raise":
        raise RuntimeError(f"{ENV}=raise: injected failure in {where}")
    if kind == "oom":
        import torch  # only when a test armed it: this module stays torch-free

        raise torch.OutOfMemoryError(f"{ENV}=oom: injected out of memory in {where}")
    return kind


def _armed(when: str, number: int | None, attempts: str | Path | None) -> bool:
    if when == "always":
        return True
    if when == "first":
        return _first_attempt(attempts, when)
    if _trial_first(when) is not None:  # counted only on trial N: other trials' attempts files are left alone
        return number is not None and int(number) == _trial_first(when) and _first_attempt(attempts, when)
    if when == "even":
        return number is not None and int(number) % 2 == 0
    if _trial(when) is not None:
        return number is not None and int(number) == _trial(when)
    return random.random() < float(when)  # a probability: parse checked it


def _trial(when: str) -> int | None:
    """N of a WHEN ``trialN``, else None."""
    rest = when.removeprefix("trial")
    return int(rest) if rest != when and rest.isdigit() else None


def _trial_first(when: str) -> int | None:
    """N of a WHEN ``trialNfirst``, else None."""
    rest = when.removesuffix("first")
    return _trial(rest) if rest != when else None


def _first_attempt(attempts: str | Path | None, when: str) -> bool:
    """Whether this is the trial's first attempt (counted in ``attempts``, which is then updated)."""
    if attempts is None:
        raise ValueError(f"{ENV}=...:{when} needs a search trial with a results folder")
    return _count_attempt(Path(attempts)) == 1


def _count_attempt(path: Path) -> int:
    """The attempt number (1 = first) counted in ``path``, which is then updated."""
    try:
        attempt = int(path.read_text()) + 1
    except (OSError, ValueError):
        attempt = 1
    atomic_write_text(path, str(attempt))
    return attempt
