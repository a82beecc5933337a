"""Replay a request stream against a topology and report serving metrics.

    python scripts/bench_serving.py --attention-ranks 2 --expert-ranks 1 --num-requests 500 \
        --rate 50 --prompt-len uniform:4:64 --output-len uniform:4:32

Requests arrive as a Poisson process at ``--rate`` per second (``inf``: all at once), with
prompt and output lengths drawn from distributions (``fixed:N``, ``uniform:LO:HI``,
``lognormal:MEAN:SIGMA``) or taken from a JSONL file (``--dataset``, lines as for
`splitmoe.launch`). At the end it checks that every request finished exactly once with its
expected number of tokens, and prints the metrics table (throughput, TTFT/TBT percentiles, KV
usage, batch sizes). The scaling study drives this script; ``--json FILE`` writes its figures.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import sys
import time
from pathlib import Path

from splitmoe import LLM, SamplingParams
from splitmoe.config import ModelConfig
from splitmoe.models.default_model import default_model_path


def parse_dist(spec: str):
    """``fixed:N`` | ``uniform:LO:HI`` | ``lognormal:MEAN:SIGMA`` -> a sampler of ints >= 1."""
    kind, *a = spec.split(":")
    if kind == "fixed" and len(a) == 1:
        n = int(a[0])
        return lambda rng: n
    if kind == "uniform" and len(a) == 2:
        lo, hi = int(a[0]), int(a[1])
        return lambda rng: rng.randint(lo, hi)
    if kind == "lognormal" and len(a) == 2:
        mean, sigma = float(a[0]), float(a[1])
        mu = math.log(mean) - sigma**2 / 2
        return lambda rng: max(1, round(rng.lognormvariate(mu, sigma)))
    raise SystemExit(f"bad length distribution {spec!r}: use fixed:N, uniform:LO:HI, lognormal:M:S")


def make_workload(args, vocab: int, max_len: int):
    rng = random.Random(args.seed)
    if args.dataset:
        items = []
        for line in Path(args.dataset).read_text().splitlines():
            if line.strip():
                d = json.loads(line)
                items.append((d["prompt_token_ids"], int(d.get("max_tokens", args.default_max))))
    else:
        plen, olen = parse_dist(args.prompt_len), parse_dist(args.output_len)
        items = []
        for _ in range(args.num_requests):
            p = min(plen(rng), max_len - 2)
            o = min(olen(rng), max_len - 1 - p)
            items.append(([rng.randrange(1, vocab) for _ in range(p)], o))
    t, arrivals = 0.0, []
    for _ in items:
        arrivals.append(t)
        if args.rate != math.inf:
            t += rng.expovariate(args.rate)
    return items, arrivals


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="checkpoint (default: the built-in model)")
    ap.add_argument("--attention-ranks", type=int, default=2)
    ap.add_argument("--expert-ranks", type=int, default=1)
    ap.add_argument("--transport", default="flat")
    ap.add_argument("--num-requests", type=int, default=200)
    ap.add_argument("--rate", type=float, default=math.inf, help="requests/s (inf: all at once)")
    ap.add_argument("--prompt-len", default="uniform:4:64")
    ap.add_argument("--output-len", default="uniform:4:32")
    ap.add_argument("--dataset", default=None, help="JSONL with prompt_token_ids [+ max_tokens]")
    ap.add_argument("--default-max", type=int, default=16)
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--max-num-seqs", type=int, default=64)
    ap.add_argument("--max-num-batched-tokens", type=int, default=512)
    ap.add_argument("--num-kv-blocks", type=int, default=None)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--threads-per-rank", type=int, default=None)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", default=None, help="write the metrics here as JSON")
    args = ap.parse_args()
    args.model = args.model or default_model_path()
    cfg = ModelConfig.from_hf(args.model)
    items, arrivals = make_workload(args, cfg.vocab_size, cfg.max_position_embeddings)

    with LLM(
        args.model,
        attention_ranks=args.attention_ranks,
        expert_ranks=args.expert_ranks,
        transport=args.transport,
        device="cpu",
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        num_kv_blocks=args.num_kv_blocks,
        block_size=args.block_size,
        threads_per_rank=args.threads_per_rank,
    ) as llm:
        llm.generate([[1, 2, 3]], SamplingParams(max_tokens=2))  # warm-up
        llm.reset_metrics()
        expected: dict[int, int] = {}
        finished: dict[int, int] = {}
        duplicates = 0
        start = time.perf_counter()
        nxt = 0
        while nxt < len(items) or len(finished) < len(items):
            now = time.perf_counter() - start
            batch = []
            while nxt < len(items) and arrivals[nxt] <= now:
                batch.append(items[nxt])
                nxt += 1
            if batch:
                params = [
                    SamplingParams(
                        max_tokens=o,
                        temperature=args.temperature,
                        ignore_eos=True,
                        seed=args.seed + i,
                    )
                    for i, (_, o) in enumerate(batch)
                ]
                for rid, (_, o) in zip(llm.submit([p for p, _ in batch], params), batch):
                    expected[rid] = o
            wait = 0.05 if nxt >= len(items) else max(0.0, arrivals[nxt] - now)
            for out, _ in llm.poll(timeout=min(wait, 0.05)):
                if out.finished:
                    duplicates += out.request_id in finished
                    finished[out.request_id] = len(out.token_ids)
        metrics = llm.metrics()
        wall = time.perf_counter() - start

    lost = sorted(set(expected) - set(finished))
    wrong = sorted(r for r in finished if finished[r] != expected.get(r))
    print(
        f"\n{len(items)} requests at rate {args.rate}/s on {args.attention_ranks} attention + "
        f"{args.expert_ranks} expert ranks ({args.transport}), model {cfg.model_type} "
        f"({cfg.num_layers} layers, {cfg.num_experts} experts), wall {wall:.1f} s"
    )
    print(metrics.table())
    print(f"lost: {len(lost)}  duplicated: {duplicates}  wrong length: {len(wrong)}")
    if args.json:
        Path(args.json).write_text(
            json.dumps(
                {**metrics.to_dict(), **vars(args), "lost": len(lost), "duplicates": duplicates}
            )
        )
    if lost or duplicates or wrong:
        sys.exit(f"FAILED: lost {lost[:10]}, wrong length {wrong[:10]}, duplicates {duplicates}")


if __name__ == "__main__":
    main()
