"""CI cannot pass by skipping: under ``NAS_CI=1`` (.ci/run) a skip for a missing data file or a missing
PostgreSQL fails, and no test skips when Multi30k is missing (conftest's ``multi30k`` fixture fails instead)."""

from __future__ import annotations

import ast
import os
import re
import subprocess
import sys
from pathlib import Path

from tests.conftest import MISSING_DATA, REPO

SKIPPING_TESTS = '''
import pytest


def test_reads_the_corpus():
    pytest.skip("Multi30k not found at /nowhere")


@pytest.mark.skipif(True, reason="PostgreSQL not available at 127.0.0.1:5432: connection refused")
def test_needs_the_database():
    pass


@pytest.fixture
def corpus():
    pytest.skip("data files not present")


def test_through_a_fixture(corpus):
    pass


def test_needs_a_gpu():
    pytest.skip("needs a GPU")


@pytest.mark.xfail(reason="PostgreSQL is flaky here", strict=True)
def test_expected_to_fail():
    assert False
'''


def _pytest_on_skipping_tests(tmp_path: Path, *, nas_ci: bool) -> subprocess.CompletedProcess:
    """pytest on :data:`SKIPPING_TESTS` with the suite's conftest loaded as a plugin, in a subprocess."""
    (tmp_path / "test_skipping.py").write_text(SKIPPING_TESTS)
    env = {key: value for key, value in os.environ.items() if key not in ("NAS_CI", "PYTEST_ADDOPTS")}
    env["PYTHONPATH"] = str(REPO)
    if nas_ci:
        env["NAS_CI"] = "1"
    argv = [sys.executable, "-m", "pytest", "-q", "-rA", "-p", "no:cacheprovider", "-p", "tests.conftest",
            "test_skipping.py"]
    return subprocess.run(argv, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)


def test_under_nas_ci_a_skip_for_missing_data_or_postgres_fails_the_run(tmp_path):
    result = _pytest_on_skipping_tests(tmp_path, nas_ci=True)
    output = result.stdout + result.stderr
    assert result.returncode == 1, output
    assert re.search(r"^FAILED test_skipping.py::test_reads_the_corpus - Skipped: Multi30k not found", output, re.M)
    for name in ("test_needs_the_database", "test_through_a_fixture"):  # skipped in setup: an error
        assert re.search(rf"^ERROR test_skipping.py::{name} - Skipped: ", output, re.M), output
    assert re.search(r"^SKIPPED .*needs a GPU", output, re.M), "other skips stay skips"
    assert re.search(r"^XFAIL test_skipping.py::test_expected_to_fail", output, re.M), "an xfail is no skip"
    assert "NAS_CI=1" in output, "the failure must say why a skip failed"


def test_without_nas_ci_the_same_skips_stay_skips(tmp_path):
    result = _pytest_on_skipping_tests(tmp_path, nas_ci=False)
    output = result.stdout + result.stderr
    assert result.returncode == 0, output
    assert re.search(r"\b4 skipped, 1 xfailed\b", output), output


def test_ci_sets_nas_ci_and_runs_exactly_the_readme_test_command():
    commands = [line.strip() for line in (REPO / ".ci" / "run").read_text().splitlines()
                if line.strip() and not line.lstrip().startswith("#")]
    assert commands[-1] == "bash scripts/test.sh", "CI must run the README's test command"
    assert "export NAS_CI=1" in commands[:-1] and "export NAS_REQUIRE_POSTGRES=1" in commands[:-1]
    assert "bash scripts/test.sh" in (REPO / "README.md").read_text()
    assert "-m pytest" in (REPO / "scripts" / "test.sh").read_text(), "scripts/test.sh runs pytest (and conftest)"


def _skip_reasons(tree: ast.AST) -> list[str]:
    """The string constants in every ``skip(...)``/``skipif(...)`` call (``pytest.skip``, ``pytest.mark.skipif``)."""
    reasons = []
    for node in ast.walk(tree):
        called = getattr(node, "func", None)
        if isinstance(node, ast.Call) and getattr(called, "attr", getattr(called, "id", "")) in ("skip", "skipif"):
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
