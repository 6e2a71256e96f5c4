"""Pareto maths on leaderboard metrics: objectives and the non-dominated mask (no mlflow, no numpy).

A point dominates another when it is no worse in every objective and strictly better in one (the Pareto
front of multi-objective NAS, e.g. HAT's BLEU-latency trade-off; Optuna's ``study.best_trials``).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from nas.errors import NasError
from nas.tracking.rows import ROW_METRICS

__all__ = ["Objective", "DEFAULT_OBJECTIVES", "parse_objectives", "pareto_mask"]


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
            raise NasError(f"bad objective {item!r} in {text!r}: expected METRIC:max or METRIC:min "
                             "(e.g. 'bleu:max,latency_ms:min')")
        if name not in ROW_METRICS:
            raise NasError(f"bad objective {item!r}: unknown metric {name!r}; expected one of "
                             f"{', '.join(ROW_METRICS)}")
        if any(o.metric == name for o in out):
            raise NasError(f"bad objectives {text!r}: {name!r} appears twice")
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
