"""Leaderboard queries against MLflow: trial rows page by page, the ``--where`` filter, the top rows and the
Pareto front of a sweep in one scan, the best trial to export.

Feasibility: each row is judged by the ``search.constraints`` its own sweep's parent run records
(:func:`nas.tracking.sweeps.constraints_by_sweep`, :func:`nas.space.constraints.violated`). Unless asked to
``include_infeasible``, rankings keep the trials that meet them (``feasible`` True, or None for a sweep without
constraints), and the Pareto front always does (Optuna's ``study.best_trials`` rule).

``--where`` uses the comparison language of the YAML's ``search.constraints``
(:func:`nas.space.constraints.split_comparison`) with ``==``/``!=`` added.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import mlflow
from mlflow.entities import ViewType

from nas.errors import NasError, NotFoundError
from nas.space.constraints import WHERE_OPS, Constraint, parse_bound, split_comparison, violated
from nas.tracking.layout import TAG_ARCH_ID, TAG_ARCH_SUMMARY, TAG_POINT, TAG_ROLE, TAG_SOURCE_RUN, TAG_SWEEP_ID
from nas.tracking.pareto import DEFAULT_OBJECTIVES, Objective, pareto_mask
from nas.tracking.rows import LOWER_IS_BETTER, ROW_METRICS, LeaderboardRow
from nas.tracking.runs import PAGE_SIZE, experiment_id, find_tagged_runs, get_client, tag_filter
from nas.tracking.sweeps import constraints_by_sweep, describe_constraints

__all__ = ["LEADERBOARD_STATUSES", "parse_where", "iter_leaderboard_rows", "leaderboard", "ParetoScan",
           "pareto_scan", "best_trial", "with_retrained", "points_below"]


def _row(run: mlflow.entities.Run, constraints: dict[str, tuple[Constraint, ...]]) -> LeaderboardRow:
    """The row of a trial run, ``feasible`` judged by the constraints of its sweep (``constraints``: sweep id ->
    its ``search.constraints``)."""
    m, t = run.data.metrics, run.data.tags
    sweep_id = t.get(TAG_SWEEP_ID)
    bounds = constraints.get(sweep_id or "", ())
    return LeaderboardRow(
        run_id=run.info.run_id,
        arch=t.get(TAG_ARCH_SUMMARY, ""),
        **{k: m.get(k) for k in ROW_METRICS},
        sweep_id=sweep_id,
        arch_id=t.get(TAG_ARCH_ID),
        feasible=not violated(bounds, m) if bounds else None,
        point=t.get(TAG_POINT),
    )


LEADERBOARD_STATUSES = ("FINISHED", "FAILED", "KILLED", "RUNNING", "all")
"""Values of the ``status`` filter: one MLflow run status, or ``all``."""

_MAX_PAGE = 50_000  # MLflow's limit on max_results
_WHERE_CLAUSE_OPS = {"<=": "<=", ">=": ">=", "<": "<", ">": ">", "==": "=", "=": "=", "!=": "!="}
"""``--where`` operator -> MLflow filter operator."""


def parse_where(expr: str) -> str:
    """Turn a constraint ``METRIC OP NUMBER`` (e.g. ``"latency_ms<=40"``; OP one of <=, <, >=, >, ==, !=:
    :data:`~nas.space.constraints.WHERE_OPS`, parsed by :func:`~nas.space.constraints.split_comparison` as the
    YAML's ``search.constraints`` are) into an MLflow filter clause (``metrics.`latency_ms` <= 40.0``). Runs
    lacking the metric never satisfy a constraint on it.

    Raises:
        ValueError: the expression does not parse, names a metric that is not a row metric, or its
            value is not a finite number (the message quotes the expression).
    """
    name, op, text = split_comparison(expr, WHERE_OPS, example="latency_ms<=40", aliases=("=",))
    if name not in ROW_METRICS:
        raise NasError(f"bad constraint {expr!r}: unknown metric {name!r}; expected one of "
                         f"{', '.join(ROW_METRICS)}")
    value = parse_bound(expr, text)
    return f"metrics.`{name}` {_WHERE_CLAUSE_OPS[op]} {value!r}"


def _trial_filter(sweep_id: str | None, status: str, where: Sequence[str], points_only: bool = False) -> str:
    if status not in LEADERBOARD_STATUSES:
        raise NasError(f"unknown status {status!r}; expected one of {', '.join(LEADERBOARD_STATUSES)}")
    clauses = tag_filter(**{TAG_ROLE: "trial", TAG_SWEEP_ID: sweep_id})
    if points_only:  # runs that carry the tag at all
        clauses.append(f"tags.`{TAG_POINT}` LIKE '%'")
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
    page_size: int = PAGE_SIZE,
    limit: int | None = None,
    include_infeasible: bool = False,
    points_only: bool = False,
) -> Iterator[LeaderboardRow]:
    """Trial runs (``nas.role=trial``) of ``experiment`` as rows, fetched lazily page by page.

    Each page is one ``search_runs`` call of at most ``page_size`` runs (and at most the ``limit``
    rows still wanted), continued with its ``page_token``; only the current page is held in memory,
    so a caller that stops iterating stops the queries. Filters run in the tracking store:
    ``sweep_id`` (tag ``nas.sweep_id``), ``status`` (one of :data:`LEADERBOARD_STATUSES`), and
    every ``where`` constraint (:func:`parse_where`). With ``metric`` the rows come best first
    (``ascending`` defaults to True for latency_ms/params_m/valid_loss); runs lacking it come last.
    Each row's ``feasible`` is judged by its sweep's ``search.constraints``; rows with ``feasible`` False
    are left out unless ``include_infeasible``. ``limit`` counts the rows yielded. ``points_only``: only the trials
    started from a ``search.points_to_evaluate`` entry (tag ``nas.point``).
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
    if metric is not None and metric not in ROW_METRICS:
        raise NasError(f"unknown metric {metric!r}; expected one of {', '.join(ROW_METRICS)}")
    filter_string = _trial_filter(sweep_id, status, where, points_only)
    order = None
    if metric is not None:
        asc = metric in LOWER_IS_BETTER if ascending is None else ascending
        order = [f"metrics.`{metric}` {'ASC' if asc else 'DESC'}"]
    client = get_client()
    exp_id = experiment_id(client, experiment)
    constraints = constraints_by_sweep(experiment, sweep_id)

    def pages() -> Iterator[LeaderboardRow]:
        token, kept = None, 0
        while limit is None or kept < limit:
            want = page_size if limit is None else min(page_size, limit - kept)
            page = client.search_runs([exp_id], filter_string, ViewType.ACTIVE_ONLY, min(want, _MAX_PAGE),
                                      order_by=order, page_token=token)
            for row in (_row(r, constraints) for r in page):
                if include_infeasible or row.feasible is not False:
                    kept += 1
                    yield row
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
    page_size: int = PAGE_SIZE,
    include_infeasible: bool = False,
) -> list[LeaderboardRow]:
    """The best ``top`` trial runs (``nas.role=trial``) of ``experiment`` with ``status``, best first; only those
    meeting their sweep's ``search.constraints`` unless ``include_infeasible`` (each row says in ``feasible``).

    Ordering, filtering and limiting happen in the tracking store (:func:`iter_leaderboard_rows`; the
    feasibility filter page by page as rows arrive): no page is requested once ``top`` rows are found. ``ascending`` defaults to True for
    latency_ms/params_m/valid_loss and False otherwise; runs lacking the metric (or with NaN) come
    last. ``sweep_id`` restricts to trials tagged with that ``nas.sweep_id``; ``status`` is an MLflow
    run status or ``all``; ``where`` holds constraints such as ``"latency_ms<=40"``, all of which
    must hold.

    Raises:
        ValueError: ``metric`` is not a row metric, ``top`` or ``page_size`` < 1, an unknown status,
            or a bad ``where`` expression (named).
        LookupError: no active experiment named ``experiment``.
    """
    if metric not in ROW_METRICS:
        raise NasError(f"unknown metric {metric!r}; expected one of {', '.join(ROW_METRICS)}")
    if top < 1:
        raise NasError(f"top must be >= 1, got {top}")
    rows = iter_leaderboard_rows(experiment, sweep_id=sweep_id, status=status, where=where, metric=metric,
                                 ascending=ascending, page_size=page_size, limit=top,
                                 include_infeasible=include_infeasible)
    return list(itertools.islice(rows, top))


