"""Before a sweep starts: do its backends answer? The MLflow tracking store, the Optuna storage and the Ray cluster.

``nas sweep`` calls :func:`check_backends` right after the YAML is validated, so an unreachable server fails in
seconds with one line naming the backend, its address (password hidden), the reason and the setting that points
at it, before Ray starts, an MLflow run opens or a folder is written. Each check waits at most ``timeout_s``
seconds and writes nothing (an SQLite file is not created, only its folder is looked at).
"""

from __future__ import annotations

import base64
import http.client
import math
import os
import socket
import ssl
import urllib.error
import urllib.request
from pathlib import Path
from urllib.parse import unquote, urlsplit, urlunsplit

from nas.redact import redact_url
from nas.space import SpecError, SweepSpec

__all__ = ["TIMEOUT_S", "BackendError", "check_backends", "check_database", "check_mlflow", "check_ray_address",
           "check_tracking_store"]

TIMEOUT_S = 5.0
"""Seconds each backend gets to answer."""

_DB_SCHEMES = ("postgresql", "postgres", "mysql", "mariadb", "mssql", "oracle")
"""SQLAlchemy dialects MLflow's tracking store accepts (with an optional ``+driver``), besides sqlite."""
_LOCAL_RAY = (None, "", "auto", "local")
"""Ray addresses with no host to check: start a local cluster, or find one on this machine."""


class BackendError(SpecError):
    """A backend of the sweep does not answer or refuses it; the message names the backend, its address, the
    reason and the environment variable or YAML key that points at it."""


def check_backends(spec: SweepSpec, address: str | None, *, timeout_s: float = TIMEOUT_S) -> None:
    """Check, without writing anything, that the sweep's backends answer.

    Args:
        spec: the validated sweep; ``tracking.optuna_storage`` (a database URL) is checked when set.
        address: ``nas sweep --address``; None, ``auto`` and ``local`` are not checked (``$RAY_ADDRESS`` is, when
            ``address`` is None).
        timeout_s: how long each backend gets to answer (seconds).

    Raises:
        BackendError: the MLflow tracking URI (``$MLFLOW_TRACKING_URI``, default ``sqlite:///<cwd>/mlflow.db``),
            the Optuna storage or the Ray address does not answer or cannot be used.
    """
    from nas.tracking.layout import tracking_uri

    uri = tracking_uri()
    env_set = bool(os.environ.get("MLFLOW_TRACKING_URI"))
    check_mlflow(uri, timeout_s=timeout_s,
                 fix="set MLFLOW_TRACKING_URI" if env_set else "run from a writable folder or set MLFLOW_TRACKING_URI")
    storage = spec.tracking.optuna_storage
    if storage:
        check_database(storage, what="Optuna storage", setting="tracking.optuna_storage in the YAML",
                       timeout_s=timeout_s)
    check_ray_address(address, timeout_s=timeout_s)


def check_tracking_store(*, read_only: bool = False, timeout_s: float = TIMEOUT_S) -> None:
    """Check the MLflow tracking store of a command other than ``nas sweep`` (``leaderboard``, ``report``,
    ``export``: ``read_only``; ``train``, ``retrain``) before MLflow is called, so that a server or database that
    refuses fails in one line within ``timeout_s`` instead of after MLflow's retries.

    Raises:
        NotFoundError: ``read_only`` and the store is an SQLite file that does not exist (nothing is created;
            :func:`nas.tracking.require_store`). BackendError: the store does not answer or cannot be used.
    """
    from nas.tracking import require_store
    from nas.tracking.layout import tracking_uri

    uri = tracking_uri()
    if read_only:
        require_store()
        if urlsplit(uri).scheme.lower().startswith("sqlite"):
            return  # it exists; read-only needs no writable folder
    env_set = bool(os.environ.get("MLFLOW_TRACKING_URI"))
    check_mlflow(uri, timeout_s=timeout_s,
                 fix="set MLFLOW_TRACKING_URI" if env_set else "run from a writable folder or set MLFLOW_TRACKING_URI")


# --------------------------------------------------------------------------- MLflow


def check_mlflow(uri: str, *, timeout_s: float = TIMEOUT_S, fix: str = "set MLFLOW_TRACKING_URI") -> None:
    """Check an MLflow tracking URI: an http(s) server answers ``/health`` and the REST API (with the
    ``MLFLOW_TRACKING_USERNAME``/``PASSWORD`` or ``TOKEN`` credentials); a database answers a connection; an
    SQLite file's folder exists and is writable; a file store's folder is writable. Other schemes
    (``databricks``...) are not checked.

    Raises:
        BackendError: naming the URI (password hidden), the reason and ``fix``.
    """
    scheme = urlsplit(uri).scheme.lower()
    if scheme in ("http", "https"):
        _check_http(uri, timeout_s, fix)
    elif scheme == "sqlite" or scheme.startswith("sqlite+"):
        _check_sqlite(uri, "MLflow tracking database", fix)
    elif scheme.split("+")[0] in _DB_SCHEMES:
        check_database(uri, what="MLflow tracking database", setting="MLFLOW_TRACKING_URI", timeout_s=timeout_s,
                       fix=f"start it or {fix}")
    elif scheme in ("", "file"):
        _check_folder(Path(urlsplit(uri).path if scheme else uri), "MLflow file store", uri, fix)


