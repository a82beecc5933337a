#!/usr/bin/env bash
# The checks that need a GPU, as one call on a lent GPU machine (no network there: it uses the
# machine's python3 and packages, this checkout on PYTHONPATH): the kernel and end-to-end tests
# on CUDA, then the one-GPU figures of docs/comm.md (default model, then the realistic preset).
# Writes logs under $OUT (default out/).
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
export PYTHONPATH=$PWD
PY=${PYTHON:-python3}
OUT=${OUT:-out}
mkdir -p "$OUT"
nvidia-smi -L
"$PY" -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', \
triton.__version__, 'transformers', transformers.__version__)"
timeout 200 "$PY" -m pytest -q tests/kernels tests/test_e2e_triton.py >"$OUT/gpu_tests.log" 2>&1
echo "tests rc=$?"; tail -4 "$OUT/gpu_tests.log"
timeout 120 "$PY" scripts/bench_generate.py --device cuda --model default --expert-ranks 0,1 \
  --micro-batches auto,1,2 --batch 32 --max-tokens 32 --repeat 3 >"$OUT/gpu_default.log" 2>&1
echo "default rc=$?"; grep -v "^Loading" "$OUT/gpu_default.log" | tail -9
timeout 120 "$PY" scripts/bench_generate.py --device cuda --model realistic --expert-ranks 0,1 \
  --batch 64 --prompt-len 64 --max-tokens 64 --repeat 3 >"$OUT/gpu_realistic.log" 2>&1
echo "realistic rc=$?"; grep -v "^Loading" "$OUT/gpu_realistic.log" | tail -7
