"""Shared fixtures: the real Multi30k files and tiny sweep specs built on a slice of them."""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
MULTI30K = REPO.parent / "shared" / "data" / "multi30k"


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


POSTGRES_ADMIN_URL = os.environ.get("NAS_TEST_POSTGRES_URL", "postgresql://postgres@127.0.0.1:5432/postgres")
"""Server the PostgreSQL tests create their databases on (trust auth on these machines)."""


def _postgres_unavailable(reason: str) -> None:
    """Skip with ``reason``, or fail when ``NAS_REQUIRE_POSTGRES=1`` (set by .ci/run)."""
    message = f"PostgreSQL not available at {POSTGRES_ADMIN_URL}: {reason}"
    if os.environ.get("NAS_REQUIRE_POSTGRES") == "1":
        pytest.fail(message + " (NAS_REQUIRE_POSTGRES=1: this must not be skipped)")
    pytest.skip(message + "; start PostgreSQL or set NAS_TEST_POSTGRES_URL")


@pytest.fixture
def postgres_url() -> Iterator[str]:
    """A fresh empty PostgreSQL database, as ``postgresql+psycopg://USER@HOST:PORT/nas_test_<hex>``; dropped afterwards.

    Skips with the reason when the server doesn't answer; fails instead when ``NAS_REQUIRE_POSTGRES=1``.
    """
    try:
        import psycopg
    except ImportError as e:
        _postgres_unavailable(f"psycopg is not installed ({e}); pip install 'psycopg[binary]'")
    from sqlalchemy.engine import make_url

    try:
        admin = psycopg.connect(POSTGRES_ADMIN_URL, autocommit=True, connect_timeout=3)
    except psycopg.OperationalError as e:
        _postgres_unavailable(str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__)
    name = f"nas_test_{uuid.uuid4().hex[:12]}"
    with admin:
        admin.execute(f'CREATE DATABASE "{name}"')
        url = make_url(POSTGRES_ADMIN_URL).set(drivername="postgresql+psycopg", database=name)
        try:
            yield url.render_as_string(hide_password=False)
        finally:
            admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
