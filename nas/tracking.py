"""MLflow tracking helpers for NAS sweeps: runs, params, metrics, artifacts and leaderboards.

Layout in MLflow: one *sweep* parent run (tags ``nas.sweep_id``, ``nas.role=sweep``), and under
it one ``nas.role=supernet`` child run plus one ``nas.role=trial`` child run per search trial
(tags ``nas.trial_id``, ``nas.arch_id``, ``nas.arch_summary``; metrics ``bleu``, ``chrf``,
``valid_loss``, ``params_m``, ``latency_ms``; params = the flattened architecture).

All functions talk to :func:`tracking_uri` through an :class:`mlflow.tracking.MlflowClient` and are
meant to be called from the driver process only (single writer).
"""

from __future__ import annotations

import csv
import dataclasses
import json
import math
import numbers
import os
import tempfile
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import mlflow
from mlflow.entities import Metric, Param, ViewType
from mlflow.tracking import MlflowClient

if TYPE_CHECKING:
    from rich.table import Table

__all__ = [
    "LeaderboardRow",
    "end_run",
    "ensure_experiment",
    "find_runs",
    "flatten",
    "get_client",
    "leaderboard",
    "leaderboard_table",
    "log_file_artifact",
    "log_json_artifact",
    "log_metrics",
    "start_run",
    "tracking_uri",
    "write_leaderboard",
]

TAG_ROLE = "nas.role"
TAG_SWEEP_ID = "nas.sweep_id"
TAG_TRIAL_ID = "nas.trial_id"
TAG_ARCH_ID = "nas.arch_id"
TAG_ARCH_SUMMARY = "nas.arch_summary"
TAG_PARENT = "mlflow.parentRunId"

_PARAMS_PER_BATCH = 100  # MLflow's limit on params (and tags) per log_batch call
_PAGE_SIZE = 1000
_END_STATUSES = ("FINISHED", "FAILED", "KILLED")
_ROW_METRICS = ("bleu", "chrf", "params_m", "latency_ms", "valid_loss")
_LOWER_IS_BETTER = frozenset({"latency_ms", "params_m", "valid_loss"})
_FORMATS = ("csv", "json", "parquet")


# --------------------------------------------------------------------------- client


def tracking_uri() -> str:
    """The MLflow tracking URI: ``$MLFLOW_TRACKING_URI`` if set (and non-empty), else an
    absolute SQLite URI ``sqlite:///<cwd>/mlflow.db``."""
    uri = os.environ.get("MLFLOW_TRACKING_URI")
    if uri:
        return uri
    return f"sqlite:///{(Path.cwd() / 'mlflow.db').resolve()}"


def get_client() -> MlflowClient:
    """A fresh :class:`MlflowClient` bound to :func:`tracking_uri`."""
    return MlflowClient(tracking_uri=tracking_uri())


def ensure_experiment(name: str) -> str:
    """Return the id of the experiment ``name``, creating it if missing and restoring it if it
    was soft-deleted.

    Raises:
        mlflow.MlflowException: if the tracking store rejects the request.
    """
    client = get_client()
    exp = client.get_experiment_by_name(name)
    if exp is None:
        return client.create_experiment(name)
    if exp.lifecycle_stage == "deleted":
        client.restore_experiment(exp.experiment_id)
    return exp.experiment_id


def _experiment_id(client: MlflowClient, name: str) -> str:
    """Id of an existing, active experiment; LookupError with a hint otherwise."""
    exp = client.get_experiment_by_name(name)
    if exp is None or exp.lifecycle_stage == "deleted":
        raise LookupError(
            f"no MLflow experiment named {name!r} at {tracking_uri()}; "
            "run `nas sweep FILE` first or set MLFLOW_TRACKING_URI"
        )
    return exp.experiment_id


# --------------------------------------------------------------------------- logging


