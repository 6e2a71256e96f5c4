#!/usr/bin/env bash
# Set up .venv and run the whole test suite (the slow end-to-end tests included).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
# Two pytest-xdist workers (NAS_TEST_WORKERS to change): a serial run keeps one of 2 cores busy on average. Each
# module runs whole on one worker, and the tests that share the PostgreSQL server on one (tests/conftest.py).
.venv/bin/python -m pytest -q --durations=20 -n "${NAS_TEST_WORKERS:-2}" --dist loadgroup
