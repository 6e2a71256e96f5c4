"""Shared fixtures: the real Multi30k files and tiny sweep specs built on a slice of them."""

from __future__ import annotations

import os
import re
import subprocess
import time
import uuid
from collections.abc import Callable, Generator, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.ray_count import RayCounter

REPO = Path(__file__).resolve().parents[1]
MULTI30K = REPO.parent / "shared" / "data" / "multi30k"
MISSING_DATA = r"multi30k|\b(data|file|files|corpus)\b.*\b(not found|not present|missing|does not exist)\b|no such file"
"""Skip reasons (regex) that mean a missing data file: no test has one (conftest's ``multi30k`` fails instead)."""
MISSING_POSTGRES = r"postgres|psycopg"
"""Skip reasons (regex) that mean no PostgreSQL server or driver."""
CI_MUST_NOT_SKIP = re.compile(f"{MISSING_DATA}|{MISSING_POSTGRES}", re.IGNORECASE)
"""Skip reasons CI never has. With ``NAS_CI=1`` (set by .ci/run) a test skipped for one of them fails instead,
so a CI machine that lost its data or its database cannot pass by skipping."""


def _skip_reason(report: pytest.CollectReport | pytest.TestReport) -> str:
    longrepr = report.longrepr
    return longrepr[2] if isinstance(longrepr, tuple) else str(longrepr)  # (path, line, "Skipped: reason")


def _fail_skips_ci_must_not_have(report: pytest.CollectReport | pytest.TestReport) -> None:
    if os.environ.get("NAS_CI") != "1" or not report.skipped or hasattr(report, "wasxfail"):
        return
    reason = _skip_reason(report)
    if CI_MUST_NOT_SKIP.search(reason):
        report.outcome = "failed"
        report.longrepr = f"{reason}\nNAS_CI=1: CI has the data and PostgreSQL, so this skip would hide a failure"


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item,
                               call: pytest.CallInfo) -> Generator[None, pytest.TestReport, pytest.TestReport]:
    report = yield
    _fail_skips_ci_must_not_have(report)
    return report


@pytest.hookimpl(wrapper=True)
def pytest_make_collect_report(
        collector: pytest.Collector) -> Generator[None, pytest.CollectReport, pytest.CollectReport]:
    report = yield  # a module that skips itself (pytest.skip(allow_module_level=True), importorskip)
    _fail_skips_ci_must_not_have(report)
    return report


_RAY_COUNTER = pytest.StashKey[RayCounter]()


XDIST_WORKER = os.environ.get("PYTEST_XDIST_WORKER")
"""The pytest-xdist worker this process is (``gw0``, ``gw1``, ...), or None in a serial run or xdist's controller.
``scripts/test.sh`` runs the suite on 2 workers (``-n 2 --dist loadgroup``, scheduled by :func:`xdist_group`): a
serial run kept one of 2 cores busy on average (103 of 200% over a whole run, 2026-12-04), since much of a sweep's
time is process starts, imports and waits."""
POSTGRES_GROUP = "postgres-5432"
"""The xdist group of the modules that talk to the shared PostgreSQL server: the backends sweep restarts it, so no
other test may use it meanwhile, and one group runs on one worker, one test after the other."""
POSTGRES_MODULES = ("tests/infra/test_backends_sweep.py", "tests/test_backend_preflight.py", "tests/test_bad_input.py")
"""The modules with a test that reaches the shared server: the restart, a refused role, ``postgres_url``."""
SLOW_FIRST = (POSTGRES_GROUP, "tests/search/test_interrupt.py", "tests/test_docs_run.py", "tests/search/test_failures.py",
              "tests/test_e2e.py", "tests/search/test_finetune.py", "tests/search/test_full_size_yaml.py",
              "tests/infra/test_cluster.py", "tests/export/test_aot.py", "tests/search/test_ddp.py",
              "tests/export/test_onnx.py")