@dataclass(frozen=True)
class ParetoScan:
    """What :func:`pareto_scan` found. Rows carry ``pareto`` flags."""

    rows: list[LeaderboardRow]
    """The best ``top`` rows by the ranking metric, best first (feasible ones only unless the scan included
    infeasible ones)."""
    front: list[LeaderboardRow]
    """Every non-dominated row, best first by the first objective."""
    scanned: int
    """Runs that matched the filters."""
    points: list[tuple[float | None, ...]]
    """``[scanned][k]`` objective values of every matched run (only with ``keep_points``)."""
    objectives: tuple[Objective, ...]
    feasible: list[bool] = dataclasses.field(default_factory=list)
    """``[scanned]``: whether each kept point meets its sweep's constraints (only with ``keep_points``)."""
    infeasible: int = 0
    """Runs that matched the filters but break their sweep's constraints (counted in ``scanned``)."""
    latency_ms: list[float | None] = dataclasses.field(default_factory=list)
    """``[scanned]``: each kept point's ``latency_ms`` (only with ``keep_points``), shown beside a ``latency_ratio``
    axis."""
    where: tuple[str, ...] = ()
    """The ``--where`` filters of the scan, as given."""
    status: str = "FINISHED"
    """The status filter of the scan."""
    before_where: int | None = None
    """When ``where`` left no run: the runs matching the other filters (None otherwise), so that an empty plot can
    say that the ``where`` filter removed them all."""

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
    page_size: int = PAGE_SIZE,
    keep_points: bool = False,
    include_infeasible: bool = False,
) -> ParetoScan:
    """Page through every matching trial run once, keeping only the best ``top`` rows (ranked by
    ``metric``, default the first objective's metric in its goal's order), the Pareto front so far
    and, with ``keep_points``, the objective values (k floats per run, for plots) and each run's ``latency_ms``;
    with ``keep_points`` and ``where`` filters that leave no run, one more scan counts the runs matching the other
    filters (``ParetoScan.before_where``), so that an empty plot can say the filter removed them.

    The front is updated one page at a time as front(front + page) with :func:`pareto_mask`, so
    memory holds one page, the front and the top rows, whatever the number of runs.
    Filters as in :func:`iter_leaderboard_rows`. Only rows meeting their sweep's ``search.constraints``
    (:func:`nas.tracking.sweeps.constraints_by_sweep`) can be on the front (Optuna's ``study.best_trials`` rule)
    or among ``rows``, unless ``include_infeasible`` (then ``rows`` ranks every row); ``points`` keeps them all.

    Raises:
        ValueError: no objectives, a repeated or unknown metric, ``top`` < 1, or a bad filter.
        LookupError: no active experiment named ``experiment``.
    """
    objectives = tuple(objectives)
    if not objectives or len({o.metric for o in objectives}) != len(objectives):
        raise NasError(f"objectives must be one or more distinct metrics, got {', '.join(map(str, objectives))}")
    for o in objectives:
        if o.metric not in ROW_METRICS:
            raise NasError(f"unknown objective metric {o.metric!r}; expected one of {', '.join(ROW_METRICS)}")
    if top < 1:
        raise NasError(f"top must be >= 1, got {top}")
    metric = metric or objectives[0].metric
    ascending = None if metric != objectives[0].metric else not objectives[0].maximize
    maximize = [o.maximize for o in objectives]

    def values(row: LeaderboardRow) -> tuple[float | None, ...]:
        return tuple(getattr(row, o.metric) for o in objectives)

    rows = iter_leaderboard_rows(experiment, sweep_id=sweep_id, status=status, where=where, metric=metric,
                                 ascending=ascending, page_size=page_size, include_infeasible=True)
    best: list[LeaderboardRow] = []
    front: list[LeaderboardRow] = []
    points: list[tuple[float | None, ...]] = []
    feasible: list[bool] = []
    latency_ms: list[float | None] = []
    scanned = infeasible = 0

    def ok(row: LeaderboardRow) -> bool:
        return row.feasible is not False

    for page in _chunks(rows, page_size):
        scanned += len(page)
        infeasible += sum(not ok(r) for r in page)
        if len(best) < top:
            best.extend([r for r in page if include_infeasible or ok(r)][: top - len(best)])
        if keep_points:
            points.extend(values(r) for r in page)
            feasible.extend(ok(r) for r in page)
            latency_ms.extend(r.latency_ms for r in page)
        candidates = front + [r for r in page if ok(r)]
        front = [r for r, on in zip(candidates, pareto_mask([values(r) for r in candidates], maximize)) if on]
    on_front = {r.run_id for r in front}
    first = objectives[0]
    front.sort(key=lambda r: -getattr(r, first.metric) if first.maximize else getattr(r, first.metric))
    flag = lambda r: dataclasses.replace(r, pareto=r.run_id in on_front)  # noqa: E731
    before_where = None
    if keep_points and where and not scanned:  # for the plot's note: did the filter remove every trial?
        before_where = sum(1 for _ in iter_leaderboard_rows(experiment, sweep_id=sweep_id, status=status,
                                                            page_size=page_size, include_infeasible=True))
    return ParetoScan(rows=[flag(r) for r in best], front=[flag(r) for r in front], scanned=scanned,
                      points=points, objectives=objectives, feasible=feasible, infeasible=infeasible,
                      latency_ms=latency_ms, where=tuple(where), status=status, before_where=before_where)


