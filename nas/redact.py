"""Secrets out of what is printed and logged: a URL with its passwords masked (standard library only).

Every message, log line, MLflow param or status line that shows a backend address (the MLflow tracking URI,
the Optuna storage, a database URL) passes it through :func:`redact_url` first: ``$MLFLOW_TRACKING_URI=
postgresql://user:PASSWORD@host/db`` must never reach a terminal, a CI log or a report.

Named ``redact`` and not ``secrets``, which would shadow the standard library's module for a script run
from inside ``nas/``. Imports nothing from ``nas``: every layer may use it.
"""

from __future__ import annotations

__all__ = ["REDACTED", "SECRET_QUERY_KEYS", "redact_url"]

REDACTED = "***"
"""What a masked secret is shown as."""
SECRET_QUERY_KEYS = ("password", "passwd", "pwd", "secret", "token")
"""A query parameter whose name contains one of these (any case) is a secret: ``password=``, ``sslpassword=``,
``access_token=``, ``client_secret=``..."""


def _redact_query(query: str) -> str:
    """``a=1&password=x`` -> ``a=1&password=***`` (see :data:`SECRET_QUERY_KEYS`)."""
    parts = []
    for part in query.split("&"):
        key, eq, _ = part.partition("=")
        secret = eq and any(word in key.lower() for word in SECRET_QUERY_KEYS)
        parts.append(f"{key}={REDACTED}" if secret else part)
    return "&".join(parts)


def redact_url(url: str) -> str:
    """``url`` as it may be shown: the password in its user info (``user:PASSWORD@``) and the value of every
    secret query parameter (``?password=``, ``pwd=``, ``secret=``, ``token=``..., :data:`SECRET_QUERY_KEYS`)
    replaced by ``***``; the rest unchanged, so a path or a URL without secrets is returned as it is.

    ``postgresql://nas:pw@db:5432/optuna?sslmode=require&password=pw`` ->
    ``postgresql://nas:***@db:5432/optuna?sslmode=require&password=***``. The user info ends at the URL's
    last ``@``, so a password holding an unencoded ``@``, ``/`` or ``?`` stays hidden (an ``@`` in the query
    hides more than the password: too much rather than too little). Masking twice gives the same string.
    """
    scheme, sep, rest = url.partition("://")
    if not sep:  # a path, or a URL without an authority
        scheme, rest = "", url
    creds, at, address = rest.rpartition("@") if sep else ("", "", rest)
    user, colon, _ = creds.partition(":")
    shown = scheme + sep + (f"{user}:{REDACTED}@" if colon and "/" not in user else creds + at)
    address, q, query = address.partition("?")
    query, hash_, fragment = query.partition("#")
    return shown + address + (q + _redact_query(query) + hash_ + fragment if q else "")