def flatten(d: Mapping, prefix: str = "", sep: str = ".") -> dict[str, object]:
    """Flatten nested mappings and lists/tuples into one level with ``sep``-joined keys.

    ``{"encoder": {"width": [64, 128]}}`` -> ``{"encoder.width.0": 64, "encoder.width.1": 128}``.
    Sequence items are keyed by their index; strings are leaves; empty containers are kept as
    leaves (so no key silently disappears).
    """
    out: dict[str, object] = {}

    def visit(value: object, key: str) -> None:
        if isinstance(value, Mapping) and value:
            items = ((str(k), v) for k, v in value.items())
        elif isinstance(value, (list, tuple)) and value:
            items = ((str(i), v) for i, v in enumerate(value))
        else:
            out[key] = value
            return
        for k, v in items:
            visit(v, f"{key}{sep}{k}" if key else k)

    for k, v in d.items():
        visit(v, f"{prefix}{sep}{k}" if prefix else str(k))
    return out


def start_run(
    experiment: str,
    run_name: str,
    *,
    role: str,
    parent_run_id: str | None = None,
    tags: Mapping[str, str] | None = None,
    params: Mapping[str, object] | None = None,
) -> str:
    """Create a RUNNING run in ``experiment`` (created if missing) and return its run id.

    Tags: ``nas.role=role``, ``mlflow.parentRunId`` when ``parent_run_id`` is given, then ``tags``
    (values stringified). A child run inherits the parent's ``nas.sweep_id`` tag unless ``tags``
    sets one, so that sweep filters work on children. ``params`` are flattened (:func:`flatten`),
    stringified and logged in ``log_batch`` chunks of at most 100. If logging the params fails,
    the run is marked FAILED and the error re-raised.

    Raises:
        mlflow.MlflowException: unknown parent run, invalid keys/values, or store errors.
    """
    client = get_client()
    experiment_id = ensure_experiment(experiment)
    all_tags: dict[str, str] = {TAG_ROLE: role}
    if parent_run_id is not None:
        all_tags[TAG_PARENT] = parent_run_id
        parent_tags = client.get_run(parent_run_id).data.tags
        if TAG_SWEEP_ID in parent_tags:
            all_tags[TAG_SWEEP_ID] = parent_tags[TAG_SWEEP_ID]
    all_tags.update({str(k): str(v) for k, v in (tags or {}).items()})
    run_id = client.create_run(experiment_id, tags=all_tags, run_name=run_name).info.run_id
    if params:
        flat = [Param(k, str(v)) for k, v in flatten(params).items()]
        try:
            for i in range(0, len(flat), _PARAMS_PER_BATCH):
                client.log_batch(run_id, params=flat[i : i + _PARAMS_PER_BATCH])
        except Exception:
            client.set_terminated(run_id, "FAILED")
            raise
    return run_id


def log_metrics(run_id: str, metrics: Mapping[str, float], step: int = 0) -> None:
    """Log ``metrics`` at ``step`` in one ``log_batch`` call (timestamp: now, in ms).

    Real numbers (ints, floats, numpy scalars) are logged as floats, NaN/inf included; bools and
    non-numeric values are skipped. Nothing is sent if no value is numeric.

    Raises:
        mlflow.MlflowException: unknown run, more than 1000 metrics, or store errors.
    """
    ts = int(time.time() * 1000)
    batch = [
        Metric(str(k), float(v), ts, int(step))
        for k, v in metrics.items()
        if isinstance(v, numbers.Real) and not isinstance(v, bool)
    ]
    if batch:
        get_client().log_batch(run_id, metrics=batch)


def log_json_artifact(run_id: str, obj: object, filename: str) -> None:
    """Store ``obj`` as JSON artifact ``filename`` (a path relative to the run's artifact root,
    e.g. ``"arch.json"``) via ``MlflowClient.log_dict``.

    Raises:
        TypeError: ``obj`` is not JSON-serializable.
        mlflow.MlflowException: unknown run or store errors.
    """
    get_client().log_dict(run_id, obj, filename)


