"""What ``nas leaderboard`` and :func:`nas.leaderboard` show: the ranked rows (with the Pareto front on request,
retrained scores beside inherited ones), why a table is empty, and which constraints a ranking applied."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from nas.errors import NotFoundError
from nas.tracking.layout import TAG_SWEEP_ID
from nas.tracking.pareto import DEFAULT_OBJECTIVES, parse_objectives
from nas.tracking.query import ParetoScan, leaderboard, pareto_scan, points_below, with_retrained
from nas.tracking.rows import LeaderboardRow
from nas.tracking.runs import PAGE_SIZE, find_runs, require_store
from nas.tracking.sweeps import constraints_by_sweep, describe_constraints, find_sweep_run, sweep_objectives

__all__ = ["Board", "ranked_rows", "empty_reason", "feasibility_note"]


@dataclass
class Board:
    """The rows of a leaderboard, best first; ``scan``: the Pareto scan behind them (None without ``pareto``);
    ``warnings``: lines for the user (a sweep id with no parent run, so no constraints applied)."""

    rows: list[LeaderboardRow]
    scan: ParetoScan | None = None
    warnings: list[str] = field(default_factory=list)
    why_empty: str | None = None
    """With ``explain`` and no row: why (:func:`empty_reason`)."""
    note: str | None = None
    """With ``explain``: which constraints the ranking applied (:func:`feasibility_note`)."""
    below: list[tuple[int | None, LeaderboardRow]] = field(default_factory=list)
    """The trials started from a ``search.points_to_evaluate`` entry (``point`` set: the user's own archs) that rank
    below ``rows``, each with its rank (:func:`~nas.tracking.query.points_below`), so a table can show where they
    land."""


def ranked_rows(experiment: str, *, metric: str = "bleu", top: int = 10, sweep_id: str | None = None,
                status: str = "FINISHED", where: Sequence[str] = (), include_infeasible: bool = False,
                pareto: bool = False, objectives: str | None = None, page_size: int = PAGE_SIZE,
                keep_points: bool = False, explain: bool = False) -> Board:
    """The ``top`` trials of ``experiment`` by ``metric`` (:func:`leaderboard`), or with ``pareto`` those of a
    :func:`pareto_scan` of ``objectives`` (default: the sweep's with ``sweep_id``, else the experiment's newest
    sweep's, else :data:`DEFAULT_OBJECTIVES`), with the retrained scores filled in (:func:`with_retrained`), and the
    trials started from a ``search.points_to_evaluate`` entry that rank below them (``Board.below``, with their ranks);
    with ``explain``, also why it is empty and which constraints applied (``Board.why_empty``, ``Board.note``).

    Raises:
        NasError: an unknown metric, status, constraint or objective; NotFoundError: ``sweep_id`` has no parent
            run when its objectives are needed; the tracking store is a SQLite file that does not exist
            (:func:`nas.tracking.require_store`: nothing is created).
    """
    require_store()
    warnings: list[str] = []
    scan = None
    if pareto:
        if objectives:
            objs = parse_objectives(objectives)
            if sweep_id:
                try:
                    find_sweep_run(sweep_id, experiment)
                except NotFoundError:
                    warnings.append(f"sweep {sweep_id} has no parent run in {experiment}: its search.constraints "
                                    "are not applied")
        elif sweep_id:  # the sweep's objectives are read from its parent run
            objs = sweep_objectives(find_sweep_run(sweep_id, experiment))
        else:  # the newest sweep's: its budget (e.g. latency_ratio), not latency_ms
            sweeps = find_runs(experiment, role="sweep")
            objs = (sweep_objectives(max(sweeps, key=lambda r: r.info.start_time)) if sweeps
                    else DEFAULT_OBJECTIVES)
        scan = pareto_scan(experiment, objs, metric=metric, top=top, sweep_id=sweep_id, status=status,
                           where=tuple(where), page_size=page_size, keep_points=keep_points,
                           include_infeasible=include_infeasible)
        rows = scan.rows
    else:
        rows = leaderboard(experiment, metric=metric, top=top, sweep_id=sweep_id, status=status, where=tuple(where),
                           page_size=page_size, include_infeasible=include_infeasible)
    below = points_below(experiment, rows, metric=metric, sweep_id=sweep_id, status=status, where=tuple(where),
                         page_size=page_size, include_infeasible=include_infeasible)
    retrained = with_retrained(experiment, [*rows, *(row for _, row in below)])
    board = Board(retrained[:len(rows)], scan, warnings,
                  below=[(rank, row) for (rank, _), row in zip(below, retrained[len(rows):])])
    if explain:
        if not board.rows:
            board.why_empty = empty_reason(experiment, sweep_id, status, where, include_infeasible)
        board.note = feasibility_note(experiment, sweep_id, include_infeasible)
    return board


def empty_reason(experiment: str, sweep_id: str | None, status: str, where: Sequence[str],
                 include_infeasible: bool) -> str:
    """Why a leaderboard of these filters has no row: no trial of the status, or filters (``where``, the sweeps'
    constraints) that no trial meets.

    Raises:
        NotFoundError: ``sweep_id`` is no sweep of ``experiment`` (names the sweeps there).
    """
    trials = find_runs(experiment, role="trial", sweep_id=sweep_id)
    if sweep_id and not trials and not find_runs(experiment, sweep_id=sweep_id):
        sweeps = sorted({r.data.tags.get(TAG_SWEEP_ID) for r in find_runs(experiment, role="sweep")} - {None})
        raise NotFoundError(f"--sweep {sweep_id}: experiment {experiment!r} has no sweep of that id; its sweeps: "
                            f"{', '.join(sweeps) or 'none'}")
    of = f" of sweep {sweep_id}" if sweep_id else ""
    with_status = [r for r in trials if status == "all" or r.info.status == status]
    if not with_status:
        return (f"no {'' if status == 'all' else status + ' '}trial{of} in experiment {experiment} "
                f"({len(trials)} trial runs in all; --status all shows every one)")
    filters = [f"--where {' and '.join(where)}"] if where else []
    if not include_infeasible:
        filters.append("its sweep's search.constraints (--include-infeasible drops them)")
    kind = "trials" if status == "all" else f"{status} trials"
    return f"none of the {len(with_status)} {kind}{of} in experiment {experiment} meets {' and '.join(filters)}"


def feasibility_note(experiment: str, sweep_id: str | None, include_infeasible: bool) -> str | None:
    """Which ``search.constraints`` a ranking applied (None when no sweep in scope has any)."""
    bounds = describe_constraints(constraints_by_sweep(experiment, sweep_id))
    if not bounds:
        return None
    if include_infeasible:
        return f"all trials, feasible or not (column feasible), under search.constraints {bounds}"
    return f"feasible trials only, under search.constraints {bounds}; --include-infeasible shows the others too"
