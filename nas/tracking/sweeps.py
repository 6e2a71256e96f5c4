"""A sweep's parent run in MLflow: finding it, and reading back its objectives and constraints."""

from __future__ import annotations

import tempfile
from pathlib import Path

import mlflow
from mlflow.entities import ViewType

from nas.errors import NotFoundError
from nas.redact import redact_url
from nas.space.constraints import Constraint, parse_constraint
from nas.tracking.layout import PARAM_CONSTRAINTS, TAG_OBJECTIVES, TAG_ROLE, TAG_SWEEP_ID, tracking_uri
from nas.tracking.pareto import DEFAULT_OBJECTIVES, Objective, parse_objectives
from nas.tracking.rows import ROW_METRICS
from nas.tracking.runs import PAGE_SIZE, experiment_id, get_client, require_store, tag_filter

__all__ = ["find_sweep_run", "sweep_constraints", "sweep_objectives", "constraints_by_sweep", "describe_constraints",
           "latest_experiment"]


def find_sweep_run(sweep_id: str, experiment: str | None = None) -> mlflow.entities.Run:
    """The parent run (``nas.role=sweep``) of sweep ``sweep_id``: in ``experiment`` if given, else in
    any active experiment; the newest if several match.

    Raises:
        LookupError: no such sweep (or no active experiment named ``experiment``).
    """
    client = get_client()
    if experiment is not None:
        exp_ids = [experiment_id(client, experiment)]
    else:
        exp_ids = [e.experiment_id for e in client.search_experiments(ViewType.ACTIVE_ONLY)]
    clauses = " AND ".join(tag_filter(**{TAG_ROLE: "sweep", TAG_SWEEP_ID: sweep_id}))
    runs = client.search_runs(exp_ids, clauses, ViewType.ACTIVE_ONLY, 1,
                              order_by=["attributes.start_time DESC"]) if exp_ids else []
    if not runs:
        where = f"experiment {experiment!r}" if experiment else "any experiment"
        raise NotFoundError(f"no sweep with nas.sweep_id {sweep_id!r} in {where} at {redact_url(tracking_uri())}; "
                          "list sweeps with `nas leaderboard` or check --experiment")
    return runs[0]


def sweep_constraints(run: mlflow.entities.Run) -> tuple[Constraint, ...]:
    """The ``search.constraints`` of a sweep's parent run (its :data:`PARAM_CONSTRAINTS` param); none if unset.

    Raises:
        ValueError: the param does not parse (:func:`nas.space.constraints.parse_constraint`).
    """
    text = run.data.params.get(PARAM_CONSTRAINTS, "")
    return tuple(parse_constraint(c) for c in text.split(";") if c.strip())


def constraints_by_sweep(experiment: str, sweep_id: str | None = None) -> dict[str, tuple[Constraint, ...]]:
    """Sweep id -> the ``search.constraints`` its parent run records (:func:`sweep_constraints`; ``()`` when it
    has none), for every sweep parent run of ``experiment``, or only ``sweep_id``'s. A sweep without a parent run
    in ``experiment`` is absent. One query, paged (an experiment holds few sweeps).

    Raises:
        LookupError: no active experiment named ``experiment``.
        ValueError: a parent run's constraints do not parse.
    """
    client = get_client()
    exp_ids = [experiment_id(client, experiment)]
    clauses = " AND ".join(tag_filter(**{TAG_ROLE: "sweep", TAG_SWEEP_ID: sweep_id}))
    found: dict[str, tuple[Constraint, ...]] = {}
    token = None
    while True:
        page = client.search_runs(exp_ids, clauses, ViewType.ACTIVE_ONLY, PAGE_SIZE,
                                  order_by=["attributes.start_time DESC"], page_token=token)
        for run in page:  # newest first, as find_sweep_run picks
            found.setdefault(run.data.tags.get(TAG_SWEEP_ID, ""), sweep_constraints(run))
        token = page.token
        if not token:
            return {k: v for k, v in found.items() if k}


def describe_constraints(by_sweep: dict[str, tuple[Constraint, ...]]) -> str:
    """``"latency_ms<=30 (sweep A); params_m<=2 (sweeps B, C)"``: the constraints of :func:`constraints_by_sweep`,
    grouped by sweeps that share them; sweeps without constraints are left out ("" when none has any)."""
    groups: dict[str, list[str]] = {}
    for sweep, constraints in sorted(by_sweep.items()):
        if constraints:
            groups.setdefault(", ".join(c.key for c in constraints), []).append(sweep)
    return "; ".join(f"{keys} (sweep{'s' if len(ids) > 1 else ''} {', '.join(ids)})" for keys, ids in groups.items())


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
    if len(objectives) < 2 or any(o.metric not in ROW_METRICS for o in objectives[:2]):
        return DEFAULT_OBJECTIVES
    return objectives[:2]


def latest_experiment() -> str:
    """The MLflow experiment of the newest sweep (the newest run tagged ``nas.role=sweep``).

    Raises:
        NotFoundError: the tracking store holds no sweep (names the store, password masked).
    """
    require_store()
    client = get_client()
    runs = client.search_runs([e.experiment_id for e in client.search_experiments()],
                              filter_string=f"tags.`{TAG_ROLE}` = 'sweep'", order_by=["attributes.start_time DESC"],
                              max_results=1)
    if not runs:
        raise NotFoundError(f"no sweep found at {redact_url(tracking_uri())}; run `nas sweep FILE` first or "
                            "pass --experiment")
    return client.get_experiment(runs[0].info.experiment_id).name