def best_trial(
    experiment: str,
    *,
    metric: str = "bleu",
    where: Sequence[str] = (),
    include_infeasible: bool = False,
    page_size: int = PAGE_SIZE,
) -> LeaderboardRow:
    """The best FINISHED trial of ``experiment`` by ``metric`` (in its goal's order, as :func:`leaderboard`) that
    meets every ``where`` filter and, unless ``include_infeasible``, its sweep's ``search.constraints``: what
    ``nas export --best`` exports. Rows are read best first, page by page, until one qualifies.

    Raises:
        NotFoundError: no finished trial (meeting ``where``); the message says how to get one.
        NasError: finished trials exist but none meets its sweep's constraints; the message names the
            constraints, the number of trials and ``--include-infeasible``. Also an unknown metric or a bad
            ``where`` expression.
        LookupError: no active experiment named ``experiment``.
    """
    rows = iter_leaderboard_rows(experiment, where=where, metric=metric, page_size=page_size,
                                 include_infeasible=True)
    seen: set[str] = set()
    count = 0
    for row in rows:
        if include_infeasible or row.feasible is not False:
            return row
        count += 1
        seen.add(row.sweep_id or "")
    meeting = f"meeting {' and '.join(where)} " if where else ""
    if not count:
        raise NotFoundError(f"no finished trial {meeting}in experiment {experiment!r} to export; run "
                            f"`nas sweep FILE` first" + (" or relax --where" if where else ""))
    bounds = describe_constraints({k: v for k, v in constraints_by_sweep(experiment).items() if k in seen})
    raise NasError(f"none of the {count} finished trials {meeting}in experiment {experiment!r} meets its sweep's "
                   f"search.constraints ({bounds}); pass --include-infeasible to export the best of them anyway")


