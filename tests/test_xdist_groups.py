"""The suite's pytest-xdist groups (``scripts/test.sh`` runs 2 workers with ``--dist loadgroup``, scheduled by
``tests/conftest.py``): a module's tests stay on one worker, so its module-scoped fixtures (a sweep each in the slow
modules) are built once; every test that talks to the shared PostgreSQL server runs on one worker, since the
backends sweep restarts that server; and the slowest groups are handed out first."""

import os
import re
import subprocess
import sys

import pytest

from tests.conftest import POSTGRES_GROUP, REPO, SLOW_FIRST, group_order, xdist_group


def test_a_test_is_grouped_with_its_module():
    assert xdist_group("tests/search/test_interrupt.py::test_kills[a]") == "tests/search/test_interrupt.py"
    assert xdist_group("tests/search/test_interrupt.py::test_other") == "tests/search/test_interrupt.py"
    assert xdist_group("tests/model/test_x.py::TestA::test_b[1@2]") == "tests/model/test_x.py"


def test_every_module_that_talks_to_the_shared_postgres_server_is_in_one_group():
    assert xdist_group("tests/infra/test_backends_sweep.py::test_any") == POSTGRES_GROUP  # restarts it
    assert xdist_group("tests/test_backend_preflight.py::test_x[a]") == POSTGRES_GROUP  # a refused role on it
    assert xdist_group("tests/test_bad_input.py::test_an_answering_postgresql_passes") == POSTGRES_GROUP


def test_the_slowest_groups_come_first_then_the_others_by_size():
    groups = {"tests/a.py": 3, "tests/b.py": 40, POSTGRES_GROUP: 30, "tests/test_e2e.py": 8, "tests/c.py": 10}
    assert group_order(groups) == [POSTGRES_GROUP, "tests/test_e2e.py", "tests/b.py", "tests/c.py", "tests/a.py"]
    assert all(not g.endswith(".py") or os.path.isfile(os.path.join(os.path.dirname(__file__), "..", g))
               for g in SLOW_FIRST), "SLOW_FIRST names a module that is gone"


@pytest.mark.slow
def test_on_two_workers_each_module_runs_whole_on_one_of_them():
    """Three fast modules on 2 workers: each module's tests ran on one worker, not spread over both as with xdist's
    own ``loadgroup`` under pytest 9.2. The inner run gets the environment of a plain run, not this worker's."""
    modules = ["tests/test_redact.py", "tests/test_ray_count.py", "tests/space/test_env_interpolation.py"]
    done = subprocess.run([sys.executable, "-m", "pytest", "-n", "2", "--dist", "loadgroup", "-v", "-p",
                           "no:cacheprovider", *modules], cwd=REPO, capture_output=True, text=True, timeout=300,
                          env={k: v for k, v in os.environ.items() if not k.startswith("PYTEST_XDIST")})
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    workers: dict[str, set[str]] = {}
    for worker, nodeid in re.findall(r"^\[(gw\d+)\] \[\s*\d+%\] PASSED (\S+)", done.stdout, re.M):
        workers.setdefault(nodeid.split("::")[0], set()).add(worker)
    assert set(workers) == set(modules), done.stdout[-3000:]
    assert all(len(w) == 1 for w in workers.values()), workers
