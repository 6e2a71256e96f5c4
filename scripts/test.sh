#!/usr/bin/env bash
# Set up .venv and run the whole test suite (the slow end-to-end tests included).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
.venv/bin/python -m pytest -q --durations=20
