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
import itertools
import json
import math
import numbers
import os
import re
import tempfile
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import mlflow
from mlflow.entities import Metric, Param, ViewType
from mlflow.tracking import MlflowClient

from nas.space.spec import Constraint, parse_constraint

if TYPE_CHECKING:
    from rich.table import Table

__all__ = [
    "DEFAULT_OBJECTIVES",
    "LEADERBOARD_STATUSES",
    "LeaderboardRow",
    "Objective",
    "ParetoScan",
    "find_sweep_run",
    "iter_leaderboard_rows",
    "pareto_mask",
    "pareto_scan",
    "sweep_constraints",
    "PARAM_CONSTRAINTS",
    "parse_objectives",
    "parse_where",
    "sweep_objectives",
    "end_run",
    "end_stale_runs",
    "find_tagged_runs",
    "log_new_params",
    "reopen_run",
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


TAG_STAGE = "nas.stage"
STAGE_NAMES = {1: "joint", 2: "word_distill", 3: "seq_distill"}


class StageRuns:
    """Routes supernet-training reports to one nested MLflow run per training stage (Scalable Transformers sec. 3.3).

    Every report goes to the supernet run; a report with ``stage`` (1, 2, 3) also goes to that stage's
    child run ``stage N (name)`` (role ``stage``, tag ``nas.stage``), created at its first report or,
    after a restart, found again under the same supernet run. A report with ``stage_end`` (the
    reference sub-Transformers' BLEU/chrF, :func:`trainers.train_supernet`) is logged to the stage run,
    which then ends FINISHED, and to the supernet run with a ``stage{N}_`` prefix.

    Raises:
        mlflow.MlflowException: from the store.
    """

    def __init__(self, experiment: str, supernet_run_id: str, tags: Mapping[str, str] | None = None) -> None:
        self.experiment, self.parent = experiment, supernet_run_id
        self.tags = dict(tags or {})
        self.open: dict[int, str] = {}

    def __call__(self, metrics: Mapping[str, float]) -> None:
        """Log one report (its ``step`` key is the MLflow step)."""
        step = int(metrics.get("step", 0))
        stage = metrics.get("stage")
        values = {k: v for k, v in metrics.items() if k not in ("step", "stage_end")}
        if stage is None:
            log_metrics(self.parent, values, step)
            return
        n = int(stage)
        end = bool(metrics.get("stage_end"))
        log_metrics(self.parent, {f"stage{n}_{k}": v for k, v in values.items() if k != "stage"} if end else values,
                    step)
        run = self._run(n)
        log_metrics(run, values, step)
        if end:
            end_run(run)
            self.open.pop(n, None)

    def close(self, status: str = "FINISHED") -> None:
        """End the stage runs still open (``FAILED``/``KILLED`` when training stopped early)."""
        for run in self.open.values():
            end_run(run, status)
        self.open.clear()

    def _run(self, n: int) -> str:
        if n not in self.open:
            client = get_client()
            found = client.search_runs([client.get_run(self.parent).info.experiment_id],
                                       " AND ".join(_filter(**{TAG_PARENT: self.parent, TAG_STAGE: str(n)})),
                                       ViewType.ACTIVE_ONLY, 1)
            if found:
                run_id = found[0].info.run_id
                if found[0].info.status != "RUNNING":
                    client.update_run(run_id, status="RUNNING")
            else:
                run_id = start_run(self.experiment, f"stage {n} ({STAGE_NAMES.get(n, '?')})", role="stage",
                                   parent_run_id=self.parent, tags={**self.tags, TAG_STAGE: str(n)})
            self.open[n] = run_id
        return self.open[n]


# --------------------------------------------------------------------------- resume

TAG_OPTUNA_TRIAL = "nas.optuna_trial"
TAG_ERROR = "nas.error"


def find_tagged_runs(experiment: str, tags: Mapping[str, str], *, status: str | None = None) -> list[mlflow.entities.Run]:
    """Active runs of ``experiment`` carrying every tag in ``tags`` (and ``status`` if given: RUNNING,
    FINISHED, FAILED, KILLED), oldest first; [] when the experiment does not exist yet.

    Raises:
        mlflow.MlflowException: store errors.
    """
    client = get_client()
    exp = client.get_experiment_by_name(experiment)
    if exp is None or exp.lifecycle_stage == "deleted":
        return []
    clauses = _filter(**{str(k): str(v) for k, v in tags.items()})
    if status is not None:
        clauses.append(f"attributes.status = {_quote(status)}")
    runs: list[mlflow.entities.Run] = []
    token = None
    while True:
        page = client.search_runs([exp.experiment_id], " AND ".join(clauses), ViewType.ACTIVE_ONLY, _PAGE_SIZE,
                                  order_by=["attributes.start_time ASC"], page_token=token)
        runs.extend(page)
        token = page.token
        if not token:
            return runs


def log_new_params(run_id: str, params: Mapping[str, object]) -> dict[str, tuple[str, str]]:
    """Log the flattened ``params`` that the run does not have yet (a resumed run keeps its first values:
    MLflow params are immutable). Returns ``{key: (logged value, new value)}`` for the keys logged
    earlier with a different value; those are not re-logged.

    Raises:
        mlflow.MlflowException: unknown run or store errors.
    """
    client = get_client()
    logged = client.get_run(run_id).data.params
    new = {k: str(v) for k, v in flatten(params).items()}
    conflicts = {k: (logged[k], v) for k, v in new.items() if k in logged and logged[k] != v}
    missing = [Param(k, v) for k, v in new.items() if k not in logged]
    for i in range(0, len(missing), _PARAMS_PER_BATCH):
        client.log_batch(run_id, params=missing[i : i + _PARAMS_PER_BATCH])
    return conflicts


def reopen_run(run_id: str) -> None:
    """Set an ended run back to RUNNING: a resumed trial or sweep continues in its own run.

    Raises:
        mlflow.MlflowException: unknown run or store errors.
    """
    get_client().update_run(run_id, status="RUNNING")


def end_stale_runs(experiment: str, sweep_id: str, *, status: str = "KILLED",
                   keep: tuple[str, ...] = ()) -> list[str]:
    """End every RUNNING run tagged ``nas.sweep_id=sweep_id`` (left RUNNING by a killed driver) with
    ``status``, except the run ids in ``keep``; returns the ended run ids. Call it only while no other
    driver works on the sweep.

    Raises:
        ValueError: unknown status.
        mlflow.MlflowException: store errors.
    """
    ended = []
    for run in find_tagged_runs(experiment, {TAG_SWEEP_ID: sweep_id}, status="RUNNING"):
        if run.info.run_id not in keep:
            end_run(run.info.run_id, status)
            ended.append(run.info.run_id)
    return ended


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
    pareto: bool | None = None
    """On the Pareto front of the trials scanned (:func:`pareto_scan`); ``None`` where not computed."""


def _row(run: mlflow.entities.Run) -> LeaderboardRow:
    m, t = run.data.metrics, run.data.tags
    return LeaderboardRow(
        run_id=run.info.run_id,
        arch=t.get(TAG_ARCH_SUMMARY, ""),
        **{k: m.get(k) for k in _ROW_METRICS},
        sweep_id=t.get(TAG_SWEEP_ID),
        arch_id=t.get(TAG_ARCH_ID),
    )


LEADERBOARD_STATUSES = ("FINISHED", "FAILED", "KILLED", "RUNNING", "all")
"""Values of the ``status`` filter: one MLflow run status, or ``all``."""

_MAX_PAGE = 50_000  # MLflow's limit on max_results
_WHERE = re.compile(r"^\s*([A-Za-z_][A-Za-z0-9_.]*)\s*(<=|>=|==|!=|<|>|=)\s*"
                    r"([-+]?(?:\d+\.?\d*|\.\d+)(?:[eE][-+]?\d+)?)\s*$")
_WHERE_OPS = {"<=": "<=", ">=": ">=", "<": "<", ">": ">", "==": "=", "=": "=", "!=": "!="}


def parse_where(expr: str) -> str:
    """Turn a constraint ``METRIC OP NUMBER`` (e.g. ``"latency_ms<=40"``; OP one of <=, <, >=, >,
    ==, !=) into an MLflow filter clause (``metrics.`latency_ms` <= 40.0``). Runs lacking the metric
    never satisfy a constraint on it.

    Raises:
        ValueError: the expression does not parse, names a metric that is not a row metric, or its
            value is not a finite number (the message quotes the expression).
    """
    m = _WHERE.match(expr)
    if m is None:
        raise ValueError(f"bad constraint {expr!r}: expected METRIC OP NUMBER with OP one of "
                         "<=, <, >=, >, ==, != (e.g. 'latency_ms<=40')")
    name, op, text = m.groups()
    if name not in _ROW_METRICS:
        raise ValueError(f"bad constraint {expr!r}: unknown metric {name!r}; expected one of "
                         f"{', '.join(_ROW_METRICS)}")
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"bad constraint {expr!r}: {text!r} is not a finite number")
    return f"metrics.`{name}` {_WHERE_OPS[op]} {value!r}"


