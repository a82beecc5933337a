#!/usr/bin/env bash
# Installs splitmoe and what it needs into the current Python: run by demo.sh and test.sh.
# Usage: bash scripts/setup_env.sh [EXTRAS]   e.g. EXTRAS=test,mpi
set -euo pipefail
PY=${PYTHON:-python3}
export PIP_ROOT_USER_ACTION=ignore PIP_DISABLE_PIP_VERSION_CHECK=1
EXTRAS=${1:-}
cd "$(dirname "${BASH_SOURCE[0]}")/.."
if ! "$PY" -c "import torch" 2>/dev/null; then
  if command -v nvidia-smi >/dev/null 2>&1; then
    "$PY" -m pip install -q torch
  else
    # A CPU-only machine: this version resolves to a CPU build here (other versions pull CUDA).
    "$PY" -m pip install -q torch==2.13.0
  fi
fi
# Mooncake's transfer engine (the "pd" extra) links the system's libibverbs
if [[ ",$EXTRAS," == *",pd,"* ]] && ! ldconfig -p 2>/dev/null | grep -q libibverbs.so.1; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    apt-get install -y -qq libibverbs1 >/dev/null || { apt-get update -qq && apt-get install -y -qq libibverbs1 >/dev/null; }
  else
    echo "setup_env.sh: the pd extra needs the system library libibverbs1 (e.g. apt-get install libibverbs1)" >&2
  fi
fi
spec="."
[ -n "$EXTRAS" ] && spec=".[${EXTRAS}]"
"$PY" -m pip install -q -e "$spec"