"""Groups handed out first, slowest first (90-40 s each, 2026-12-04; test_aot.py 64 s alone), so that no long one is left for the end while
the other worker idles. Only an order: a group missing here is scheduled after these, by its number of tests."""


def xdist_group(nodeid: str) -> str:
    """The xdist group of a test: :data:`POSTGRES_GROUP` for the modules that talk to the shared PostgreSQL server,
    else its module, so that a module's tests, and its module-scoped fixtures (a sweep each in the slow modules),
    stay on one worker and are built once.

    xdist's own ``xdist_group`` marks are not used: with pytest 9.2, xdist 3.8's ``loadgroup`` writes the group into
    a node id field pytest no longer reads, and groups nothing (pytest-dev/pytest-xdist#1386), so
    :func:`pytest_xdist_make_scheduler` schedules by this function instead."""
    module = nodeid.split("::", 1)[0]
    return POSTGRES_GROUP if module in POSTGRES_MODULES else module


def group_order(groups: dict[str, int]) -> list[str]:
    """The groups (name: number of tests) in the order they are handed out: :data:`SLOW_FIRST`'s, then the others by
    number of tests, most first (xdist's own order for ``loadscope``)."""
    slow = [g for g in SLOW_FIRST if g in groups]
    return slow + sorted((g for g in groups if g not in SLOW_FIRST), key=lambda g: -groups[g])


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log):
    """``--dist loadgroup``: xdist's ``loadscope`` scheduling with :func:`xdist_group` as the scope and
    :func:`group_order` as the order. Other ``--dist`` modes keep xdist's own schedulers."""
    if config.getvalue("dist") != "loadgroup":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class GroupScheduling(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return xdist_group(nodeid)

        def _assign_work_unit(self, node) -> None:
            if not getattr(self, "ordered", False):  # the first call: the work queue is whole, nothing handed out
                for group in reversed(group_order({g: len(ids) for g, ids in self.workqueue.items()})):
                    self.workqueue.move_to_end(group, last=False)
                self.ordered = True
            super()._assign_work_unit(node)

    return GroupScheduling(config, log)


def pytest_configure(config: pytest.Config) -> None:
    config.stash[_RAY_COUNTER] = RayCounter(worker=XDIST_WORKER)  # sets RAY_TMPDIR before any test starts Ray
    if XDIST_WORKER:  # 2 workers of 2 intra-op threads each on 2 cores: in-process training ran 3-5x as long
        # (10.7 s -> 53.3 s for test_trainer's unified-space steps, 2026-12-04): 1 thread in each worker, and in the
        # `nas` subprocesses it starts, so that a run in the test's process and one in a subprocess sum in the same
        # order (the kill-and-resume tests compare their weights to 1e-6)
        os.environ["OMP_NUM_THREADS"] = "1"
        import torch

        torch.set_num_threads(1)


_UNMARKED_SWEEPS = pytest.StashKey[list[str]]()
_SWEEPS_BY_TEST = pytest.StashKey[dict[str, int]]()
_SLOW_UNMARKED = pytest.StashKey[dict[str, float]]()
INNER_LOOP_NOTE_S = 8.0
"""A test not marked ``slow`` that takes longer than this (setup, call and teardown) is named at the end of the run:
``pytest -m "not slow"``, the inner loop while coding, aims at 5 minutes on 2 cores (issue 40). A note, not a failure:
timings on a shared VM are no test."""


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None):
    """Note the tests not marked ``slow`` in which a Ray cluster ran Ray Tune (printed at the end: the inner loop
    ``pytest -m "not slow"`` should start no sweep)."""
    counter = item.config.stash.get(_RAY_COUNTER, None)
    before = counter.sessions_with_tune() if counter else set()
    start = time.monotonic()
    try:
        return (yield)
    finally:
        took = time.monotonic() - start
        if took > INNER_LOOP_NOTE_S and item.get_closest_marker("slow") is None:
            item.config.stash.setdefault(_SLOW_UNMARKED, {})[item.nodeid] = took
        started = len(counter.sessions_with_tune() - before) if counter else 0
        if started:
            item.config.stash.setdefault(_SWEEPS_BY_TEST, {})[item.nodeid] = started
        if started and item.get_closest_marker("slow") is None:
            item.config.stash.setdefault(_UNMARKED_SWEEPS, []).append(item.nodeid)


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    """In an xdist worker, hand the per-test notes to the controller, which prints them (:func:`pytest_testnodedown`)."""
    config = session.config
    if hasattr(config, "workeroutput"):
        config.workeroutput["nas_notes"] = {"sweeps": config.stash.get(_SWEEPS_BY_TEST, {}),
                                            "unmarked": config.stash.get(_UNMARKED_SWEEPS, []),
                                            "slow": config.stash.get(_SLOW_UNMARKED, {})}


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node, error) -> None:
    """In xdist's controller: merge a worker's notes (:func:`pytest_sessionfinish`) into the controller's own."""
    notes, stash = getattr(node, "workeroutput", {}).get("nas_notes"), node.config.stash
    if notes:
        stash.setdefault(_SWEEPS_BY_TEST, {}).update(notes["sweeps"])
        stash.setdefault(_UNMARKED_SWEEPS, []).extend(notes["unmarked"])
        stash.setdefault(_SLOW_UNMARKED, {}).update(notes["slow"])