def _trial_filter(sweep_id: str | None, status: str, where: Sequence[str]) -> str:
    if status not in LEADERBOARD_STATUSES:
        raise ValueError(f"unknown status {status!r}; expected one of {', '.join(LEADERBOARD_STATUSES)}")
    clauses = _filter(**{TAG_ROLE: "trial", TAG_SWEEP_ID: sweep_id})
    if status != "all":
        clauses.append(f"attributes.status = '{status}'")
    clauses.extend(parse_where(w) for w in where)
    return " AND ".join(clauses)


def iter_leaderboard_rows(
    experiment: str,
    *,
    sweep_id: str | None = None,
    status: str = "FINISHED",
    where: Sequence[str] = (),
    metric: str | None = None,
    ascending: bool | None = None,
    page_size: int = _PAGE_SIZE,
    limit: int | None = None,
) -> Iterator[LeaderboardRow]:
    """Trial runs (``nas.role=trial``) of ``experiment`` as rows, fetched lazily page by page.

    Each page is one ``search_runs`` call of at most ``page_size`` runs (and at most the ``limit``
    rows still wanted), continued with its ``page_token``; only the current page is held in memory,
    so a caller that stops iterating stops the queries. Filters run in the tracking store:
    ``sweep_id`` (tag ``nas.sweep_id``), ``status`` (one of :data:`LEADERBOARD_STATUSES`), and
    every ``where`` constraint (:func:`parse_where`). With ``metric`` the rows come best first
    (``ascending`` defaults to True for latency_ms/params_m/valid_loss); runs lacking it come last.
    Arguments are checked when the function is called, before the first row is asked for.

    Raises:
        ValueError: unknown status or metric, a bad ``where`` expression, ``page_size`` or
            ``limit`` < 1.
        LookupError: no active experiment named ``experiment``.
    """
    if page_size < 1:
        raise ValueError(f"page_size must be >= 1, got {page_size}")
    if limit is not None and limit < 1:
        raise ValueError(f"limit must be >= 1, got {limit}")
    if metric is not None and metric not in _ROW_METRICS:
        raise ValueError(f"unknown metric {metric!r}; expected one of {', '.join(_ROW_METRICS)}")
    filter_string = _trial_filter(sweep_id, status, where)
    order = None
    if metric is not None:
        asc = metric in _LOWER_IS_BETTER if ascending is None else ascending
        order = [f"metrics.`{metric}` {'ASC' if asc else 'DESC'}"]
    client = get_client()
    exp_id = _experiment_id(client, experiment)

    def pages() -> Iterator[LeaderboardRow]:
        token, fetched = None, 0
        while limit is None or fetched < limit:
            want = page_size if limit is None else min(page_size, limit - fetched)
            page = client.search_runs([exp_id], filter_string, ViewType.ACTIVE_ONLY, min(want, _MAX_PAGE),
                                      order_by=order, page_token=token)
            fetched += len(page)
            yield from (_row(r) for r in page)
            token = page.token
            if not token:
                return

    return pages()


