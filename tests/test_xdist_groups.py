"""The suite's pytest-xdist groups (``scripts/test.sh`` runs 2 workers with ``--dist loadgroup``): a module's tests stay
on one worker, so its module-scoped fixtures (a sweep each in the slow modules) are built once, and every test that
talks to the shared PostgreSQL server runs on one worker, since the backends sweep restarts that server."""

from tests.conftest import POSTGRES_GROUP, xdist_group


def test_a_test_is_grouped_with_its_module():
    assert xdist_group("tests/search/test_interrupt.py::test_kills[a]", ["tmp_path", "ray_head"]) == \
        "tests/search/test_interrupt.py"
    assert xdist_group("tests/search/test_interrupt.py::test_other", []) == "tests/search/test_interrupt.py"


def test_every_test_that_talks_to_the_shared_postgres_server_is_in_one_group():
    assert xdist_group("tests/infra/test_backends_sweep.py::test_any", ["tmp_path"]) == POSTGRES_GROUP  # restarts it
    assert xdist_group("tests/test_backend_preflight.py::test_x[a]", []) == POSTGRES_GROUP  # a refused role on it
    assert xdist_group("tests/test_bad_input.py::test_y", ["postgres_url", "tmp_path"]) == POSTGRES_GROUP
    assert xdist_group("tests/test_bad_input.py::test_z", ["tmp_path"]) == "tests/test_bad_input.py"


def test_the_collected_suite_carries_the_groups(request):
    marks = [m.args[0] for m in request.node.iter_markers("xdist_group")]
    assert marks == ["tests/test_xdist_groups.py"]
