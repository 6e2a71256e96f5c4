#!/usr/bin/env bash
# Create .venv and install nas with its dependencies (CPU torch first, so pip never pulls a CUDA build).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PYTHON" -m venv .venv
.venv/bin/python -m pip install -q "torch==2.13.0"
# The tests run against the versions the image pins (docker/requirements.txt), not whatever the
# registry holds today; pip constraints take no extras, so they are stripped first.
constraints=$(mktemp)
trap 'rm -f "$constraints"' EXIT
sed -e 's/\[[^]]*\]//' docker/requirements.txt > "$constraints"
.venv/bin/python -m pip install -q -c "$constraints" -e ".[test,serve,docs]"