def leaderboard(
    experiment: str,
    *,
    metric: str = "bleu",
    top: int = 10,
    ascending: bool | None = None,
    sweep_id: str | None = None,
    status: str = "FINISHED",
    where: Sequence[str] = (),
    page_size: int = _PAGE_SIZE,
) -> list[LeaderboardRow]:
    """The best ``top`` trial runs (``nas.role=trial``) of ``experiment`` with ``status``, best first.

    Ordering, filtering and limiting happen in the tracking store (:func:`iter_leaderboard_rows`):
    no page is requested once ``top`` rows are found. ``ascending`` defaults to True for
    latency_ms/params_m/valid_loss and False otherwise; runs lacking the metric (or with NaN) come
    last. ``sweep_id`` restricts to trials tagged with that ``nas.sweep_id``; ``status`` is an MLflow
    run status or ``all``; ``where`` holds constraints such as ``"latency_ms<=40"``, all of which
    must hold.

    Raises:
        ValueError: ``metric`` is not a row metric, ``top`` or ``page_size`` < 1, an unknown status,
            or a bad ``where`` expression (named).
        LookupError: no active experiment named ``experiment``.
    """
    if metric not in _ROW_METRICS:
        raise ValueError(f"unknown metric {metric!r}; expected one of {', '.join(_ROW_METRICS)}")
    if top < 1:
        raise ValueError(f"top must be >= 1, got {top}")
    rows = iter_leaderboard_rows(experiment, sweep_id=sweep_id, status=status, where=where, metric=metric,
                                 ascending=ascending, page_size=page_size, limit=top)
    return list(itertools.islice(rows, top))


