"""Leaderboard output: a terminal table (rich) and CSV / JSON / Parquet files written atomically (:mod:`nas.atomic`)."""

from __future__ import annotations

import csv
import dataclasses
import json
import math
from pathlib import Path
from collections.abc import Sequence
from typing import TYPE_CHECKING

from nas.errors import NasError
from nas.atomic import atomic_path
from nas.tracking.rows import LeaderboardRow

if TYPE_CHECKING:
    from rich.table import Table

__all__ = ["LEADERBOARD_FORMATS", "leaderboard_table", "write_leaderboard"]

LEADERBOARD_FORMATS = ("csv", "json", "parquet")
"""File formats of :func:`write_leaderboard`."""


def _fmt(value: float | None, digits: int = 2) -> str:
    if value is None:
        return "-"
    if math.isnan(value):
        return "nan"
    return f"{value:.{digits}f}"


def leaderboard_table(rows: list[LeaderboardRow], title: str = "",
                      below: Sequence[tuple[int | None, LeaderboardRow]] = ()) -> Table:
    """A :class:`rich.table.Table` with columns rank, run id (first 8 chars), arch, BLEU, chrF,
    params (M), latency (ms); missing metrics shown as ``-``. When any row has a ``latency_ratio`` (the budget a sweep
    sets, ``search.constraints``), a column ``latency ratio`` comes before ``latency (ms)``, the milliseconds beside
    it. When any row's arch was retrained (``nas retrain``),
    a column ``retrained BLEU`` shows that model's BLEU beside the inherited one. When any row has a ``feasible`` verdict, a
    column ``feasible`` says ``yes``/``no`` (``-``: its sweep has no constraints); when any row has a
    ``pareto`` flag, a column ``front`` marks the non-dominated rows with ``*``. When any row was started from a
    ``search.points_to_evaluate`` entry, a last column ``point`` names it (``tiny``, ``narrowest``). ``below``: more
    such rows with their ranks (:attr:`nas.tracking.Board.below`), after a line under the top rows (rank ``-``:
    the trial lacks the ranking metric)."""
    from rich.table import Table

    everything = [*rows, *(r for _, r in below)]
    table = Table(title=title or None)
    table.add_column("rank", justify="right")
    table.add_column("run id", style="dim")
    table.add_column("arch", overflow="fold")
    ratio = any(r.latency_ratio is not None for r in everything)
    for name in ("BLEU", "chrF", "params (M)", *(["latency ratio"] if ratio else []), "latency (ms)"):
        table.add_column(name, justify="right")
    retrained = any(r.retrain_bleu is not None for r in everything)
    if retrained:  # beside the inherited scores: the same arch trained alone (nas retrain)
        table.add_column("retrained BLEU", justify="right")
    judged = any(r.feasible is not None for r in everything)
    if judged:
        table.add_column("feasible", justify="center")
    marked = any(r.pareto is not None for r in everything)
    if marked:
        table.add_column("front", justify="center")
    named = any(r.point is not None for r in everything)
    if named:  # the user's own archs (and the references) among the searched ones
        table.add_column("point")

    def cells(rank: str, r: LeaderboardRow) -> list[str]:
        out = [rank, r.run_id[:8], r.arch,
               _fmt(r.bleu), _fmt(r.chrf), _fmt(r.params_m), *([_fmt(r.latency_ratio)] if ratio else []),
               _fmt(r.latency_ms)]
        if retrained:
            out.append(_fmt(r.retrain_bleu))
        if judged:
            out.append("-" if r.feasible is None else "yes" if r.feasible else "no")
        if marked:
            out.append("*" if r.pareto else "")
        if named:
            out.append(r.point or "")
        return out

    for i, r in enumerate(rows, 1):
        table.add_row(*cells(str(i), r))
    if below and rows:
        table.add_section()
    for rank, r in below:
        table.add_row(*cells("-" if rank is None else str(rank), r))
    return table


def write_leaderboard(rows: list[LeaderboardRow], fmt: str, out: str | Path) -> Path:
    """Write ``rows`` to ``out`` as ``fmt`` and return the path (parent dirs created).

    csv: header = :class:`LeaderboardRow` field names, ``None`` as an empty cell. json: a list of
    objects (``None`` as null, NaN as ``NaN``). parquet: one typed column per field (pyarrow).
    The file is written atomically (:func:`nas.atomic.atomic_path`: a temporary sibling, fsync, ``os.replace``).

    Raises:
        ValueError: ``fmt`` is not one of csv, json, parquet.
    """
    if fmt not in LEADERBOARD_FORMATS:
        raise NasError(f"unknown leaderboard format {fmt!r}; expected one of {', '.join(LEADERBOARD_FORMATS)}")
    out = Path(out)
    names = [f.name for f in dataclasses.fields(LeaderboardRow)]
    records = [dataclasses.asdict(r) for r in rows]
    with atomic_path(out) as tmp:  # a temporary sibling, fsync-ed, then os.replace (mode 0644)
        if fmt == "parquet":
            import pyarrow as pa
            import pyarrow.parquet as pq

            types = {"run_id": pa.string(), "arch": pa.string(), "sweep_id": pa.string(),
                     "arch_id": pa.string(), "pareto": pa.bool_(), "feasible": pa.bool_(),
                     "retrain_run_id": pa.string(), "point": pa.string()}
            schema = pa.schema([(n, types.get(n, pa.float64())) for n in names])
            pq.write_table(pa.Table.from_pylist(records, schema=schema), str(tmp))
        else:
            with open(tmp, "w", newline="", encoding="utf-8") as f:
                if fmt == "csv":
                    writer = csv.DictWriter(f, fieldnames=names)
                    writer.writeheader()
                    writer.writerows(records)
                else:
                    json.dump(records, f, indent=2)
                    f.write("\n")
    return out
