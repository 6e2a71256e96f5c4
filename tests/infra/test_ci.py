"""No test skips when Multi30k is missing: conftest's ``multi30k`` fixture fails instead."""

from __future__ import annotations

import ast
import re

from tests.conftest import MISSING_DATA, REPO


def _skip_reasons(tree: ast.AST) -> list[str]:
    """The string constants in every ``skip(...)``/``skipif(...)`` call (``pytest.skip``, ``pytest.mark.skipif``)."""
    reasons = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and getattr(node.func, "attr", getattr(node.func, "id", "")) in ("skip", "skipif"):
            reasons += [c.value for c in ast.walk(node) if isinstance(c, ast.Constant) and isinstance(c.value, str)]
    return reasons


def test_no_test_skips_for_missing_data_or_reads_it_from_a_machine_path():
    """Tests read Multi30k through tests.conftest (``MULTI30K``, the ``multi30k`` fixture, which fails when the
    files are missing), never from a path of one machine and never behind a skip."""
    missing_data = re.compile(MISSING_DATA, re.IGNORECASE)
    for path in sorted((REPO / "tests").rglob("*.py")):
        text = path.read_text()
        name = path.relative_to(REPO)
        assert not re.search(r"""["'](/|~)[^"'\n]*shared/data""", text), (
            f"{name}: a machine path to the data; use tests.conftest.MULTI30K or the multi30k fixture")
        for reason in _skip_reasons(ast.parse(text)):
            assert not missing_data.search(reason), f"{name} skips when data is missing ({reason!r}): fail instead"