# --------------------------------------------------------------------------- Pareto front


@dataclass(frozen=True)
class Objective:
    """One axis of a Pareto front: a row metric (see :class:`LeaderboardRow` for units) and its goal."""

    metric: str
    maximize: bool

    def __str__(self) -> str:
        return f"{self.metric}:{'max' if self.maximize else 'min'}"


DEFAULT_OBJECTIVES = (Objective("bleu", True), Objective("latency_ms", False))
"""BLEU up, latency down: the front a sweep is judged by unless its YAML or the CLI names others."""


def parse_objectives(text: str) -> tuple[Objective, ...]:
    """``"bleu:max,latency_ms:min"`` -> ``(Objective("bleu", True), Objective("latency_ms", False))``.

    Goals: ``max``/``maximize`` or ``min``/``minimize``.

    Raises:
        ValueError: an item is not ``METRIC:GOAL``, names an unknown metric or goal, or a metric
            repeats (the message quotes the item).
    """
    goals = {"max": True, "maximize": True, "min": False, "minimize": False}
    out: list[Objective] = []
    for item in (part.strip() for part in text.split(",")):
        name, sep, goal = item.partition(":")
        name, goal = name.strip(), goal.strip().lower()
        if not sep or goal not in goals:
            raise ValueError(f"bad objective {item!r} in {text!r}: expected METRIC:max or METRIC:min "
                             "(e.g. 'bleu:max,latency_ms:min')")
        if name not in _ROW_METRICS:
            raise ValueError(f"bad objective {item!r}: unknown metric {name!r}; expected one of "
                             f"{', '.join(_ROW_METRICS)}")
        if any(o.metric == name for o in out):
            raise ValueError(f"bad objectives {text!r}: {name!r} appears twice")
        out.append(Objective(name, goals[goal]))
    return tuple(out)


