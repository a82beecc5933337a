#!/usr/bin/env bash
# The checks that need a GPU, as one call on a lent GPU machine (no network there: it uses the
# machine's python3 and packages, this checkout on PYTHONPATH): the kernel and end-to-end tests
# on CUDA, the one-GPU figures of docs/comm.md (default model, then the realistic preset), CUDA
# graphs (oracles, then against eager) and the simulator's kernel fragment. Writes logs under
# $OUT (default out/).
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
export PYTHONPATH=$PWD
PY=${PYTHON:-python3}
OUT=${OUT:-out}
mkdir -p "$OUT"
nvidia-smi -L
"$PY" -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', \
triton.__version__, 'transformers', transformers.__version__)"
# ONLY=a,b runs some sections: tests, figures (the first two), graphs, fragment (one call of
# the whole script may pass one call's 10 minutes)
want() { [ "${ONLY:-all}" = all ] || [[ ",$ONLY," == *",$1,"* ]]; }
if want tests; then
timeout 200 "$PY" -m pytest -q tests/kernels tests/test_e2e_triton.py >"$OUT/gpu_tests.log" 2>&1
echo "tests rc=$?"; tail -4 "$OUT/gpu_tests.log"
fi
if want figures; then
timeout 120 "$PY" scripts/bench_generate.py --device cuda --model default --expert-ranks 0,1 \
  --micro-batches auto,1,2 --batch 32 --max-tokens 32 --repeat 3 >"$OUT/gpu_default.log" 2>&1
echo "default rc=$?"; grep -v "^Loading" "$OUT/gpu_default.log" | tail -9
timeout 120 "$PY" scripts/bench_generate.py --device cuda --model realistic --expert-ranks 0,1 \
  --batch 64 --prompt-len 64 --max-tokens 64 --repeat 3 >"$OUT/gpu_realistic.log" 2>&1
echo "realistic rc=$?"; grep -v "^Loading" "$OUT/gpu_realistic.log" | tail -7
fi
# CUDA graphs and torch.compile of decode (enforce_eager=False): the experts' graphs against
# their eager kernels, and the HF oracles with graphs on (tests/test_e2e_graphs.py: tokens must
# match as eager's do, attention and expert graphs must have replayed); then (graphs_bench)
# graphs against eager on the realistic preset at batch 1, 8 and 64, colocated and 1+1, one
# engine per configuration (scripts/bench_graphs.py).
if want graphs; then
timeout 240 "$PY" -m pytest -q -n 4 tests/expert_nodes/test_expert_graphs.py \
  tests/test_e2e_graphs.py >"$OUT/gpu_graphs_tests.log" 2>&1
echo "graphs tests rc=$?"; grep -E "passed|failed|Error|assert" "$OUT/gpu_graphs_tests.log" | tail -8
fi
if want graphs_bench; then
timeout 300 "$PY" scripts/bench_graphs.py --model realistic --device cuda --expert-ranks 0,1 \
  --batches 1,8,64 --prompt-len 64 --max-tokens 64 --repeat 3 --json "$OUT/gpu_graphs.json" \
  >"$OUT/gpu_graphs.log" 2>&1
echo "graphs bench rc=$?"; grep -v "^Loading" "$OUT/gpu_graphs.log" | tail -12
fi
# The simulator's measured GPU constants (issue 41): paged-decode HBM bytes/s, grouped-GEMM
# FLOP/s by token count, launch overhead; `plan.py --profile FILE` takes the fragment.
if want fragment; then
timeout 110 "$PY" scripts/bench_kernels.py --only decode,moe \
  --profile-fragment "$OUT/kernels_fragment.json" >"$OUT/gpu_kernels.log" 2>&1
echo "fragment rc=$?"; tail -3 "$OUT/gpu_kernels.log"; cat "$OUT/kernels_fragment.json"
fi
