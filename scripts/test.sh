#!/usr/bin/env bash
# Installs the test dependencies and runs the test suite (CPU; 12-22 minutes on 2 cores).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
PY=${PYTHON:-python3}
bash scripts/setup_env.sh test,mpi,pd
"$PY" -m ruff check splitmoe scripts tests
exec "$PY" -m pytest -q tests "$@"
