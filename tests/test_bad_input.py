"""Bad input beyond the YAML's shape, through the real ``nas sweep``: data files that are folders, unreadable,
corrupt, empty or misaligned, and backends that do not answer (an MLflow server, a database, a Ray address).

Each must end with exit code 2, one line naming the YAML key or variable and the fix, and nothing started or
written: no run folder, no data cache, no ``mlflow.db``, no Ray. The backend checks of ``nas.preflight`` are
also run against real servers that do answer (a local HTTP server, a TCP listener, PostgreSQL).
"""

from __future__ import annotations

import base64
import gzip
import http.server
import importlib.util
import os
import shutil
import socket
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from nas.cli import app
from nas.preflight import BackendError, check_backends, check_database, check_mlflow, check_ray_address
from nas.space import parse_spec
from tests.conftest import MULTI30K, POSTGRES_ADMIN_URL, REPO, tiny_spec_dict

runner = CliRunner()


@pytest.fixture
def work(tmp_path, monkeypatch) -> Path:
    """An empty working folder as the current directory, with no backend chosen by the environment."""
    for var in ("MLFLOW_TRACKING_URI", "RAY_ADDRESS", "MLFLOW_TRACKING_USERNAME", "MLFLOW_TRACKING_PASSWORD",
                "MLFLOW_TRACKING_TOKEN"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.chdir(tmp_path)
    return tmp_path


def write_sweep(work: Path, **overrides) -> Path:
    """The tiny sweep (run folder ``work/runs``, data cache ``work/data``) with ``overrides``, as ``work/sweep.yaml``."""
    path = work / "sweep.yaml"
    path.write_text(yaml.safe_dump(tiny_spec_dict(MULTI30K, work, **overrides), sort_keys=False), encoding="utf-8")
    return path


def closed_port() -> int:
    """A local TCP port nothing listens on (bound, then released)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def snapshot(folder: Path) -> set[Path]:
    return set(folder.rglob("*"))


def assert_refused(work: Path, args: list[str], *fragments: str) -> str:
    """``nas sweep ARGS`` exits 2 with one ``error:`` line holding every fragment, and creates nothing."""
    before = snapshot(work)
    result = runner.invoke(app, ["sweep", *args])
    assert result.exit_code == 2, (result.output, result.exception)
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert len(lines) == 1, result.output
    assert lines[0].startswith("error: "), result.output
    for fragment in fragments:
        assert fragment in lines[0], f"{fragment!r} not in {lines[0]!r}"
    assert snapshot(work) == before, f"created: {sorted(map(str, snapshot(work) - before))}"
    ray = sys.modules.get("ray")
    assert ray is None or not ray.is_initialized(), "Ray was started"
    return lines[0]


# ---- data files -------------------------------------------------------------------------------------


def train_pair(src: Path, tgt: Path = MULTI30K / "train.de.gz") -> dict:
    return {"data.train": {"src": str(src), "tgt": str(tgt)}}


def test_a_folder_as_data_file_names_the_key_and_the_folder(work):
    folder = work / "corpus"
    folder.mkdir()
    spec = write_sweep(work, **train_pair(folder))
    assert_refused(work, [str(spec)], "data.train.src:", f"{folder} is a folder, not a data file", "point data.train.src")


def test_a_missing_data_file_names_the_key_and_the_path(work):
    spec = write_sweep(work, **train_pair(MULTI30K / "train.en.gz", work / "train.de.gz"))
    assert_refused(work, [str(spec)], "data.train.tgt: file not found:", str(work / "train.de.gz"))


def test_a_corrupt_gzip_file_is_named_before_anything_starts(work):
    broken = work / "train.en.gz"
    broken.write_bytes(gzip.compress(b"a sentence\n" * 50)[:-20])  # cut short, like an interrupted download
    spec = write_sweep(work, **train_pair(broken))
    assert_refused(work, [str(spec)], "data.train.src:", f"{broken} is not a valid gzip file", "download it again")


def test_a_data_file_that_is_not_utf8_is_named(work):
    latin1 = work / "train.en"
    latin1.write_bytes("un caf\u00e9\n".encode("latin-1"))
    spec = write_sweep(work, **train_pair(latin1))
    assert_refused(work, [str(spec)], "data.train.src:", f"{latin1} is not UTF-8 text", "iconv")


def test_an_empty_data_file_is_named(work):
    empty = work / "train.en"
    empty.touch()
    spec = write_sweep(work, **train_pair(empty))
    assert_refused(work, [str(spec)], "data.train.src:", f"{empty} is empty")


def test_misaligned_source_and_target_name_both_files_and_both_counts(work):
    spec = write_sweep(work, **train_pair(MULTI30K / "train.en.gz", MULTI30K / "val.de.gz"))
    assert_refused(work, [str(spec)], f"{spec}: data.train: source and target are misaligned",
                   f"data.train.src {MULTI30K / 'train.en.gz'} has 29000 lines",
                   f"data.train.tgt {MULTI30K / 'val.de.gz'} has 1014",
                   "point both keys at the two sides of one corpus")


def test_a_target_one_line_short_is_caught_in_the_validation_split(work):
    src, tgt = work / "valid.en", work / "valid.de"
    src.write_text("one\ntwo\nthree\n", encoding="utf-8")
    tgt.write_text("eins\nzwei\n", encoding="utf-8")
    spec = write_sweep(work, **{"data.valid": {"src": str(src), "tgt": str(tgt)}})
    assert_refused(work, [str(spec)], "data.valid: source and target are misaligned", "has 3 lines", "has 2")


def test_data_files_are_counted_like_read_lines_counts_them(work):
    """A last line without a newline and ``\\r\\n`` endings: aligned for ``read_lines``, so the sweep file loads."""
    from nas.space import load_spec

    src, tgt = work / "valid.en", work / "valid.de"
    src.write_bytes(b"one\r\ntwo\r\nthree")
    tgt.write_bytes(b"eins\nzwei\ndrei\n")
    spec = load_spec(write_sweep(work, **{"data.valid": {"src": str(src), "tgt": str(tgt)}}))
    assert spec.data.valid.src == src


def without_file_permission_override() -> list[str]:
    """A command prefix under which root, too, is refused a file without read permission: the capabilities that
    bypass file permissions dropped (``setpriv``); nothing for other users."""
    if os.geteuid() != 0:
        return []
    if shutil.which("setpriv") is None:
        pytest.skip("running as root without setpriv (util-linux): root reads files without read permission")
    return ["setpriv", "--bounding-set=-dac_override,-dac_read_search", "--"]


@pytest.mark.slow  # over 5 s on 2 cores: out of the inner loop (pytest -m "not slow")
def test_a_data_file_without_read_permission_names_the_key_and_the_path(work):
    """In a subprocess, the real `nas` command, as a user that file permissions apply to."""
    locked = work / "train.en.gz"
    shutil.copyfile(MULTI30K / "train.en.gz", locked)
    locked.chmod(0o000)
    spec = write_sweep(work, **train_pair(locked))
    before = snapshot(work)
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    result = subprocess.run([*without_file_permission_override(), sys.executable, "-m", "nas.cli", "sweep", str(spec)],
                            cwd=work, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 2, result.stdout + result.stderr
    lines = [line for line in (result.stdout + result.stderr).splitlines() if line.strip()]
    assert len(lines) == 1, lines
    assert f"data.train.src: cannot read {locked} (Permission denied)" in lines[0]
    assert "chmod a+r" in lines[0]
    assert snapshot(work) == before


def test_prepare_data_names_the_key_of_a_folder_or_an_unreadable_file(tmp_path):
    """The same checks in ``nas.data`` itself, for callers that skip the YAML (before anything is hashed)."""
    from nas.data import DataError, prepare_data

    files = [MULTI30K / name for name in ("train.en.gz", "train.de.gz", "val.en.gz", "val.de.gz")]
    folder = tmp_path / "corpus"
    folder.mkdir()
    with pytest.raises(DataError, match=rf"data\.valid\.src: {folder} is a folder, not a data file"):
        prepare_data(files[0], files[1], folder, files[3], 400, tmp_path / "cache", progress=False)
    assert not (tmp_path / "cache").exists()


# ---- backends that do not answer ---------------------------------------------------------------------


def test_an_unreachable_mlflow_server_is_named_with_the_variable(work, monkeypatch):
    uri = f"http://127.0.0.1:{closed_port()}"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    assert_refused(work, [str(write_sweep(work))],
                   f"MLflow tracking server {uri} does not answer (connection refused)", "set MLFLOW_TRACKING_URI")


def test_an_unreachable_mlflow_database_is_named_with_the_variable(work, monkeypatch):
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "postgresql://nobody@127.0.0.1:1/x")
    assert_refused(work, [str(write_sweep(work))],
                   "MLflow tracking database postgresql://nobody@127.0.0.1:1/x (MLFLOW_TRACKING_URI) does not answer "
                   "(connection refused)")


def test_an_mlflow_sqlite_file_in_a_missing_folder_is_named(work, monkeypatch):
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{work}/nope/mlflow.db")
    assert_refused(work, [str(write_sweep(work))], f"folder {work / 'nope'} does not exist",
                   f"mkdir -p {work / 'nope'}", "MLFLOW_TRACKING_URI")


def test_an_unreachable_optuna_storage_is_named_with_its_yaml_key_and_no_password(work):
    spec = write_sweep(work, tracking={"optuna_storage": "postgresql://nobody:hunter2@127.0.0.1:1/x"})
    line = assert_refused(work, [str(spec)],
                          "Optuna storage postgresql://nobody:***@127.0.0.1:1/x (tracking.optuna_storage in the YAML) "
                          "does not answer (connection refused)", "fix tracking.optuna_storage")
    assert "hunter2" not in line


def test_an_unreachable_ray_address_is_named_with_the_option(work):
    assert_refused(work, [str(write_sweep(work)), "--address", "ray://127.0.0.1:1"],
                   "Ray cluster ray://127.0.0.1:1 does not answer at 127.0.0.1:1 (connection refused)",
                   "ray start --head", "fix --address")


def test_an_unreachable_ray_address_from_the_environment_is_named(work, monkeypatch):
    port = closed_port()
    monkeypatch.setenv("RAY_ADDRESS", f"127.0.0.1:{port}")
    assert_refused(work, [str(write_sweep(work))], f"Ray cluster 127.0.0.1:{port} does not answer",
                   "the RAY_ADDRESS environment variable")


def test_data_problems_are_reported_before_backends_are_contacted(work, monkeypatch):
    """One line, the first problem: a bad data file is found without waiting on any server."""
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"http://127.0.0.1:{closed_port()}")
    spec = write_sweep(work, **train_pair(MULTI30K / "train.en.gz", MULTI30K / "val.de.gz"))
    assert_refused(work, [str(spec), "--address", "ray://127.0.0.1:1"], "misaligned")


# ---- the checks against servers that do answer ----------------------------------------------------------


class _MlflowLike(http.server.BaseHTTPRequestHandler):
    """Answers like an MLflow server: /health always, the REST API only with the right basic auth (if any)."""

    password: str | None = None
    api_status = 200

    def do_GET(self):  # noqa: N802 (http.server's name)
        if self.path == "/health":
            status = 200
        elif self.path.startswith("/api/2.0/mlflow/experiments/search"):
            expected = None if self.password is None else \
                "Basic " + base64.b64encode(f"alice:{self.password}".encode()).decode()
            status = self.api_status if expected in (None, self.headers.get("Authorization")) else 401
        else:
            status = 404
        body = b'{"experiments": []}' if status == 200 else b"{}"
        self.send_response(status)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


@pytest.fixture
def http_server() -> Iterator[callable]:
    """Start a real local HTTP server with a handler class; returns its base URL."""
    servers = []

    def start(handler: type) -> str:
        server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
        threading.Thread(target=server.serve_forever, daemon=True).start()
        servers.append(server)
        return f"http://127.0.0.1:{server.server_address[1]}"

    yield start
    for server in servers:
        server.shutdown()
        server.server_close()


def test_an_answering_mlflow_server_passes(http_server):
    check_mlflow(http_server(_MlflowLike), timeout_s=5)


def test_an_mlflow_server_that_wants_credentials_names_the_variables(http_server, monkeypatch):
    class Locked(_MlflowLike):
        password = "s3cret"

    base = http_server(Locked)
    with pytest.raises(BackendError, match=r"refuses the request \(HTTP 401\); set MLFLOW_TRACKING_USERNAME and "
                                           r"MLFLOW_TRACKING_PASSWORD"):
        check_mlflow(base, timeout_s=5)
    check_mlflow(base.replace("http://", "http://alice:s3cret@"), timeout_s=5)  # credentials in the URI
    monkeypatch.setenv("MLFLOW_TRACKING_USERNAME", "alice")
    monkeypatch.setenv("MLFLOW_TRACKING_PASSWORD", "s3cret")
    check_mlflow(base, timeout_s=5)


def test_a_password_in_the_mlflow_uri_is_hidden_in_the_message(http_server):
    class Locked(_MlflowLike):
        password = "s3cret"

    uri = http_server(Locked).replace("http://", "http://alice:wrong@")
    with pytest.raises(BackendError) as info:
        check_mlflow(uri, timeout_s=5)
    assert "alice:***@127.0.0.1" in str(info.value) and "wrong" not in str(info.value)


def test_an_http_server_that_is_not_mlflow_is_named(http_server):
    class NotMlflow(_MlflowLike):
        api_status = 404

    class Nothing(http.server.BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802
            self.send_error(404)

        def log_message(self, *args):
            pass

    for handler in (NotMlflow, Nothing):
        with pytest.raises(BackendError, match=r"answers HTTP \d+ to /health and HTTP 404 to "
                                               r"/api/2.0/mlflow/experiments/search; check that MLFLOW_TRACKING_URI"):
            check_mlflow(http_server(handler), timeout_s=5)


def test_a_server_that_accepts_but_never_answers_times_out():
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(4)  # the kernel accepts connections; nobody ever reads or writes
        port = listener.getsockname()[1]
        with pytest.raises(BackendError, match=r"does not answer \(no answer within 0.5 s\)"):
            check_mlflow(f"http://127.0.0.1:{port}", timeout_s=0.5)
        check_ray_address(f"127.0.0.1:{port}", timeout_s=0.5)  # a TCP connection is all the Ray check asks
        check_ray_address(f"ray://127.0.0.1:{port}", timeout_s=0.5)


def test_a_service_that_does_not_speak_http_is_named():
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(4)

        def greet_like_ssh():
            conn, _ = listener.accept()
            with conn:
                conn.recv(1024)
                conn.sendall(b"SSH-2.0-OpenSSH_9.6\r\n")

        threading.Thread(target=greet_like_ssh, daemon=True).start()
        uri = f"http://127.0.0.1:{listener.getsockname()[1]}"
        with pytest.raises(BackendError, match=rf"MLflow tracking server {uri} does not speak HTTP \(BadStatusLine"):
            check_mlflow(uri, timeout_s=5)


@pytest.mark.parametrize("address", [None, "auto", "local", "anyscale://my-cluster"])
def test_local_and_non_ray_addresses_are_not_contacted(address, monkeypatch):
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    check_ray_address(address, timeout_s=0.1)


@pytest.mark.parametrize("address, fragment", [("ray://", "names no host"), ("ray://host:port", "is malformed")])
def test_a_malformed_ray_address_is_named(address, fragment):
    with pytest.raises(BackendError, match=fragment):
        check_ray_address(address)


def test_an_sqlite_tracking_file_in_an_existing_folder_passes_and_is_not_created(tmp_path):
    check_mlflow(f"sqlite:///{tmp_path}/mlflow.db")
    assert not (tmp_path / "mlflow.db").exists()


def test_a_missing_database_driver_is_named():
    if importlib.util.find_spec("MySQLdb") is not None:
        pytest.skip("mysqlclient is installed here, so mysql:// has its driver")
    with pytest.raises(BackendError, match=r"mysql://u:\*\*\*@127.0.0.1:1/x \(MLFLOW_TRACKING_URI\): no database driver "
                                           r"for mysql .*fix MLFLOW_TRACKING_URI"):
        check_mlflow("mysql://u:p@127.0.0.1:1/x")


def test_the_default_backends_pass_and_write_nothing(work):
    """No MLFLOW_TRACKING_URI (sqlite:///<cwd>/mlflow.db), the journal file, a local Ray: nothing to contact."""
    spec = parse_spec(tiny_spec_dict(MULTI30K, work), "tiny")
    check_backends(spec, None)
    assert list(work.iterdir()) == []


def test_an_answering_postgresql_passes_as_optuna_storage_and_mlflow_store(postgres_url, monkeypatch, tmp_path):
    monkeypatch.setenv("MLFLOW_TRACKING_URI", postgres_url)
    monkeypatch.chdir(tmp_path)
    spec = parse_spec(tiny_spec_dict(MULTI30K, tmp_path, tracking={"optuna_storage": postgres_url}), "tiny")
    check_backends(spec, None)


def test_a_postgresql_database_that_does_not_exist_says_how_to_create_it(postgres_databases):
    from sqlalchemy.engine import make_url

    url = make_url(POSTGRES_ADMIN_URL).set(database="nas_test_no_such_db").render_as_string(hide_password=False)
    with pytest.raises(BackendError, match=r'cannot be opened \(database "nas_test_no_such_db" does not exist\); '
                                           r"create it \(CREATE DATABASE nas_test_no_such_db\)"):
        check_database(url, what="Optuna storage", setting="tracking.optuna_storage in the YAML")


@pytest.mark.parametrize("option", [["--samples", "1"], ["--threads", "0"]])
def test_latency_fit_refuses_counts_below_their_minimum_with_exit_2(tmp_path, option):
    """Bad numbers for ``nas latency fit`` are usage errors (exit 2, naming the option), not a traceback after
    the supernet is loaded."""
    result = runner.invoke(app, ["latency", "fit", str(tmp_path / "never-read.yaml"), *option])
    assert result.exit_code == 2, (result.output, result.exception)
    assert option[0] in result.output


# ---- the test-only fault hook ---------------------------------------------------------------------------


def test_a_malformed_nas_test_fault_is_refused_before_anything_starts(work, monkeypatch):
    """Not a trial-by-trial failure of the whole sweep: one line at startup that says how to turn the hook off."""
    monkeypatch.setenv("NAS_TEST_FAULT", "explode")
    assert_refused(work, [str(write_sweep(work))], "NAS_TEST_FAULT='explode': expected KIND[:WHEN]",
                   "unset it, or set it to 0")


def test_the_python_api_refuses_a_malformed_nas_test_fault_before_anything_is_written(work, monkeypatch):
    """``nas.api.sweep`` (a notebook's entry point) checks the hook as ``nas sweep`` does: no run folder, no data
    cache, no Ray. Failed before: the sweep started and every trial failed on the malformed value."""
    from nas import api
    from nas.faults import FaultSpecError

    path = write_sweep(work)
    before = snapshot(work)
    monkeypatch.setenv("NAS_TEST_FAULT", "explode")
    with pytest.raises(FaultSpecError, match="NAS_TEST_FAULT='explode': expected KIND"):
        api.sweep(path)
    assert snapshot(work) == before
