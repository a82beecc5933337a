#!/usr/bin/env bash
# Installs the test dependencies and runs the test suite (CPU): the tests that do not time
# anything in parallel on the machine's cores (pytest-xdist), then the timing-sensitive ones
# alone (tests/conftest.py, SERIAL_MODULES).
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
PY=${PYTHON:-python3}
bash scripts/setup_env.sh test,mpi,pd || exit 1
"$PY" -m ruff check splitmoe scripts tests || exit 1
workers=$("$PY" -c "import os; print(max(1, min(4, len(os.sched_getaffinity(0)))))")
"$PY" -m pytest -q -n "$workers" --dist loadfile -m "not serial" --durations=15 tests "$@"
parallel=$?
"$PY" -m pytest -q -m serial --durations=15 tests "$@"
serial=$?
[ "$parallel" -eq 0 ] && [ "$serial" -eq 0 ]