def points_below(
    experiment: str,
    top: Sequence[LeaderboardRow],
    *,
    metric: str = "bleu",
    sweep_id: str | None = None,
    status: str = "FINISHED",
    where: Sequence[str] = (),
    page_size: int = PAGE_SIZE,
    include_infeasible: bool = False,
) -> list[tuple[int | None, LeaderboardRow]]:
    """The trials started from a ``search.points_to_evaluate`` entry (tag ``nas.point``: the user's own archs, the
    references) that match the leaderboard's filters but are not among ``top``, best first, each with its rank by
    ``metric`` in that leaderboard: 1 + the matching trials strictly better (``None`` when it lacks the metric), so
    that a user sees where an own design lands however far down. Filters as in :func:`iter_leaderboard_rows`; one
    more query per such trial counts the better ones.

    Raises:
        NasError: an unknown metric or status, or a bad ``where`` expression; NotFoundError: no active experiment
            named ``experiment``.
    """
    shown = {r.run_id for r in top}
    named = [r for r in iter_leaderboard_rows(experiment, sweep_id=sweep_id, status=status, where=where, metric=metric,
                                              page_size=page_size, include_infeasible=include_infeasible,
                                              points_only=True) if r.run_id not in shown]
    op = "<" if metric in LOWER_IS_BETTER else ">"
    ranked = []
    for row in named:
        value = getattr(row, metric)
        if value is None or value != value:  # no metric (or NaN): no rank
            ranked.append((None, row))
            continue
        better = iter_leaderboard_rows(experiment, sweep_id=sweep_id, status=status,
                                       where=(*where, f"{metric}{op}{value!r}"), page_size=page_size,
                                       include_infeasible=include_infeasible)
        ranked.append((1 + sum(1 for _ in better), row))
    return ranked


def _chunks(items: Iterator[LeaderboardRow], size: int) -> Iterator[list[LeaderboardRow]]:
    chunk: list[LeaderboardRow] = []
    for item in items:
        chunk.append(item)
        if len(chunk) == size:
            yield chunk
            chunk = []
    if chunk:
        yield chunk



def with_retrained(experiment: str, rows: Sequence[LeaderboardRow]) -> list[LeaderboardRow]:
    """``rows`` with the scores of their retrained models filled in (``retrain_*`` fields): for each trial, the
    newest FINISHED ``nas.role=retrain`` run of ``experiment`` whose ``nas.source_run_id`` names it (one query for
    all; rows of trials never retrained are returned unchanged).

    Raises:
        NotFoundError: no active experiment named ``experiment``.
    """
    if not rows:
        return list(rows)
    experiment_id(get_client(), experiment)  # NotFoundError for an unknown experiment
    wanted = {r.run_id for r in rows}
    newest: dict[str, mlflow.entities.Run] = {}
    for run in sorted(find_tagged_runs(experiment, {TAG_ROLE: "retrain"}, status="FINISHED"),
                      key=lambda r: r.info.end_time or 0):  # oldest end first: the newest retrain of a trial wins
        source = run.data.tags.get(TAG_SOURCE_RUN)
        if source in wanted:
            newest[source] = run
    out = []
    for row in rows:
        run = newest.get(row.run_id)
        if run is None:
            out.append(row)
            continue
        m = run.data.metrics
        out.append(dataclasses.replace(row, retrain_bleu=m.get("bleu"), retrain_chrf=m.get("chrf"),
                                       retrain_latency_ms=m.get("latency_ms"), retrain_run_id=run.info.run_id))
    return out
