"""The retry helper that lets a sweep wait out a PostgreSQL restart, tested on plain functions that raise
SQLAlchemy's errors. The sweep through a real restart (``service postgresql stop``/``start`` mid-sweep: no trial lost
or told twice) is tested on the combined backends sweep (``tests/infra/test_backends_sweep.py``)."""

from __future__ import annotations

import time

import pytest
import sqlalchemy.exc

from nas.errors import NasError
from nas.search.retry import RETRY_ENV, retry_storage

WAITING = "waiting for the Optuna storage"


def _operational_error() -> sqlalchemy.exc.OperationalError:
    return sqlalchemy.exc.OperationalError("SELECT 1", {}, ConnectionRefusedError("connection refused\ndetail"))


def test_retry_storage_retries_a_transient_error_until_the_call_succeeds(monkeypatch, capsys):
    monkeypatch.setenv(RETRY_ENV, "30")
    calls = []

    @retry_storage("postgresql://nas:secret@db/optuna", first_wait_s=0.01)
    def flaky(x: int) -> int:
        calls.append(x)
        if len(calls) < 3:
            raise _operational_error()
        return x * 2

    assert flaky(21) == 42 and calls == [21, 21, 21]
    err = capsys.readouterr().err
    assert err.count(WAITING) == 1, err  # one line per outage, not per attempt
    assert "postgresql://nas:***@db/optuna" in err and "secret" not in err
    assert "retrying for up to 30 s" in err


def test_retry_storage_retries_a_wrapped_error_and_an_invalidated_connection(monkeypatch):
    monkeypatch.setenv(RETRY_ENV, "30")
    errors = [_operational_error(), sqlalchemy.exc.DBAPIError("SELECT 1", {}, OSError("reset"),
                                                              connection_invalidated=True)]

    @retry_storage("sqlite://", first_wait_s=0.01)
    def flaky() -> str:
        if errors:
            error = errors.pop(0)
            try:
                raise error
            except sqlalchemy.exc.OperationalError as e:  # as Optuna's RDBStorage wraps it
                raise RuntimeError("An exception is raised during the commit") from e
        return "ok"

    assert flaky() == "ok" and errors == []


def test_retry_storage_does_not_retry_a_non_transient_error(monkeypatch):
    monkeypatch.setenv(RETRY_ENV, "30")
    calls = []

    @retry_storage("sqlite://", first_wait_s=0.01)
    def broken() -> None:
        calls.append(1)
        raise sqlalchemy.exc.IntegrityError("INSERT", {}, ValueError("duplicate key"))

    with pytest.raises(sqlalchemy.exc.IntegrityError):
        broken()
    assert calls == [1]


def test_retry_storage_gives_up_after_its_bound_with_the_last_error(monkeypatch):
    monkeypatch.setenv(RETRY_ENV, "0.2")
    calls = []

    @retry_storage("sqlite://", first_wait_s=0.01)
    def down() -> None:
        calls.append(1)
        raise _operational_error()

    start = time.monotonic()
    with pytest.raises(sqlalchemy.exc.OperationalError):
        down()
    assert 0.2 <= time.monotonic() - start < 5 and len(calls) >= 2


def test_retry_storage_retries_only_the_outermost_call(monkeypatch):
    monkeypatch.setenv(RETRY_ENV, "30")
    calls = {"outer": 0, "inner": 0}

    @retry_storage("sqlite://", first_wait_s=0.01)
    def inner() -> None:
        calls["inner"] += 1
        if calls["inner"] == 1:
            raise _operational_error()

    @retry_storage("sqlite://", first_wait_s=0.01)
    def outer() -> None:
        calls["outer"] += 1
        inner()

    outer()
    assert calls == {"outer": 2, "inner": 2}  # the failed inner call is retried through the outer one


def test_retry_storage_bound_must_be_a_number(monkeypatch):
    monkeypatch.setenv(RETRY_ENV, "soon")

    @retry_storage("sqlite://")
    def down() -> None:
        raise _operational_error()

    with pytest.raises(NasError, match="NAS_BACKEND_RETRY_S=soon"):
        down()