def log_file_artifact(run_id: str, path: str | Path) -> None:
    """Upload the local file ``path`` to the root of the run's artifacts.

    Raises:
        FileNotFoundError: ``path`` is not an existing file.
        mlflow.MlflowException: unknown run or store errors.
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"artifact file not found: {path}")
    get_client().log_artifact(run_id, str(path))


def end_run(run_id: str, status: str = "FINISHED") -> None:
    """Terminate the run with ``status`` (one of FINISHED, FAILED, KILLED; end time: now).

    Raises:
        ValueError: unknown status.
        mlflow.MlflowException: unknown run or store errors.
    """
    if status not in _END_STATUSES:
        raise ValueError(f"status must be one of {', '.join(_END_STATUSES)}, got {status!r}")
    get_client().set_terminated(run_id, status)


# --------------------------------------------------------------------------- querying


def _quote(value: str) -> str:
    return "'" + value.replace("\\", "\\\\").replace("'", "\\'") + "'"


def _filter(**tags: str | None) -> list[str]:
    return [f"tags.`{k}` = {_quote(v)}" for k, v in tags.items() if v is not None]


def find_runs(
    experiment: str,
    *,
    role: str | None = None,
    sweep_id: str | None = None,
    parent_run_id: str | None = None,
) -> list[mlflow.entities.Run]:
    """All active runs of ``experiment`` matching every given filter (``nas.role`` tag,
    ``nas.sweep_id`` tag, ``mlflow.parentRunId`` tag), newest first, paging through results.

    Raises:
        LookupError: no active experiment named ``experiment``.
    """
    client = get_client()
    exp_id = _experiment_id(client, experiment)
    clauses = _filter(**{TAG_ROLE: role, TAG_SWEEP_ID: sweep_id, TAG_PARENT: parent_run_id})
    runs: list[mlflow.entities.Run] = []
    token = None
    while True:
        page = client.search_runs(
            [exp_id], " AND ".join(clauses), ViewType.ACTIVE_ONLY, _PAGE_SIZE, page_token=token
        )
        runs.extend(page)
        token = page.token
        if not token:
            return runs


@dataclass(frozen=True)
class LeaderboardRow:
    """One finished trial. Metric units: BLEU and chrF in [0, 100], ``params_m`` in millions of
    parameters, ``latency_ms`` in milliseconds; ``None`` where the run lacks the metric."""

    run_id: str
    arch: str
    bleu: float | None
    chrf: float | None
    params_m: float | None
    latency_ms: float | None
    valid_loss: float | None
    sweep_id: str | None
    arch_id: str | None


def _row(run: mlflow.entities.Run) -> LeaderboardRow:
    m, t = run.data.metrics, run.data.tags
    return LeaderboardRow(
        run_id=run.info.run_id,
        arch=t.get(TAG_ARCH_SUMMARY, ""),
        **{k: m.get(k) for k in _ROW_METRICS},
        sweep_id=t.get(TAG_SWEEP_ID),
        arch_id=t.get(TAG_ARCH_ID),
    )


def leaderboard(
    experiment: str,
    *,
    metric: str = "bleu",
    top: int = 10,
    ascending: bool | None = None,
    sweep_id: str | None = None,
) -> list[LeaderboardRow]:
    """The best ``top`` FINISHED trial runs (``nas.role=trial``) of ``experiment``, best first.

    Ordering and limiting happen in the tracking store (``search_runs`` with ``order_by`` and
    ``max_results``). ``ascending`` defaults to True for latency_ms/params_m/valid_loss and False
    otherwise; runs lacking the metric (or with NaN) come last. ``sweep_id`` restricts to trials
    tagged with that ``nas.sweep_id``.

    Raises:
        ValueError: ``metric`` is not a row metric, or ``top`` < 1.
        LookupError: no active experiment named ``experiment``.
    """
    if metric not in _ROW_METRICS:
        raise ValueError(f"unknown metric {metric!r}; expected one of {', '.join(_ROW_METRICS)}")
    if top < 1:
        raise ValueError(f"top must be >= 1, got {top}")
    if ascending is None:
        ascending = metric in _LOWER_IS_BETTER
    client = get_client()
    exp_id = _experiment_id(client, experiment)
    clauses = _filter(**{TAG_ROLE: "trial", TAG_SWEEP_ID: sweep_id})
    clauses.append("attributes.status = 'FINISHED'")
    order = [f"metrics.`{metric}` {'ASC' if ascending else 'DESC'}"]
    rows: list[LeaderboardRow] = []
    token = None
    while len(rows) < top:
        page = client.search_runs(
            [exp_id],
            " AND ".join(clauses),
            ViewType.ACTIVE_ONLY,
            min(top - len(rows), 50_000),
            order_by=order,
            page_token=token,
        )
        rows.extend(_row(r) for r in page)
        token = page.token
        if not token:
            break
    return rows[:top]


# --------------------------------------------------------------------------- output


def _fmt(value: float | None, digits: int = 2) -> str:
    if value is None:
        return "-"
    if math.isnan(value):
        return "nan"
    return f"{value:.{digits}f}"


def leaderboard_table(rows: list[LeaderboardRow], title: str = "") -> Table:
    """A :class:`rich.table.Table` with columns rank, run id (first 8 chars), arch, BLEU, chrF,
    params (M), latency (ms); missing metrics shown as ``-``."""
    from rich.table import Table

    table = Table(title=title or None)
    table.add_column("rank", justify="right")
    table.add_column("run id", style="dim")
    table.add_column("arch", overflow="fold")
    for name in ("BLEU", "chrF", "params (M)", "latency (ms)"):
        table.add_column(name, justify="right")
    for i, r in enumerate(rows, 1):
        table.add_row(
            str(i), r.run_id[:8], r.arch,
            _fmt(r.bleu), _fmt(r.chrf), _fmt(r.params_m), _fmt(r.latency_ms),
        )
    return table


def write_leaderboard(rows: list[LeaderboardRow], fmt: str, out: str | Path) -> Path:
    """Write ``rows`` to ``out`` as ``fmt`` and return the path (parent dirs created).

    csv: header = :class:`LeaderboardRow` field names, ``None`` as an empty cell. json: a list of
    objects (``None`` as null, NaN as ``NaN``). parquet: one typed column per field (pyarrow).
    The file is written to a temporary sibling and moved into place with ``os.replace``.

    Raises:
        ValueError: ``fmt`` is not one of csv, json, parquet.
    """
    if fmt not in _FORMATS:
        raise ValueError(f"unknown leaderboard format {fmt!r}; expected one of {', '.join(_FORMATS)}")
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    names = [f.name for f in dataclasses.fields(LeaderboardRow)]
    records = [dataclasses.asdict(r) for r in rows]
    fd, tmp = tempfile.mkstemp(prefix=f".{out.name}.", suffix=".tmp", dir=out.parent)
    try:
        if fmt == "parquet":
            os.close(fd)
            import pyarrow as pa
            import pyarrow.parquet as pq

            types = {"run_id": pa.string(), "arch": pa.string(), "sweep_id": pa.string(),
                     "arch_id": pa.string()}
            schema = pa.schema([(n, types.get(n, pa.float64())) for n in names])
            pq.write_table(pa.Table.from_pylist(records, schema=schema), tmp)
        else:
            with os.fdopen(fd, "w", newline="", encoding="utf-8") as f:
                if fmt == "csv":
                    writer = csv.DictWriter(f, fieldnames=names)
                    writer.writeheader()
                    writer.writerows(records)
                else:
                    json.dump(records, f, indent=2)
                    f.write("\n")
        os.chmod(tmp, 0o644)  # mkstemp creates 0600
        os.replace(tmp, out)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return out
