"""The comparison language ``METRIC OP NUMBER``: ``search.constraints`` in the YAML and ``--where`` of the CLI.

One grammar, one parser (:func:`split_comparison`), two vocabularies of operators:

- a YAML constraint (``latency_ms <= 40``) takes :data:`CONSTRAINT_OPS` and becomes a
  :class:`Constraint`, which Optuna receives through ``trial.set_constraint`` (Optuna 5.0,
  constrained TPE/NSGA-II: a value ``<= 0`` is feasible);
- a ``--where`` filter of ``nas leaderboard`` also takes ``==`` (or ``=``) and ``!=``
  (:data:`WHERE_OPS`); :func:`nas.tracking.parse_where` turns it into an MLflow filter clause.

``METRIC`` is a name (letters, digits, ``_`` and ``.``), checked against the caller's metric
names; ``NUMBER`` is a finite float in Python's syntax without ``inf``/``nan``.

Standard library only: the spec layer and the tracking layer both import it.
"""

from __future__ import annotations

import difflib
import math
import re
import typing
from collections.abc import Iterable, Mapping, Sequence

from nas.errors import NasError

__all__ = ["METRIC_NAMES", "CONSTRAINT_OPS", "WHERE_OPS", "Constraint", "parse_constraint", "split_comparison",
           "parse_bound", "violated"]

METRIC_NAMES = ("bleu", "chrf", "valid_loss", "params_m", "latency_ms", "latency_ratio")
"""The metrics every scored trial reports (objectives and constraints name these). Units: BLEU and chrF in
[0, 100], ``valid_loss`` in nats per target token, ``params_m`` in millions, ``latency_ms`` in milliseconds
(the fixed workload ``search.latency_workload``), ``latency_ratio`` a plain ratio: ``latency_ms`` over the
``search.latency_reference`` arch's ``latency_ms`` on the same device and workload (a budget that travels
between machines)."""

CONSTRAINT_OPS = ("<=", "<", ">=", ">")
"""Operators of a ``search.constraints`` entry (a bound: Optuna's constraints are inequalities)."""

WHERE_OPS = ("<=", "<", ">=", ">", "==", "!=")
"""Operators of a ``--where`` filter; ``=`` is accepted as ``==``."""

_NAME = r"[A-Za-z_][A-Za-z0-9_.]*"
_NUMBER = r"[-+0-9.eE]+"  # what float() may accept among these characters; parse_bound decides


def split_comparison(expr: object, ops: Sequence[str], *, example: str = "latency_ms <= 40",
                     aliases: Sequence[str] = ()) -> tuple[str, str, str]:
    """Split ``"latency_ms <= 40"`` into ``("latency_ms", "<=", "40")`` (whitespace around the parts allowed).

    Args:
        expr: the text to parse.
        ops: the operators allowed (shown in the error message).
        example: a valid expression quoted in the error message.
        aliases: more accepted operator spellings, not shown (``=`` for ``==``).

    Raises:
        NasError: ``expr`` is not a string of the form ``METRIC OP NUMBER`` with OP in ``ops`` or ``aliases``;
            the message quotes ``expr`` and lists ``ops``.
    """
    alternatives = sorted({*ops, *aliases}, key=len, reverse=True)  # "<=" before "<"
    pattern = rf"^\s*({_NAME})\s*({'|'.join(map(re.escape, alternatives))})\s*({_NUMBER})\s*$"
    m = re.match(pattern, expr) if isinstance(expr, str) else None
    if m is None:
        raise NasError(f"bad constraint {expr!r}: expected METRIC OP NUMBER with OP one of {', '.join(ops)} "
                         f"(e.g. {example!r})")
    name, op, text = m.groups()
    return name, op, text


def parse_bound(expr: str, text: str) -> float:
    """The number ``text`` of the comparison ``expr`` as a finite float.

    Raises:
        NasError: ``text`` is not a number, or is infinite (``1e999``); the message quotes both.
    """
    try:
        bound = float(text)
    except ValueError:
        bound = float("nan")
    if not math.isfinite(bound):
        raise NasError(f"bad constraint {expr!r}: {text!r} is not a finite number")
    return bound


class Constraint(typing.NamedTuple):
    """A parsed ``search.constraints`` entry ``METRIC OP BOUND`` (OP ``<=``/``<`` or ``>=``/``>``; the bound in
    the metric's units, see :data:`METRIC_NAMES`)."""

    metric: str
    op: str
    bound: float

    @property
    def key(self) -> str:
        """The name Optuna stores it under (``trial.set_constraint(key, ...)``), e.g. ``latency_ms<=40``."""
        short = f"{self.bound:g}"  # "latency_ms<=40"; repr where :g would round (the key is parsed back)
        return f"{self.metric}{self.op}{short if float(short) == self.bound else repr(self.bound)}"

    def violation(self, value: float) -> float:
        """Optuna's constraint value: ``<= 0`` when ``value`` satisfies the bound, else how far it is off,
        in the metric's units. A strict bound (``<``, ``>``) that ``value`` meets exactly is off by the
        smallest float step, so ``latency_ms < 30`` means the same here as in ``--where``."""
        gap = value - self.bound if self.op in ("<=", "<") else self.bound - value
        return math.nextafter(0.0, 1.0) if gap == 0 and self.op in ("<", ">") else gap


def parse_constraint(expr: str) -> Constraint:
    """Parse ``"latency_ms <= 40"`` into a :class:`Constraint`.

    Raises:
        NasError: not ``METRIC OP NUMBER`` (:func:`split_comparison` with :data:`CONSTRAINT_OPS`), an
            unknown metric (with the closest name), or a bound that is not a finite number.
    """
    metric, op, text = split_comparison(expr, CONSTRAINT_OPS)
    if metric not in METRIC_NAMES:
        hint = difflib.get_close_matches(metric, METRIC_NAMES, n=1)
        raise NasError(f"bad constraint {expr!r}: unknown metric {metric!r}"
                         + (f" (did you mean {hint[0]!r}?)" if hint else "")
                         + f"; a trial reports {', '.join(METRIC_NAMES)}")
    return Constraint(metric, op, parse_bound(expr, text))


def violated(constraints: Iterable[Constraint], metrics: Mapping[str, float | None]) -> list[Constraint]:
    """The constraints that a trial's ``metrics`` (name -> value in the metric's units) break, in order; empty
    when it is feasible. A metric that is missing, None or NaN breaks every constraint on it (Optuna is told
    ``inf`` then: such a trial is never feasible). The one feasibility rule of the sweep (trial results), the
    leaderboard, the Pareto front, ``nas export --best`` and ``nas report``."""
    out = []
    for c in constraints:
        value = metrics.get(c.metric)
        if value is None or math.isnan(value) or c.violation(value) > 0:
            out.append(c)
    return out