def _dominates(a: tuple[float, ...], b: tuple[float, ...]) -> bool:
    """``a`` dominates ``b`` (both minimised): no worse anywhere, strictly better somewhere."""
    return all(x <= y for x, y in zip(a, b)) and any(x < y for x, y in zip(a, b))


def pareto_mask(points: Sequence[Sequence[float | None]], maximize: Sequence[bool]) -> list[bool]:
    """Which points are non-dominated: ``mask[i]`` is True when no other point is at least as good
    as ``points[i]`` in every objective and strictly better in one.

    ``points`` is ``[n][k]`` (k = ``len(maximize)`` objective values per point); ``maximize[j]`` says
    whether objective j is better higher. Equal points do not dominate each other, so duplicates
    of a front point are all on the front. A point with a missing (None) or NaN value is never on
    the front and dominates nothing.

    Cost O(n log n + n f) for f front points: points are visited in lexicographic order of their
    minimised values, so a point can only be dominated by one visited before it, and only the
    front found so far needs checking (whatever dominates a dominated point is dominated by, or
    is, a front point).

    Raises:
        ValueError: ``maximize`` is empty, or a point has a length other than ``len(maximize)``.
    """
    k = len(maximize)
    if k == 0:
        raise ValueError("pareto_mask needs at least one objective")
    keyed: list[tuple[tuple[float, ...], int]] = []
    for i, p in enumerate(points):
        if len(p) != k:
            raise ValueError(f"point {i} has {len(p)} values, expected {k} (one per objective)")
        if any(v is None or math.isnan(v) for v in p):
            continue
        keyed.append((tuple(-float(v) if up else float(v) for v, up in zip(p, maximize)), i))
    keyed.sort()
    mask = [False] * len(points)
    front: list[tuple[float, ...]] = []
    for q, i in keyed:
        if not any(_dominates(f, q) for f in front):
            front.append(q)
            mask[i] = True
    return mask


@dataclass(frozen=True)
class ParetoScan:
    """What :func:`pareto_scan` found. Rows carry ``pareto`` flags."""

    rows: list[LeaderboardRow]
    """The best ``top`` rows by the ranking metric, best first."""
    front: list[LeaderboardRow]
    """Every non-dominated row, best first by the first objective."""
    scanned: int
    """Runs that matched the filters."""
    points: list[tuple[float | None, ...]]
    """``[scanned][k]`` objective values of every matched run (only with ``keep_points``)."""
    objectives: tuple[Objective, ...]
    feasible: list[bool] = dataclasses.field(default_factory=list)
    """``[scanned]``: whether each kept point satisfies the scan's constraints (only with ``keep_points``)."""

    def front_flags(self) -> list[bool]:
        """``[scanned]``: whether each kept point is on the front of the feasible points."""
        flags = pareto_mask([p for p, ok in zip(self.points, self.feasible) if ok],
                            [o.maximize for o in self.objectives]) if any(self.feasible) else []
        it = iter(flags)
        return [next(it) if ok else False for ok in self.feasible]