def _http_get(url: str, timeout_s: float, headers: dict[str, str]) -> int:
    """GET ``url``; the HTTP status (errors included). Raises OSError (URLError...) when nothing answers."""
    context = None
    if url.startswith("https:"):
        if os.environ.get("MLFLOW_TRACKING_INSECURE_TLS", "").lower() == "true":
            context = ssl._create_unverified_context()  # what MLflow's client does with this variable
        else:
            context = ssl.create_default_context(cafile=os.environ.get("MLFLOW_TRACKING_SERVER_CERT_PATH") or None)
    request = urllib.request.Request(url, headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=timeout_s, context=context) as response:
            return response.status
    except urllib.error.HTTPError as e:
        e.close()
        return e.code


def _credentials(uri: str) -> tuple[str, dict[str, str]]:
    """``uri`` without ``user:password@`` and the Authorization header MLflow's client would send: basic auth
    from ``$MLFLOW_TRACKING_USERNAME``/``PASSWORD`` (else the URI's user info), else ``$MLFLOW_TRACKING_TOKEN``."""
    parts = urlsplit(uri)
    creds, at, hostport = parts.netloc.rpartition("@")
    bare = urlunsplit(parts._replace(netloc=hostport)) if at else uri
    user, password = os.environ.get("MLFLOW_TRACKING_USERNAME"), os.environ.get("MLFLOW_TRACKING_PASSWORD")
    if not (user and password) and at:
        user, _, password = (unquote(c) for c in creds.partition(":"))
    if user and password:
        return bare, {"Authorization": "Basic " + base64.b64encode(f"{user}:{password}".encode()).decode()}
    token = os.environ.get("MLFLOW_TRACKING_TOKEN")
    return bare, ({"Authorization": f"Bearer {token}"} if token else {})


def _check_http(uri: str, timeout_s: float, fix: str) -> None:
    shown = redact_url(uri)
    bare, auth = _credentials(uri)
    base = bare.rstrip("/")
    try:
        health = _http_get(f"{base}/health", timeout_s, {})
        api = _http_get(f"{base}/api/2.0/mlflow/experiments/search?max_results=1", timeout_s, auth)
    except (OSError, ValueError) as e:  # URLError: refused, timeout, unknown host; ValueError: a malformed URL
        raise BackendError(f"MLflow tracking server {shown} does not answer ({_why(e, timeout_s)}); "
                           f"start it (mlflow server ...) or {fix}") from None
    except http.client.HTTPException as e:  # something that is not an HTTP server answered
        raise BackendError(f"MLflow tracking server {shown} does not speak HTTP ({type(e).__name__}: {e}); "
                           f"{fix} to an MLflow server") from None
    if api == 200:
        return
    if api in (401, 403):
        raise BackendError(f"MLflow tracking server {shown} refuses the request (HTTP {api}); set "
                           f"MLFLOW_TRACKING_USERNAME and MLFLOW_TRACKING_PASSWORD (or MLFLOW_TRACKING_TOKEN), "
                           f"or allow this host in the server's --allowed-hosts")
    raise BackendError(f"MLflow tracking server {shown} answers HTTP {health} to /health and HTTP {api} to "
                       f"/api/2.0/mlflow/experiments/search; check that MLFLOW_TRACKING_URI points at an MLflow "
                       f"server (with its --static-prefix, if any)")


def _check_sqlite(url: str, what: str, fix: str) -> None:
    from sqlalchemy.engine import make_url

    database = make_url(url).database
    if not database or database == ":memory:" or database.startswith("file:"):
        return
    path = Path(database)
    if path.is_dir():
        raise BackendError(f"{what} {redact_url(url)}: {path} is a folder, not a database file; {fix}")
    if not path.parent.is_dir():
        raise BackendError(f"{what} {redact_url(url)}: folder {path.parent} does not exist; create it "
                           f"(mkdir -p {path.parent}) or {fix}")
    target = path if path.exists() else path.parent
    if not os.access(target, os.W_OK):
        raise BackendError(f"{what} {redact_url(url)}: {target} is not writable; {fix}")


def _check_folder(path: Path, what: str, uri: str, fix: str) -> None:
    existing = next((p for p in (path, *path.parents) if p.exists()), None)
    if existing is not None and (not existing.is_dir() or not os.access(existing, os.W_OK)):
        raise BackendError(f"{what} {redact_url(uri)}: {existing} is not a writable folder; {fix}")


# --------------------------------------------------------------------------- databases


