"""Waiting out a database outage: retry a storage call while PostgreSQL restarts or the network drops.

A sweep keeps its Optuna study in a database (``tracking.optuna_storage``); a server restart mid-sweep makes
every call through SQLAlchemy raise until it is back. The searcher's calls are wrapped in
:func:`retry_storage`, which sleeps and retries them for a bounded time instead of crashing the driver.
What is retried must be safe to run again (the searcher checks a trial's state before telling it).
"""

from __future__ import annotations

import functools
import logging
import os
import sys
import threading
import time
from collections.abc import Callable
from typing import Any, TypeVar

import sqlalchemy.exc

from nas.errors import NasError, error_chain
from nas.redact import redact_url

__all__ = ["RETRY_ENV", "DEFAULT_RETRY_S", "retry_storage", "transient_error"]

RETRY_ENV = "NAS_BACKEND_RETRY_S"
"""Environment variable: how long (seconds) a storage call is retried before its error is raised."""
DEFAULT_RETRY_S = 120.0
"""Retry bound (seconds) when ``NAS_BACKEND_RETRY_S`` is not set."""
MAX_WAIT_S = 5.0
"""Longest sleep between two attempts (seconds); the sleeps double up to it."""

F = TypeVar("F", bound=Callable[..., Any])
_depth = threading.local()  # storage calls in progress in this thread: only the outermost one retries

OPTUNA_FALLBACK_LOGGER = "optuna.storages._rdb.storage"
OPTUNA_FALLBACK_WARNING = "Caught an error from sqlalchemy"
"""Optuna's ``RDBStorage._get_trials`` takes any ``OperationalError`` for too many SQL variables and logs this
(with the whole SQL statement) before it queries again the slow way; in an outage the second query fails too."""


class _DropOutageFallbackWarning(logging.Filter):
    """Drops Optuna's fallback warning (:data:`OPTUNA_FALLBACK_WARNING`) for a lost connection inside a call that
    :func:`retry_storage` retries: that call prints its own one line (``waiting for the Optuna storage ...``), and the
    warning, a dozen lines of SQL before it, misread the outage as a query too large. Any other record, and the same
    warning outside a retried call or for another error (SQLite's "too many SQL variables"), goes through."""

    def filter(self, record: logging.LogRecord) -> bool:
        if getattr(_depth, "n", 0) == 0:
            return True
        message = record.getMessage()
        return not (message.startswith(OPTUNA_FALLBACK_WARNING) and "connection" in message.lower())


logging.getLogger(OPTUNA_FALLBACK_LOGGER).addFilter(_DropOutageFallbackWarning())


def transient_error(error: BaseException) -> BaseException | None:
    """The connection error in ``error``'s chain (itself, ``__cause__``, ``__context__``), or None.

    Transient: ``sqlalchemy.exc.OperationalError`` (connection refused or dropped, server shutting down),
    ``sqlalchemy.exc.InterfaceError``, and any ``DBAPIError`` with ``connection_invalidated``. Optuna's
    ``RDBStorage`` wraps them in ``StorageInternalError``, hence the chain.
    """
    for link in error_chain(error):
        if isinstance(link, (sqlalchemy.exc.OperationalError, sqlalchemy.exc.InterfaceError)) or (
                isinstance(link, sqlalchemy.exc.DBAPIError) and link.connection_invalidated):
            return link
    return None


def _bound_s() -> float:
    raw = os.environ.get(RETRY_ENV)
    if raw is None:
        return DEFAULT_RETRY_S
    try:
        bound = float(raw)
    except ValueError:
        bound = float("nan")
    if not bound >= 0:  # also NaN
        raise NasError(f"{RETRY_ENV}={raw} is not a number of seconds >= 0 (how long to retry the storage)")
    return bound


def _first_line(error: BaseException) -> str:
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__


def retry_storage(where: str | Callable[[Any], str], first_wait_s: float = 0.5) -> Callable[[F], F]:
    """Decorator: call the function again while it raises a transient connection error (:func:`transient_error`).

    Sleeps ``first_wait_s`` seconds after the first failure, doubling up to :data:`MAX_WAIT_S`, for at most
    ``$NAS_BACKEND_RETRY_S`` seconds (default :data:`DEFAULT_RETRY_S`) counted from the first failure; prints
    one line to stderr when it starts waiting: ``waiting for the Optuna storage <URL, password masked>: <first line
    of the error>; retrying for up to N s``. A call made inside another decorated call is not retried on its own:
    its error goes up to the outermost call, which retries the whole, so waits never stack.

    Args:
        where: the storage URL or path for the message, or a function of the wrapped method's ``self`` giving it.
        first_wait_s: first sleep (seconds).

    Raises:
        NasError: ``$NAS_BACKEND_RETRY_S`` is not a number >= 0 (on the first failure).
        The wrapped function's error: at once when it is not transient, else the last one once the bound is spent.
    """

    def decorate(fn: F) -> F:
        @functools.wraps(fn)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            outermost = getattr(_depth, "n", 0) == 0
            deadline = wait_s = None
            while True:
                _depth.n = getattr(_depth, "n", 0) + 1
                try:
                    return fn(*args, **kwargs)
                except Exception as e:
                    cause = transient_error(e) if outermost else None
                    if cause is None:
                        raise
                    now = time.monotonic()
                    if deadline is None:
                        bound_s = _bound_s()
                        deadline, wait_s = now + bound_s, first_wait_s
                        location = where(args[0]) if callable(where) else where
                        print(f"waiting for the Optuna storage {redact_url(location)}: {_first_line(cause)}; "
                              f"retrying for up to {bound_s:g} s", file=sys.stderr, flush=True)
                    if now >= deadline:
                        raise
                    time.sleep(min(wait_s, max(deadline - now, 0.0)))
                    wait_s = min(wait_s * 2, MAX_WAIT_S)
                finally:
                    _depth.n -= 1

        return wrapper  # type: ignore[return-value]

    return decorate