def pareto_scan(
    experiment: str,
    objectives: Sequence[Objective] = DEFAULT_OBJECTIVES,
    *,
    metric: str | None = None,
    top: int = 10,
    sweep_id: str | None = None,
    status: str = "FINISHED",
    where: Sequence[str] = (),
    page_size: int = _PAGE_SIZE,
    keep_points: bool = False,
    constraints: Sequence[Constraint] = (),
) -> ParetoScan:
    """Page through every matching trial run once, keeping only the best ``top`` rows (ranked by
    ``metric``, default the first objective's metric in its goal's order), the Pareto front so far
    and, with ``keep_points``, the objective values (k floats per run, for plots).

    The front is updated one page at a time as front(front + page) with :func:`pareto_mask`, so
    memory holds one page, the front and the top rows, whatever the number of runs.
    Filters as in :func:`iter_leaderboard_rows`. With ``constraints`` (a sweep's ``search.constraints``, see
    :func:`sweep_constraints`) only the rows satisfying all of them can be on the front (Optuna's
    ``study.best_trials`` rule); the others stay in ``rows`` and ``points``.

    Raises:
        ValueError: no objectives, a repeated or unknown metric, ``top`` < 1, or a bad filter.
        LookupError: no active experiment named ``experiment``.
    """
    objectives = tuple(objectives)
    if not objectives or len({o.metric for o in objectives}) != len(objectives):
        raise ValueError(f"objectives must be one or more distinct metrics, got {', '.join(map(str, objectives))}")
    for o in objectives:
        if o.metric not in _ROW_METRICS:
            raise ValueError(f"unknown objective metric {o.metric!r}; expected one of {', '.join(_ROW_METRICS)}")
    if top < 1:
        raise ValueError(f"top must be >= 1, got {top}")
    metric = metric or objectives[0].metric
    ascending = None if metric != objectives[0].metric else not objectives[0].maximize
    maximize = [o.maximize for o in objectives]

    def values(row: LeaderboardRow) -> tuple[float | None, ...]:
        return tuple(getattr(row, o.metric) for o in objectives)

    rows = iter_leaderboard_rows(experiment, sweep_id=sweep_id, status=status, where=where, metric=metric,
                                 ascending=ascending, page_size=page_size)
    best: list[LeaderboardRow] = []
    front: list[LeaderboardRow] = []
    points: list[tuple[float | None, ...]] = []
    feasible: list[bool] = []
    scanned = 0

    def ok(row: LeaderboardRow) -> bool:
        return all(getattr(row, c.metric) is not None and c.violation(getattr(row, c.metric)) <= 0 for c in constraints)

    for page in _chunks(rows, page_size):
        scanned += len(page)
        if len(best) < top:
            best.extend(page[: top - len(best)])
        if keep_points:
            points.extend(values(r) for r in page)
            feasible.extend(ok(r) for r in page)
        candidates = front + [r for r in page if ok(r)]
        front = [r for r, on in zip(candidates, pareto_mask([values(r) for r in candidates], maximize)) if on]
    on_front = {r.run_id for r in front}
    first = objectives[0]
    front.sort(key=lambda r: -getattr(r, first.metric) if first.maximize else getattr(r, first.metric))
    flag = lambda r: dataclasses.replace(r, pareto=r.run_id in on_front)  # noqa: E731
    return ParetoScan(rows=[flag(r) for r in best], front=[flag(r) for r in front], scanned=scanned,
                      points=points, objectives=objectives, feasible=feasible)


def _chunks(items: Iterator[LeaderboardRow], size: int) -> Iterator[list[LeaderboardRow]]:
    chunk: list[LeaderboardRow] = []
    for item in items:
        chunk.append(item)
        if len(chunk) == size:
            yield chunk
            chunk = []
    if chunk:
        yield chunk


# --------------------------------------------------------------------------- sweeps


def find_sweep_run(sweep_id: str, experiment: str | None = None) -> mlflow.entities.Run:
    """The parent run (``nas.role=sweep``) of sweep ``sweep_id``: in ``experiment`` if given, else in
    any active experiment; the newest if several match.

    Raises:
        LookupError: no such sweep (or no active experiment named ``experiment``).
    """
    client = get_client()
    if experiment is not None:
        exp_ids = [_experiment_id(client, experiment)]
    else:
        exp_ids = [e.experiment_id for e in client.search_experiments(ViewType.ACTIVE_ONLY)]
    clauses = " AND ".join(_filter(**{TAG_ROLE: "sweep", TAG_SWEEP_ID: sweep_id}))
    runs = client.search_runs(exp_ids, clauses, ViewType.ACTIVE_ONLY, 1,
                              order_by=["attributes.start_time DESC"]) if exp_ids else []
    if not runs:
        where = f"experiment {experiment!r}" if experiment else "any experiment"
        raise LookupError(f"no sweep with nas.sweep_id {sweep_id!r} in {where} at {tracking_uri()}; "
                          "list sweeps with `nas leaderboard` or check --experiment")
    return runs[0]