def check_database(url: str, *, what: str, setting: str, timeout_s: float = TIMEOUT_S,
                   fix: str | None = None) -> None:
    """Open (and close) one SQLAlchemy connection to ``url`` within ``timeout_s``; nothing is created.

    Args:
        what: the backend, for the message (``"Optuna storage"``).
        setting: where ``url`` comes from (``"tracking.optuna_storage in the YAML"``).
        fix: the advice at the end of the message (default: start the database or fix ``setting``).

    Raises:
        BackendError: a malformed URL, a missing driver, or the database does not answer or refuses it.
    """
    import sqlalchemy as sa
    from sqlalchemy.engine import make_url

    fix = fix or f"start the database or fix {setting}"
    try:
        parsed = make_url(url)
    except sa.exc.ArgumentError as e:
        raise BackendError(f"{what} {redact_url(url)!r} ({setting}) is not a database URL ({e}); "
                           f"fix {setting}") from None
    shown = redact_url(url)
    if parsed.drivername.startswith("sqlite"):
        _check_sqlite(url, what, fix)
        return
    connect_args = {}
    if parsed.get_backend_name() in ("postgresql", "mysql", "mariadb") and "connect_timeout" not in parsed.query:
        connect_args["connect_timeout"] = max(2, math.ceil(timeout_s))  # libpq's minimum is 2 s
    try:
        engine = sa.create_engine(parsed, connect_args=connect_args, poolclass=sa.pool.NullPool)
    except (ImportError, sa.exc.NoSuchModuleError, sa.exc.ArgumentError) as e:
        raise BackendError(f"{what} {shown} ({setting}): no database driver for {parsed.drivername} ({e}); "
                           f"install it (psycopg for postgresql://) or fix {setting}") from None
    try:
        with engine.connect():
            pass
    except Exception as e:  # sqlalchemy.exc.DBAPIError wrapping the driver's error, or the driver's own
        verb, reason = _db_why(e, timeout_s)
        if verb != "does not answer":
            low = reason.lower()
            if "role" in low and "does not exist" in low and parsed.username:  # PostgreSQL: the user is missing
                fix = f"create the role (CREATE ROLE {parsed.username} LOGIN) or fix the user in {setting}"
            elif "does not exist" in low and parsed.database:
                fix = f"create it (CREATE DATABASE {parsed.database}) or fix {setting}"
            else:
                fix = f"check the user, password and database in the URL, or fix {setting}"
        raise BackendError(f"{what} {shown} ({setting}) {verb} ({reason}); {fix}") from None
    finally:
        engine.dispose()


def _db_why(e: Exception, timeout_s: float) -> tuple[str, str]:
    """(``"does not answer"`` or ``"cannot be opened"``, the driver's reason in a few words)."""
    text = str(getattr(e, "orig", None) or e).strip()
    first = text.splitlines()[0] if text else type(e).__name__
    low = text.lower()
    if "connection refused" in low:
        return "does not answer", "connection refused"
    if "timeout expired" in low or "timed out" in low:
        return "does not answer", f"no answer within {timeout_s:g} s"
    if "could not translate host name" in low or "name or service not known" in low or "unknown host" in low:
        return "does not answer", "unknown host"
    return "cannot be opened", first.split("FATAL:")[-1].strip()


# --------------------------------------------------------------------------- Ray


def check_ray_address(address: str | None, *, timeout_s: float = TIMEOUT_S) -> None:
    """A TCP connection to a Ray cluster's address: ``ray://HOST[:PORT]`` (Ray Client, port 10001 by default)
    or ``HOST:PORT`` (the GCS, port 6379 by default). None (then ``$RAY_ADDRESS``, if set), ``auto``, ``local``
    and other ``scheme://`` addresses are not checked.

    Raises:
        BackendError: the address is malformed or nothing accepts the connection within ``timeout_s``.
    """
    setting = "--address"
    if address is None and os.environ.get("RAY_ADDRESS"):
        address, setting = os.environ["RAY_ADDRESS"], "the RAY_ADDRESS environment variable"
    if address in _LOCAL_RAY:
        return
    scheme, sep, rest = address.partition("://")
    if sep and scheme != "ray":
        return
    rest = rest if sep else address
    try:
        parts = urlsplit("//" + rest)
        host, port = parts.hostname, parts.port or (10001 if sep else 6379)
    except ValueError as e:
        raise BackendError(f"Ray address {address!r} ({setting}) is malformed ({e}); write ray://HOST:10001 "
                           f"or HOST:6379") from None
    if not host:
        raise BackendError(f"Ray address {address!r} ({setting}) names no host; write ray://HOST:10001 or HOST:6379")
    try:
        socket.create_connection((host, port), timeout=timeout_s).close()
    except OSError as e:
        raise BackendError(f"Ray cluster {address} does not answer at {host}:{port} ({_why(e, timeout_s)}); "
                           f"start it (ray start --head) or fix {setting}") from None


def _why(e: BaseException, timeout_s: float) -> str:
    """A connection failure in a few words: connection refused, no answer within N s, unknown host..."""
    reason = e.reason if isinstance(e, urllib.error.URLError) else e
    if isinstance(reason, ConnectionRefusedError):
        return "connection refused"
    if isinstance(reason, TimeoutError):
        return f"no answer within {timeout_s:g} s"
    if isinstance(reason, socket.gaierror):
        return "unknown host"
    if isinstance(reason, ssl.SSLError):
        return f"TLS error: {reason.reason or reason}"
    if isinstance(reason, OSError) and reason.strerror:
        return reason.strerror[0].lower() + reason.strerror[1:]
    return str(reason) or type(reason).__name__
