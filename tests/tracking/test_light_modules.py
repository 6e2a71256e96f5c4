"""The Pareto maths, the rows, the run layout and the leaderboard writers of ``nas.tracking`` import no mlflow;
``--where`` and ``search.constraints`` share one comparison parser."""

from __future__ import annotations

import subprocess
import sys

import pytest

from nas.space.constraints import parse_constraint
from nas.tracking.query import parse_where
from tests.conftest import REPO


def test_pareto_rows_layout_and_writers_import_no_mlflow():
    code = ("import sys, nas.tracking, nas.tracking.pareto, nas.tracking.rows, nas.tracking.layout, "
            "nas.tracking.writers\nprint('mlflow' in sys.modules, 'torch' in sys.modules)")
    result = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["False", "False"]


@pytest.mark.parametrize("expr", ["latency_ms <= 40", "bleu>20.5", "params_m < 1e1", " chrf >= -3 "])
def test_where_and_constraints_read_the_same_bound(expr):
    c = parse_constraint(expr)
    assert parse_where(expr) == f"metrics.`{c.metric}` {c.op} {c.bound!r}"


@pytest.mark.parametrize("expr", ["latency_ms = 40", "latency_ms == 40", "bleu != 3"])
def test_equality_is_a_where_filter_but_not_a_constraint(expr):
    parse_where(expr)
    with pytest.raises(ValueError, match="expected METRIC OP NUMBER with OP one of <=, <, >=, > "):
        parse_constraint(expr)