TAG_OBJECTIVES = "nas.objectives"


PARAM_CONSTRAINTS = "search.constraints"
"""Param of a sweep's parent run: its ``search.constraints`` as ``; ``-joined keys (``latency_ms<=40``)."""


def sweep_constraints(run: mlflow.entities.Run) -> tuple[Constraint, ...]:
    """The ``search.constraints`` of a sweep's parent run (its :data:`PARAM_CONSTRAINTS` param); none if unset.

    Raises:
        ValueError: the param does not parse (:func:`nas.space.spec.parse_constraint`).
    """
    text = run.data.params.get(PARAM_CONSTRAINTS, "")
    return tuple(parse_constraint(c) for c in text.split(";") if c.strip())


def sweep_objectives(run: mlflow.entities.Run) -> tuple[Objective, ...]:
    """The two objectives of a sweep's parent run: its ``nas.objectives`` tag
    (``"bleu:max,latency_ms:min"``) if set, else the first two ``search.metrics`` of the sweep YAML
    logged as its artifact, else :data:`DEFAULT_OBJECTIVES` (also when the YAML has one metric).

    Raises:
        ValueError: the tag does not parse (:func:`parse_objectives`).
    """
    tag = run.data.tags.get(TAG_OBJECTIVES)
    if tag:
        return parse_objectives(tag)
    import yaml

    client = get_client()
    try:
        names = [a.path for a in client.list_artifacts(run.info.run_id) if a.path.endswith((".yaml", ".yml"))]
        if not names:
            return DEFAULT_OBJECTIVES
        with tempfile.TemporaryDirectory() as tmp:
            path = client.download_artifacts(run.info.run_id, names[0], tmp)
            raw = yaml.safe_load(Path(path).read_text(encoding="utf-8")) or {}
        metrics = (raw.get("search") or {}).get("metrics") or []
        objectives = tuple(Objective(m["name"], m.get("goal", "maximize") == "maximize") for m in metrics)
    except (OSError, KeyError, TypeError, AttributeError, yaml.YAMLError, mlflow.MlflowException):
        return DEFAULT_OBJECTIVES
    if len(objectives) < 2 or any(o.metric not in _ROW_METRICS for o in objectives[:2]):
        return DEFAULT_OBJECTIVES
    return objectives[:2]


# --------------------------------------------------------------------------- output


def _fmt(value: float | None, digits: int = 2) -> str:
    if value is None:
        return "-"
    if math.isnan(value):
        return "nan"
    return f"{value:.{digits}f}"


def leaderboard_table(rows: list[LeaderboardRow], title: str = "") -> Table:
    """A :class:`rich.table.Table` with columns rank, run id (first 8 chars), arch, BLEU, chrF,
    params (M), latency (ms); missing metrics shown as ``-``. When any row has a ``pareto`` flag,
    a last column ``front`` marks the non-dominated rows with ``*``."""
    from rich.table import Table

    table = Table(title=title or None)
    table.add_column("rank", justify="right")
    table.add_column("run id", style="dim")
    table.add_column("arch", overflow="fold")
    for name in ("BLEU", "chrF", "params (M)", "latency (ms)"):
        table.add_column(name, justify="right")
    marked = any(r.pareto is not None for r in rows)
    if marked:
        table.add_column("front", justify="center")
    for i, r in enumerate(rows, 1):
        cells = [str(i), r.run_id[:8], r.arch,
                 _fmt(r.bleu), _fmt(r.chrf), _fmt(r.params_m), _fmt(r.latency_ms)]
        table.add_row(*cells, *(["*" if r.pareto else ""] if marked else []))
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
                     "arch_id": pa.string(), "pareto": pa.bool_()}
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
