"""The retry helper that lets a sweep wait out a PostgreSQL restart, tested on plain functions that raise
SQLAlchemy's errors. The sweep through a real restart (``service postgresql stop``/``start`` mid-sweep: no trial lost
or told twice) is tested on the combined backends sweep (``tests/infra/test_backends_sweep.py``)."""

from __future__ import annotations

import time

import pytest
import sqlalchemy.exc

from nas.errors import NasError
from nas.search.retry import RETRY_ENV, retry_storage, transient_error

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


def _optuna_records(monkeypatch, failures: list[str], retried: bool, tmp_path) -> tuple[list[str], object]:
    """Optuna's real ``RDBStorage.get_all_trials`` (SQLite) whose trial queries raise ``OperationalError`` with the
    messages in ``failures`` first, called inside :func:`retry_storage` or not; returns the messages Optuna's loggers
    emitted and the call's result (or the exception it raised)."""
    import logging

    import optuna
    import sqlalchemy.orm

    tmp_path.mkdir(parents=True, exist_ok=True)
    storage = optuna.storages.RDBStorage(f"sqlite:///{tmp_path / 'optuna.db'}")
    study = optuna.create_study(storage=storage)
    study.add_trial(optuna.trial.create_trial(value=1.0))
    real_all = sqlalchemy.orm.Query.all

    def failing_all(query):
        if failures and "trials" in str(query.statement):
            raise sqlalchemy.exc.OperationalError("SELECT trials", {}, Exception(failures.pop(0)))
        return real_all(query)

    monkeypatch.setattr(sqlalchemy.orm.Query, "all", failing_all)
    emitted: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: emitted.append(record.getMessage())
    logging.getLogger("optuna").addHandler(handler)
    call = lambda: storage.get_all_trials(study._study_id)  # noqa: E731
    try:
        result = retry_storage("sqlite://", first_wait_s=0.01)(call)() if retried else call()
    except Exception as e:  # noqa: BLE001
        result = e
    finally:
        logging.getLogger("optuna").removeHandler(handler)
    return emitted, result


def test_optunas_fallback_warning_for_a_lost_connection_is_dropped_inside_a_retried_call(monkeypatch, tmp_path,
                                                                                          capsys):
    """Seen in the backends sweep: PostgreSQL stopped during Optuna's trial query, which takes any OperationalError for
    too many SQL variables and logged "Caught an error from sqlalchemy: ... [SQL: SELECT ...] Falling back to a slower
    alternative." (a dozen lines) before the sweep's own waiting line. Inside a retried call that warning is dropped,
    and the call waits and succeeds; outside one, or for another error, it is still logged."""
    monkeypatch.setenv(RETRY_ENV, "30")
    lost = "consuming input failed: server closed the connection unexpectedly"
    emitted, result = _optuna_records(monkeypatch, [lost, lost], True, tmp_path / "a")
    assert [t.value for t in result] == [1.0]
    assert not [m for m in emitted if m.startswith("Caught an error from sqlalchemy")], emitted
    assert capsys.readouterr().err.count(WAITING) == 1

    emitted, result = _optuna_records(monkeypatch, [lost, lost], False, tmp_path / "b")
    assert isinstance(result, Exception) and transient_error(result) is not None  # Optuna wraps it
    assert any(m.startswith("Caught an error from sqlalchemy") for m in emitted), emitted  # not retried: kept

    emitted, result = _optuna_records(monkeypatch, ["too many SQL variables"], True, tmp_path / "c")
    assert [t.value for t in result] == [1.0]  # Optuna's slower query works: its warning is kept
    assert any("too many SQL variables" in m for m in emitted), emitted
