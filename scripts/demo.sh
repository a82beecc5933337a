#!/usr/bin/env bash
# The main job: generation on the built-in default model, with 1 attention rank and 2 expert
# ranks in separate processes (torchrun). Installs what it needs first.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
PY=${PYTHON:-python3}
bash scripts/setup_env.sh
MODEL=${MODEL:-.splitmoe/default-model}
[ -f "$MODEL/config.json" ] || "$PY" -m splitmoe.models.default_model --out "$MODEL"
mkdir -p out
OMP_NUM_THREADS=1 "$PY" -m torch.distributed.run --standalone --nproc-per-node 3 \
  -m splitmoe.launch --model "$MODEL" --attention-ranks 1 \
  --prompts examples/prompts.jsonl --output out/demo.jsonl --max-tokens 24 "$@"
"$PY" - <<'PYEOF'
import json
for line in open("out/demo.jsonl"):
    r = json.loads(line)
    m = r["metrics"]
    print(f"[{r['finish_reason']:>6}] {len(r['token_ids']):3d} tokens  ttft {m['ttft']*1e3:6.1f} ms  "
          f"tpot {m['tpot']*1e3:5.1f} ms  text: {r['text']!r}")
PYEOF
