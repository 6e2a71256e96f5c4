"""The MLflow client of a sweep: experiments, runs (parent, children, per-stage runs), params, metrics, artifacts.

All functions talk to :func:`~nas.tracking.layout.tracking_uri` through an :class:`mlflow.tracking.MlflowClient`
and are meant to be called from the driver process only (single writer). The run layout is described in
:mod:`nas.tracking.layout`.
"""

from __future__ import annotations

import logging
import numbers
import os
import time
from collections.abc import Mapping
from pathlib import Path

# The tool prints its own lines: no per-download tqdm bars (the small JSON artifacts that leaderboards, reports and
# exports read) and no INFO lines ("Creating initial MLflow database tables...") from MLflow, unless the user asks
os.environ.setdefault("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "false")

import mlflow  # noqa: E402 (after the environment it reads)
from mlflow.entities import Metric, Param, ViewType  # noqa: E402
from mlflow.tracking import MlflowClient  # noqa: E402

from nas import faults
from nas.errors import NasError, NotFoundError
from nas.redact import redact_url
from nas.tracking.layout import STAGE_NAMES, TAG_PARENT, TAG_ROLE, TAG_STAGE, TAG_SWEEP_ID, tracking_uri

if "MLFLOW_LOGGING_LEVEL" not in os.environ:
    logging.getLogger("mlflow").setLevel(logging.WARNING)

__all__ = ["PAGE_SIZE", "get_client", "ensure_experiment", "experiment_id", "flatten", "start_run", "log_metrics",
           "log_json_artifact", "log_file_artifact", "end_run", "StageRuns", "find_tagged_runs", "log_new_params",
           "reopen_run", "end_stale_runs", "find_runs", "quote", "tag_filter", "resolve_run_id"]

PARAMS_PER_BATCH = 100  # MLflow's limit on params (and tags) per log_batch call
PAGE_SIZE = 1000
"""Runs per ``search_runs`` page."""
_END_STATUSES = ("FINISHED", "FAILED", "KILLED")


def get_client() -> MlflowClient:
    """A fresh :class:`MlflowClient` bound to :func:`tracking_uri`."""
    return MlflowClient(tracking_uri=tracking_uri())


def require_store() -> None:
    """Check that the tracking store a read-only command reads exists, before MLflow opens it: MLflow creates an
    empty SQLite file (and its tables) wherever a ``sqlite:///`` URI points, so ``nas leaderboard`` run from the
    wrong folder would leave a stray ``mlflow.db`` there and then report that nothing was found.

    Raises:
        NotFoundError: the URI is a SQLite file that does not exist (names the file and the two fixes).
    """
    from sqlalchemy.engine import make_url

    uri = tracking_uri()
    if not uri.startswith("sqlite:"):
        return
    database = make_url(uri).database  # the file, without the URI's query (which may hold a password)
    if not database or database == ":memory:" or database.startswith("file:"):
        return
    path = Path(database)
    if not path.is_file():
        raise NotFoundError(f"no MLflow store at {path.resolve()} (tracking URI {redact_url(uri)}): run from the "
                            "folder the sweep ran in (it holds mlflow.db), or set MLFLOW_TRACKING_URI (e.g. "
                            "sqlite:////abs/path/mlflow.db or http://host:5000)")


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


def experiment_id(client: MlflowClient, name: str) -> str:
    """Id of the existing, active experiment ``name``.

    Raises:
        LookupError: no active experiment of that name (with a hint).
    """
    exp = client.get_experiment_by_name(name)
    if exp is None or exp.lifecycle_stage == "deleted":
        raise NotFoundError(
            f"no MLflow experiment named {name!r} at {redact_url(tracking_uri())}; "
            "run `nas sweep FILE` first or set MLFLOW_TRACKING_URI"
        )
    return exp.experiment_id


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
            for i in range(0, len(flat), PARAMS_PER_BATCH):
                client.log_batch(run_id, params=flat[i : i + PARAMS_PER_BATCH])
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
        faults.kill_point("mlflow_write")  # tests only: a kill as an MLflow write starts
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
                                       " AND ".join(tag_filter(**{TAG_PARENT: self.parent, TAG_STAGE: str(n)})),
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
    clauses = tag_filter(**{str(k): str(v) for k, v in tags.items()})
    if status is not None:
        clauses.append(f"attributes.status = {quote(status)}")
    runs: list[mlflow.entities.Run] = []
    token = None
    while True:
        page = client.search_runs([exp.experiment_id], " AND ".join(clauses), ViewType.ACTIVE_ONLY, PAGE_SIZE,
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
    for i in range(0, len(missing), PARAMS_PER_BATCH):
        client.log_batch(run_id, params=missing[i : i + PARAMS_PER_BATCH])
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


def quote(value: str) -> str:
    """``value`` as a quoted string literal of an MLflow filter."""
    return "'" + value.replace("\\", "\\\\").replace("'", "\\'") + "'"


def tag_filter(**tags: str | None) -> list[str]:
    """MLflow filter clauses ``tags.`KEY` = 'VALUE'`` for the given tags (None values are left out)."""
    return [f"tags.`{k}` = {quote(v)}" for k, v in tags.items() if v is not None]


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
    exp_id = experiment_id(client, experiment)
    clauses = tag_filter(**{TAG_ROLE: role, TAG_SWEEP_ID: sweep_id, TAG_PARENT: parent_run_id})
    runs: list[mlflow.entities.Run] = []
    token = None
    while True:
        page = client.search_runs(
            [exp_id], " AND ".join(clauses), ViewType.ACTIVE_ONLY, PAGE_SIZE, page_token=token
        )
        runs.extend(page)
        token = page.token
        if not token:
            return runs



_HEX = frozenset("0123456789abcdef")
RUN_ID_LENGTH = 32
"""Hex digits of an MLflow run id (a UUID4 without dashes)."""
MIN_PREFIX_LENGTH = 4
"""The fewest hex digits :func:`resolve_run_id` matches (the leaderboard prints 8)."""
_PREFIX_PAGE_SIZE = 50_000
"""Runs per ``search_runs`` page when matching a prefix (the SQL store's largest page)."""
_SHOWN_MATCHES = 5
"""Matching runs an ambiguous prefix's error lists."""


def _runs_with_prefix(client: MlflowClient, prefix: str) -> list[mlflow.entities.Run]:
    """The active runs, in every active experiment, whose id starts with ``prefix`` (paging through both)."""
    matches: list[mlflow.entities.Run] = []
    experiments, token = [], None
    while True:
        page = client.search_experiments(view_type=ViewType.ACTIVE_ONLY, page_token=token)
        experiments += [e.experiment_id for e in page]
        token = page.token
        if not token:
            break
    for exp_id in experiments:
        token = None
        while True:
            page = client.search_runs([exp_id], "", ViewType.ACTIVE_ONLY, _PREFIX_PAGE_SIZE, page_token=token)
            matches += [run for run in page if run.info.run_id.startswith(prefix)]
            token = page.token
            if not token:
                break
    return sorted(matches, key=lambda run: run.info.run_id)


def resolve_run_id(prefix: str, *, client: MlflowClient | None = None) -> mlflow.entities.Run:
    """The MLflow run whose id is ``prefix`` or starts with it, as git resolves a short commit id: the leaderboard's
    8-character ids work wherever a run id is asked for.

    A full 32-character id is read directly (``client.get_run``); a shorter one (at least
    :data:`MIN_PREFIX_LENGTH` hex digits, any case) is matched against the active runs of every active experiment
    (paged searches, 50,000 runs a page).

    Args:
        prefix: a run id or the first characters of one.
        client: the MLflow client to ask; default :func:`get_client` (:func:`tracking_uri`).

    Raises:
        NotFoundError: no run id is or starts with ``prefix`` (names the tracking URI, password masked, and
            ``nas leaderboard``).
        NasError: ``prefix`` is not hexadecimal, is shorter than 4 or longer than 32 characters, or several runs
            match (lists up to 5 with their ``nas.role`` tag and run names: pass more characters).
        mlflow.MlflowException: the tracking server failed or could not be reached.
    """
    text = str(prefix).strip().lower()
    if not text or not set(text) <= _HEX:
        raise NasError(f"run id {prefix!r} is not a hexadecimal MLflow run id (or a prefix of one, as "
                       f"`nas leaderboard` prints them)")
    if len(text) < MIN_PREFIX_LENGTH:
        raise NasError(f"run id prefix {prefix!r} is too short: give at least {MIN_PREFIX_LENGTH} hex digits "
                       f"(`nas leaderboard` prints 8)")
    if len(text) > RUN_ID_LENGTH:
        raise NasError(f"run id {prefix!r} has {len(text)} hex digits; an MLflow run id has {RUN_ID_LENGTH}")
    client = client or get_client()
    where = redact_url(getattr(client, "tracking_uri", None) or tracking_uri())
    if len(text) == RUN_ID_LENGTH:
        try:
            return client.get_run(text)
        except mlflow.MlflowException as e:
            if e.error_code != "RESOURCE_DOES_NOT_EXIST":
                raise
            raise NotFoundError(f"no MLflow run {text} at {where}; list runs with `nas leaderboard`") from None
    matches = _runs_with_prefix(client, text)
    if not matches:
        raise NotFoundError(f"no MLflow run id starts with {text!r} at {where}; list runs with `nas leaderboard`")
    if len(matches) > 1:
        shown = ", ".join(f"{r.info.run_id} ({r.data.tags.get(TAG_ROLE, 'no role')} {r.info.run_name})"
                          for r in matches[:_SHOWN_MATCHES])
        more = f" and {len(matches) - _SHOWN_MATCHES} more" if len(matches) > _SHOWN_MATCHES else ""
        raise NasError(f"run id prefix {text!r} matches {len(matches)} runs at {where}: {shown}{more}; "
                       f"pass more characters")
    return matches[0]