def pytest_terminal_summary(terminalreporter, exitstatus: int, config: pytest.Config) -> None:
    if _RAY_COUNTER in config.stash:
        terminalreporter.write_sep("=", config.stash[_RAY_COUNTER].counts().line())
        for nodeid, started in sorted(config.stash.get(_SWEEPS_BY_TEST, {}).items()):
            terminalreporter.write_line(f"{started} Ray sweep(s) in {nodeid} (or its fixtures)")
        for nodeid in config.stash.get(_UNMARKED_SWEEPS, []):
            terminalreporter.write_line(f"Ray Tune ran in a test not marked slow: {nodeid}")
    for nodeid, took in sorted(config.stash.get(_SLOW_UNMARKED, {}).items(), key=lambda kv: -kv[1]):
        terminalreporter.write_line(f"not marked slow but took {took:.0f} s (over {INNER_LOOP_NOTE_S:.0f} s; the inner "
                                    f"loop `pytest -m \"not slow\"` aims at 5 minutes): {nodeid}")


def pytest_unconfigure(config: pytest.Config) -> None:
    if _RAY_COUNTER in config.stash:
        config.stash[_RAY_COUNTER].close()


@pytest.fixture(scope="module")
def one_torch_thread() -> Iterator[None]:
    """Tiny tensors: one intra-op thread is faster, and not slowed 30x by a busy machine's other processes.
    A module opts in with ``pytestmark = pytest.mark.usefixtures("one_torch_thread")``; the count is restored
    after its last test."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="session")
def multi30k() -> Path:
    if not (MULTI30K / "train.en.gz").is_file():
        pytest.fail(f"Multi30k not found at {MULTI30K}; the tests read the shared data beside the repository")
    return MULTI30K


def tiny_spec_dict(data_dir: Path, work: Path, **overrides) -> dict:
    """A sweep small enough for seconds on 2 CPU cores: 300 training pairs, C=32, 2+2 layers."""
    spec = {
        "name": "tiny",
        "data": {
            "train": {"src": str(data_dir / "train.en.gz"), "tgt": str(data_dir / "train.de.gz")},
            "valid": {"src": str(data_dir / "val.en.gz"), "tgt": str(data_dir / "val.de.gz")},
            "tokenizer": {"vocab_size": 400},
            "max_train_pairs": 300,
            "max_valid_pairs": 12,
            "cache_dir": str(work / "data"),
        },
        "supernet": {"model_dim": 32, "heads": 2, "encoder_layers": 2, "decoder_layers": 2, "ffn_width": 64,
                     "branches": 2, "max_positions": 128},
        "space": {"encoder_layers": {"values": [1, 2]}, "width": {"values": [16, 32], "per_layer": True},
                  "ffn_width": {"values": [32, 64]}, "branches": {"values": [1, 2], "per_layer": True}},
        "train": {"steps": 8, "max_tokens": 512, "warmup_steps": 4, "checkpoint_every": 4, "log_every": 2,
                  "eval_beam_size": 2, "lr": 2e-3},
        "search": {"trials": 2, "max_concurrent": 2, "beam_size": 2, "latency_sentences": 2},
        "resources": {"cpu": 1},
        "workdir": str(work / "runs"),
    }
    for key, value in overrides.items():
        section, _, field = key.partition(".")
        if field:
            spec[section][field] = value
        else:
            spec[section] = value
    return spec


EXP = "nas-test"
"""The MLflow experiment of the tests that write runs by hand (:func:`mlflow_uri`)."""


@pytest.fixture(scope="session")
def empty_mlflow_db(tmp_path_factory) -> Path:
    """An initialised (migrated) MLflow SQLite DB, copied per test to skip ~1 s of migrations."""
    from nas import tracking

    root = tmp_path_factory.mktemp("mlflow-template")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{root}/mlflow.db")
        mp.chdir(root)
        tracking.get_client().search_experiments()
    return root / "mlflow.db"


@pytest.fixture
def mlflow_uri(tmp_path, monkeypatch, empty_mlflow_db) -> str:
    """A fresh MLflow store ``sqlite:///<tmp_path>/mlflow.db`` (a copy of :func:`empty_mlflow_db`) set as
    ``MLFLOW_TRACKING_URI``, with the current folder at ``tmp_path`` (so ``./mlruns`` lands there)."""
    import shutil

    shutil.copyfile(empty_mlflow_db, tmp_path / "mlflow.db")
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    monkeypatch.chdir(tmp_path)  # default artifact root (./mlruns) lands in tmp_path
    return uri


@pytest.fixture
def planted_ids(monkeypatch):
    """Make the SQLite store give the next runs ids that start with chosen prefixes (the rest random):
    ``planted_ids("beef1", "beef2")`` then two ``start_run`` calls. The runs are real; only their ids are chosen."""
    from mlflow.store.tracking import sqlalchemy_store

    queue: list[str] = []

    class ChosenUuid:
        def __getattr__(self, name):
            return getattr(uuid, name)

        @staticmethod
        def uuid4() -> uuid.UUID:
            fresh = uuid.uuid4()
            return uuid.UUID(hex=(queue.pop(0) + fresh.hex)[:32]) if queue else fresh

    monkeypatch.setattr(sqlalchemy_store, "uuid", ChosenUuid())
    return lambda *prefixes: queue.extend(prefixes)


POSTGRES_ADMIN_URL = os.environ.get("NAS_TEST_POSTGRES_URL", "postgresql://postgres@127.0.0.1:5432/postgres")
"""Server the PostgreSQL tests create their databases on (trust auth on these machines)."""


def _postgres_unavailable(reason: str) -> None:
    """Skip with ``reason``, or fail when ``NAS_REQUIRE_POSTGRES=1`` (set by .ci/run)."""
    message = f"PostgreSQL not available at {POSTGRES_ADMIN_URL}: {reason}"
    if os.environ.get("NAS_REQUIRE_POSTGRES") == "1":
        pytest.fail(message + " (NAS_REQUIRE_POSTGRES=1: this must not be skipped)")
    pytest.skip(message + "; start PostgreSQL or set NAS_TEST_POSTGRES_URL")


@pytest.fixture
def postgres_databases() -> Iterator[Callable[[], str]]:
    """Factory of fresh empty PostgreSQL databases (``postgresql+psycopg://USER@HOST:PORT/nas_test_<hex>``), all
    dropped afterwards. Skips with the reason when the server doesn't answer; fails instead when
    ``NAS_REQUIRE_POSTGRES=1``."""
    try:
        import psycopg
    except ImportError as e:
        _postgres_unavailable(f"psycopg is not installed ({e}); pip install 'psycopg[binary]'")
    from sqlalchemy.engine import make_url

    try:
        admin = psycopg.connect(POSTGRES_ADMIN_URL, autocommit=True, connect_timeout=3)
    except psycopg.OperationalError as e:
        _postgres_unavailable(str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__)
    names: list[str] = []

    def create() -> str:
        name = f"nas_test_{uuid.uuid4().hex[:12]}"
        admin.execute(f'CREATE DATABASE "{name}"')
        names.append(name)
        url = make_url(POSTGRES_ADMIN_URL).set(drivername="postgresql+psycopg", database=name)
        return url.render_as_string(hide_password=False)

    with admin:
        try:
            yield create
        finally:
            for name in names:
                admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


@pytest.fixture
def postgres_url(postgres_databases) -> str:
    """A fresh empty PostgreSQL database, as ``postgresql+psycopg://USER@HOST:PORT/nas_test_<hex>``; dropped afterwards.

    Skips with the reason when the server doesn't answer; fails instead when ``NAS_REQUIRE_POSTGRES=1``.
    """
    return postgres_databases()


@pytest.fixture(scope="session")
def tiny_data(multi30k, tmp_path_factory):
    """The data of :func:`tiny_spec_dict` (300 pairs, vocabulary 400), prepared once per session: the one
    SentencePiece training of the tests that train or score the tiny supernet. Read-only; a test shares it by
    pointing ``data.cache_dir`` at its cache folder (:func:`use_tiny_data`), where ``prepare_sweep_data`` finds
    the entry. Returns a :class:`nas.data.PreparedData` (``.root.parent`` is the cache folder)."""
    from nas.builders import prepare_sweep_data
    from nas.space import parse_spec

    work = tmp_path_factory.mktemp("tiny_data")
    return prepare_sweep_data(parse_spec(tiny_spec_dict(data_dir=multi30k, work=work), "tiny_data"), progress=False)


def use_tiny_data(raw: dict, tiny_data) -> dict:
    """``raw`` (a :func:`tiny_spec_dict`, changed in place and returned) with ``data.cache_dir`` at the session's
    :func:`tiny_data` cache; its data section must be the tiny one, or a new entry would be written there."""
    assert {k: v for k, v in raw["data"].items() if k != "cache_dir"} == \
        {k: v for k, v in tiny_spec_dict(Path(raw["data"]["train"]["src"]).parent, Path("."))["data"].items()
         if k != "cache_dir"}, "use_tiny_data: the data section differs from tiny_spec_dict's"
    raw["data"]["cache_dir"] = str(tiny_data.root.parent)
    return raw


@pytest.fixture(scope="session")
def tiny_supernet(multi30k, tiny_data, tmp_path_factory) -> tuple[Path, Path]:
    """A supernet of :func:`tiny_spec_dict` trained once per session, without Ray: (supernet folder, data
    cache folder). Copy the folder to ``<workdir>/tiny/supernet`` and point ``data.cache_dir`` at the cache
    folder, and a sweep reuses both instead of training."""
    from nas.builders import prepare_sweep_data
    from nas.space import parse_spec
    from trainers import train_supernet

    work = tmp_path_factory.mktemp("tiny_supernet")
    spec = parse_spec(use_tiny_data(tiny_spec_dict(data_dir=multi30k, work=work), tiny_data), "tiny_supernet")
    data = prepare_sweep_data(spec, progress=False)
    train_supernet(spec, data, work / "supernet", report=lambda metrics: None, progress=False)
    return work / "supernet", tiny_data.root.parent


def sweep_with_supernet(raw: dict, work: Path, tiny_supernet: tuple[Path, Path]) -> Path:
    """Write ``raw`` (a :func:`tiny_spec_dict`) as ``work/<name>.yaml`` with the session's trained supernet in
    place; returns the YAML path."""
    import shutil

    import yaml

    supernet, cache = tiny_supernet
    raw = {**raw, "data": {**raw["data"], "cache_dir": str(cache)}}
    shutil.copytree(supernet, Path(raw["workdir"]) / raw["name"] / "supernet")
    path = work / f"{raw['name']}.yaml"
    path.write_text(f"# nas sweep {path.name}\n" + yaml.safe_dump(raw))
    return path


def nas_env(work: Path, **extra: str) -> dict[str, str]:
    """Environment for a ``nas`` subprocess: MLflow in ``work/mlflow.db`` (unless ``extra`` sets it)."""
    return {**os.environ, "MLFLOW_TRACKING_URI": f"sqlite:///{work / 'mlflow.db'}", "PYTHONPATH": str(REPO), **extra}


def nas_cli(args: list[str], env: dict[str, str], cwd: Path) -> subprocess.CompletedProcess[str]:
    """``nas ARGS`` in this process, as :func:`run_nas` runs it in a subprocess: the same typer app
    (``typer.testing.CliRunner``), the environment set to ``env`` for the call (variables ``env`` lacks unset), the
    current folder ``cwd``, stdout and stderr captured apart, the exit code (an exception the command did not
    handle: exit 1 with its traceback on stderr, as Python prints it). For the commands that only read and write
    files and stores (``leaderboard``, ``export``, ``report``, ``sweep --status``, refusals that exit 2): a
    subprocess pays 3-5 s importing torch, MLflow and Ray before it starts. Sweeps, kills, signals and anything that
    sets process-wide state (``--threads``) stay in :func:`run_nas`."""
    import traceback
    from contextlib import chdir

    from typer.testing import CliRunner

    from nas.cli import app

    changes: dict[str, str | None] = {k: v for k, v in env.items() if os.environ.get(k) != v}
    changes.update({k: None for k in os.environ if k not in env})
    with chdir(cwd):
        result = CliRunner().invoke(app, [str(a) for a in args], env=changes)
    stderr = result.stderr
    if result.exception is not None and not isinstance(result.exception, SystemExit):
        stderr += "".join(traceback.format_exception(result.exception))
    return subprocess.CompletedProcess(["nas", *map(str, args)], result.exit_code, result.stdout, stderr)


def run_nas(args: list[str], env: dict[str, str], cwd: Path, timeout: float = 900):
    """``python -m nas.cli ARGS`` in a subprocess; returns the CompletedProcess (text, captured)."""
    import sys

    return subprocess.run([sys.executable, "-m", "nas.cli", *args], capture_output=True, text=True, env=env, cwd=cwd,
                          timeout=timeout)


@dataclass
class SweepRecords:
    """What a sweep left in Optuna, Ray Tune and MLflow (read back with the real libraries)."""

    optuna: list  # optuna FrozenTrial, by number
    ray: list  # ray.tune Trial of the search experiment
    runs: list  # every MLflow run tagged with the sweep id

    def trial_runs(self) -> list:
        return [r for r in self.runs if r.data.tags.get("nas.role") == "trial"]

    def roles(self, role: str) -> list:
        return [r for r in self.runs if r.data.tags.get("nas.role") == role]


def read_sweep(spec_file: Path, env: dict[str, str]) -> SweepRecords:
    """The records of the sweep of ``spec_file`` in the MLflow store named by ``env``."""
    from ray.tune import ExperimentAnalysis

    from nas import tracking
    from nas.search.runner import ray_dir, read_sweep_record, study_ref
    from nas.space import load_spec

    spec = load_spec(spec_file, check_files=False)
    record = read_sweep_record(spec.run_dir)
    assert record is not None, f"no sweep.json under {spec.run_dir}"
    trials = study_ref(spec, record.sweep_id).load().get_trials()
    exp_dir = ray_dir(spec, record.sweep_id, "search")
    ray_trials = ExperimentAnalysis(str(exp_dir)).trials if exp_dir.is_dir() else []
    old = os.environ.get("MLFLOW_TRACKING_URI")
    os.environ["MLFLOW_TRACKING_URI"] = env["MLFLOW_TRACKING_URI"]
    try:
        runs = tracking.find_tagged_runs(spec.experiment, {tracking.TAG_SWEEP_ID: record.sweep_id})
    finally:
        if old is None:
            del os.environ["MLFLOW_TRACKING_URI"]
        else:
            os.environ["MLFLOW_TRACKING_URI"] = old
    return SweepRecords(trials, ray_trials, runs)


S3_BUCKET = "nas-test"


@pytest.fixture
def s3_storage(monkeypatch) -> Iterator[str]:
    """An S3 bucket on a local S3-compatible server (moto's, in a thread on a free 127.0.0.1 port), as a
    ``resources.storage_path`` in the URI form pyarrow and Ray Tune read:
    ``s3://nas-test/ray?endpoint_override=127.0.0.1:PORT&scheme=http``. Test credentials are set in the
    environment (``AWS_ACCESS_KEY_ID``, ...), which :func:`nas_env` passes on to ``nas`` subprocesses."""
    import logging

    try:
        import boto3
        from moto import server as moto_server
    except ImportError as e:
        pytest.fail(f"{e}: the S3 tests need the test extra (pip install -e '.[test]', which has moto[server])")

    for key, value in {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
                       "AWS_DEFAULT_REGION": "us-east-1", "AWS_EC2_METADATA_DISABLED": "true"}.items():
        monkeypatch.setenv(key, value)
    monkeypatch.delenv("AWS_SESSION_TOKEN", raising=False)
    monkeypatch.delenv("AWS_PROFILE", raising=False)
    logging.getLogger("werkzeug").setLevel(logging.WARNING)  # one line per request otherwise
    server = moto_server.ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    try:
        boto3.client("s3", endpoint_url=f"http://{host}:{port}").create_bucket(Bucket=S3_BUCKET)
        yield f"s3://{S3_BUCKET}/ray?endpoint_override={host}:{port}&scheme=http"
    finally:
        server.stop()


@pytest.fixture
def translator_steps(monkeypatch) -> list[int]:
    """Counts the decoder steps of every ONNX translator (``translate_onnx.py``'s ``OnnxTranslator.step``, the real
    one, passed through) while the test runs: one item per step."""
    from nas.export.translate_onnx import OnnxTranslator

    steps: list[int] = []
    real_step = OnnxTranslator.step

    def counting_step(self, *args):
        steps.append(1)
        return real_step(self, *args)
    monkeypatch.setattr(OnnxTranslator, "step", counting_step)
    return steps


def completed_trials(run_dir: Path) -> list[int]:
    """Numbers of the COMPLETE trials in a sweep's Optuna journal (``run_dir``: ``<workdir>/<name>``; read while the
    driver writes it): what the kill and signal tests wait for."""
    import json

    import optuna
    from optuna.trial import TrialState

    record = run_dir / "sweep.json"
    if not record.is_file() or not (run_dir / "optuna.journal").is_file():
        return []
    storage = optuna.storages.JournalStorage(optuna.storages.journal.JournalFileBackend(str(run_dir / "optuna.journal")))
    try:
        study = optuna.load_study(study_name=json.loads(record.read_text())["sweep_id"], storage=storage)
    except KeyError:
        return []
    return [t.number for t in study.get_trials(deepcopy=False) if t.state == TrialState.COMPLETE]


def kill_driver(proc) -> None:
    """SIGKILL a ``nas sweep`` driver started with ``start_new_session=True`` (a ``subprocess.Popen``), then the Ray
    processes it leaves in its process group."""
    import signal

    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=60)
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def load_script(relative: str):
    """The module of a script outside the package (``benchmarks/*.py``, ``experiments/*.py``; ``relative`` to the
    repository), imported by its path and registered in ``sys.modules`` under its stem (dataclasses look their module
    up while the file runs)."""
    import importlib.util
    import sys

    path = REPO / relative
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[path.stem] = module
    spec.loader.exec_module(module)
    return module
