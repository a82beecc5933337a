"""A:E planner: the best disaggregated deployments of a model on a GPU budget under a TPOT target.

    python scripts/plan.py --model qwen3-235b-a22b --hardware h100 --gpus 64 --tpot-slo 50ms
    python scripts/plan.py --model path/to/config.json --hardware h200 --gpus 32 --tpot-slo 30ms \\
        --context 8192 --skew 0.5

``--model``: a ``config.json`` (any supported family, or DeepSeek-V2/V3), a checkpoint
directory, or a shipped config name (``qwen3-235b-a22b``, ``deepseek-v3``). ``--hardware``:
``h100``, ``h200``, ``cpu`` or a profile JSON. Prints the best plans (attention:expert ranks,
micro-batches, transport, balancer, replicas, batch per attention rank) with their predicted
TPOT, throughput per GPU and per-layer times, beside the best colocated deployment (experts
sharded over the same GPUs, attention data-parallel). Per-layer columns are milliseconds per
MoE layer for a whole step (all micro-batches); ``ovlp`` is the share of the serial time hidden
by the ping-pong overlap.
"""

from __future__ import annotations

import argparse
import sys
import time

from splitmoe.sim.hardware import load_profile
from splitmoe.sim.model import ModelShape
from splitmoe.sim.planner import SearchSpace, search, table
from splitmoe.sim.simulator import Simulator


def seconds(text: str) -> float:
    """``50ms``, ``0.05s``, ``0.05`` -> seconds."""
    t = text.strip().lower()
    if t.endswith("ms"):
        return float(t[:-2]) / 1e3
    if t.endswith("s"):
        return float(t[:-1])
    return float(t)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--hardware", default="h100")
    ap.add_argument("--gpus", type=int, required=True)
    ap.add_argument("--tpot-slo", type=seconds, required=True, help="e.g. 50ms")
    ap.add_argument("--context", type=float, default=4096, help="mean KV tokens per sequence")
    ap.add_argument("--skew", type=float, default=0.3, help="routing skew (Zipf exponent)")
    ap.add_argument("--top", type=int, default=8, help="plans to print")
    ap.add_argument("--quick", action="store_true", help="a smaller search space")
    args = ap.parse_args(argv)
    model = ModelShape.from_config(args.model)
    hw = load_profile(args.hardware)
    sim = Simulator(model, hw, skew=args.skew)
    space = SearchSpace()
    if args.quick:
        space = SearchSpace(
            attention_ranks=(2, 4, 8, 16, 32),
            expert_ranks=(2, 4, 8, 16),
            micro_batches=(1, 2, 3),
            transports=("flat", "auto"),
            balancers=(("static", 0), ("global", 1)),
            colocated_sizes=(8, 16, 32, 64),
        )
    t0 = time.time()
    disagg, colocated = search(sim, args.gpus, args.tpot_slo, args.context, space)
    print(model.describe())
    print(
        f"{hw.name}: {hw.description}\n{args.gpus} GPUs, TPOT <= {args.tpot_slo * 1e3:.0f} ms, "
        f"mean context {args.context:.0f} tokens, routing skew {args.skew} "
        f"({len(disagg) + len(colocated)} feasible plans in {time.time() - t0:.1f} s)\n"
    )
    if not disagg and not colocated:
        print("no deployment meets the TPOT target within memory: relax --tpot-slo or add GPUs")
        return 1
    print(table(disagg, "disaggregated (A:E per instance)", args.top))
    print()
    print(table(colocated, "colocated baseline (EP over instance)", 3))
    if disagg and colocated:
        gain = disagg[0].per_gpu / colocated[0].per_gpu
        print(f"\nbest disaggregated / best colocated throughput per GPU: {gain:.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
