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
# ONLY=graphs runs the graphs section alone (the whole script may pass one call's 10 minutes)
if [ "${ONLY:-all}" != graphs ]; then
timeout 200 "$PY" -m pytest -q tests/kernels tests/test_e2e_triton.py >"$OUT/gpu_tests.log" 2>&1
echo "tests rc=$?"; tail -4 "$OUT/gpu_tests.log"
timeout 120 "$PY" scripts/bench_generate.py --device cuda --model default --expert-ranks 0,1 \
  --micro-batches auto,1,2 --batch 32 --max-tokens 32 --repeat 3 >"$OUT/gpu_default.log" 2>&1
echo "default rc=$?"; grep -v "^Loading" "$OUT/gpu_default.log" | tail -9
timeout 120 "$PY" scripts/bench_generate.py --device cuda --model realistic --expert-ranks 0,1 \
  --batch 64 --prompt-len 64 --max-tokens 64 --repeat 3 >"$OUT/gpu_realistic.log" 2>&1
echo "realistic rc=$?"; grep -v "^Loading" "$OUT/gpu_realistic.log" | tail -7
fi
# CUDA graphs and torch.compile of decode (enforce_eager=False; not yet checked on a GPU): the
# oracles with graphs on (tokens must match HF in float32 as eager does; a padded bucket may
# round differently: report any mismatch with its case), then graphs against eager on the
# realistic preset at batch 1, 8 and 64, colocated and 1+1, in one run each.
cat >"$OUT/gpu_graphs_oracle.py" <<'PYEOF'
import sys, tempfile
sys.path.insert(0, "tests")  # (run from the checkout's root)
from tiny_models import hf_greedy, make_tiny_checkpoint, prompt_ids
from splitmoe import LLM, SamplingParams
if __name__ == "__main__":
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    for fam in ("qwen3_moe", "deepseek_v3", "gpt_oss"):
        ckpt = make_tiny_checkpoint(fam, tempfile.mkdtemp())
        prompts = [prompt_ids(n, seed=i) for i, n in enumerate((1, 5, 17))]
        want = [hf_greedy(ckpt, p, 16) for p in prompts]
        for e in (0, 1):
            with LLM(str(ckpt), expert_ranks=e, dtype="float32", device="cuda",
                     enforce_eager=False, timeout_s=300) as llm:
                got = [list(o.token_ids) for o in llm.generate(prompts, params)]
            print(fam, f"1+{e}", "graphs match HF:", got == want, flush=True)
PYEOF
# (a file, not stdin: the ranks are spawned, and each imports the main script again)
timeout 240 "$PY" "$OUT/gpu_graphs_oracle.py" >"$OUT/gpu_graphs_oracle.log" 2>&1
echo "graphs oracle rc=$?"; grep -E "match|Error|warn" "$OUT/gpu_graphs_oracle.log" | tail -8
for b in 1 8 64; do
  timeout 150 "$PY" scripts/bench_generate.py --device cuda --model realistic --expert-ranks 0,1 \
    --micro-batches 1 --batch $b --prompt-len 64 --max-tokens 64 --enforce-eager true,false \
    --skip-hf >"$OUT/gpu_graphs_b$b.log" 2>&1
  echo "graphs b=$b rc=$?"; grep -v "^Loading" "$OUT/gpu_graphs_b$b.log" | tail -7
done
