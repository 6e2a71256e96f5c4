"""resolve_run_id: git-style short run ids against a real MLflow store (SQLite in tmp_path)."""

from __future__ import annotations

import os

import pytest

import nas.tracking.runs as runs_module
from nas import tracking
from nas.errors import NasError, NotFoundError
from tests.conftest import EXP


@pytest.fixture
def runs(mlflow_uri):
    """Twenty runs in two experiments, one of them deleted; name -> run id."""
    ids = {f"run-{i}": tracking.start_run(EXP if i % 2 else "other", f"run-{i}", role="trial" if i % 3 else "export")
           for i in range(20)}
    tracking.get_client().delete_run(ids.pop("run-19"))
    return ids


def _unique_prefix(run_id: str, ids: list[str]) -> str:
    """The shortest prefix (4 hex digits at least) of ``run_id`` that no other id of ``ids`` starts with."""
    shared = max(len(os.path.commonprefix([run_id, other])) for other in ids if other != run_id)
    return run_id[:max(4, shared + 1)]


def test_full_id_is_fetched_directly_in_any_case(runs):
    run_id = runs["run-3"]
    assert tracking.resolve_run_id(run_id).info.run_id == run_id
    assert tracking.resolve_run_id(f" {run_id.upper()} ").info.run_name == "run-3"


def test_unique_prefix_finds_the_run_in_any_experiment(runs):
    for name in ("run-0", "run-7"):  # one per experiment
        run = tracking.resolve_run_id(_unique_prefix(runs[name], list(runs.values())))
        assert run.info.run_id == runs[name] and run.info.run_name == name


def test_prefix_matching_pages_through_every_experiment(runs, monkeypatch):
    monkeypatch.setattr(runs_module, "_PREFIX_PAGE_SIZE", 3)  # 19 runs: several pages per experiment
    ids = list(runs.values())
    for name, run_id in runs.items():
        assert tracking.resolve_run_id(_unique_prefix(run_id, ids)).info.run_name == name


def test_explicit_client_is_used(runs, monkeypatch):
    client = tracking.get_client()
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "sqlite:////nonexistent/elsewhere.db")
    assert tracking.resolve_run_id(runs["run-1"][:8], client=client).info.run_id == runs["run-1"]


def test_ambiguous_prefix_lists_both_runs_with_role_and_name(mlflow_uri, planted_ids):
    planted_ids("beef1", "beef2")
    a = tracking.start_run(EXP, "first", role="trial")
    b = tracking.start_run("other", "second", role="export")
    assert a.startswith("beef1") and b.startswith("beef2")  # the store took the planted ids
    with pytest.raises(NasError) as info:
        tracking.resolve_run_id("beef")
    message = str(info.value)
    assert f"run id prefix 'beef' matches 2 runs at {mlflow_uri}: " in message, message
    assert f"{a} (trial first), {b} (export second); pass more characters" in message, message
    assert tracking.resolve_run_id("BEEF2").info.run_id == b


def test_ambiguous_prefix_shows_five_and_counts_the_rest(mlflow_uri, planted_ids):
    planted_ids(*[f"abcd{i}" for i in range(7)])
    client, exp_id = tracking.get_client(), tracking.ensure_experiment(EXP)
    for i in range(7):  # runs that nas did not create: no nas.role tag
        client.create_run(exp_id, run_name=f"r{i}")
    with pytest.raises(NasError, match=r"matches 7 runs at .* and 2 more; pass more characters") as info:
        tracking.resolve_run_id("abcd")
    assert str(info.value).count("(no role r") == 5


def test_unknown_prefix_or_id_is_not_found_naming_the_store(runs, mlflow_uri):
    ids = list(runs.values())
    unknown = next(p for p in (f"{i:04x}" for i in range(1 << 16)) if not any(r.startswith(p) for r in ids))
    with pytest.raises(NotFoundError) as info:
        tracking.resolve_run_id(unknown)
    assert str(info.value) == (f"no MLflow run id starts with {unknown!r} at {mlflow_uri}; "
                               f"list runs with `nas leaderboard`")
    with pytest.raises(NotFoundError, match=f"no MLflow run {'0' * 32} at "):
        tracking.resolve_run_id("0" * 32)


def test_deleted_run_is_not_matched_by_prefix(mlflow_uri):
    run_id = tracking.start_run(EXP, "gone", role="trial")
    tracking.get_client().delete_run(run_id)
    with pytest.raises(NotFoundError, match="no MLflow run id starts with"):
        tracking.resolve_run_id(run_id[:8])


def test_password_in_tracking_uri_is_masked(monkeypatch):
    class Client:
        tracking_uri = "postgresql://nas:hunter2@db:5432/mlflow"

        def search_experiments(self, **kwargs):
            return _Page([])

    with pytest.raises(NotFoundError) as info:
        tracking.resolve_run_id("abcd", client=Client())
    assert "hunter2" not in str(info.value) and "postgresql://nas:***@db:5432/mlflow" in str(info.value)


class _Page(list):
    token = None


@pytest.mark.parametrize("value, problem", [
    ("abc", "too short"), ("", "not a hexadecimal"), ("12345xyz", "not a hexadecimal"), ("run-3", "not a hexadecimal"),
    ("a" * 33, "has 33 hex digits"),
])
def test_short_non_hex_or_long_values_are_refused_naming_the_value(value, problem):
    class NoClient:  # refused before any request
        def __getattr__(self, name):
            raise AssertionError(f"client.{name} called")

    with pytest.raises(NasError) as info:
        tracking.resolve_run_id(value, client=NoClient())
    assert problem in str(info.value) and repr(value) in str(info.value)
