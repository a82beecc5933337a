"""Soak test: thousands of requests with random lengths, sampling settings and arrival times,
under KV-cache pressure, then end-of-run checks.

    python scripts/soak.py --requests 2000 --attention-ranks 2 --expert-ranks 2

Checks at the end (exit status 1 if any fails):
* every request finished exactly once, with ``max_tokens`` tokens when it ended by length, or
  ending in one of its stop tokens (or EOS) when it ended by stop;
* every KV block is free again on every attention rank, nothing running or waiting;
* no rank's resident memory grew by more than ``--max-growth-mb`` after warm-up;
* each request's streamed tokens add up to its final output (none repeated or missing).

With ``--kill RANK`` the job runs fault-tolerant and that rank (as numbered at start-up: the
attention ranks first) is SIGKILLed once ``--kill-at`` requests have finished; the same checks
must hold across it, and the recovery is printed (issue 42):

    python scripts/soak.py --requests 2000 --kill 1                          # an attention rank
    python scripts/soak.py --requests 2000 --kill 3 --redundant-experts 16   # an expert rank
"""

from __future__ import annotations

import argparse
import os
import random
import signal
import sys
import time

from splitmoe import LLM, SamplingParams
from splitmoe.models.config import ModelConfig
from splitmoe.models.default_model import default_model_path


def random_params(rng: random.Random, vocab: int, max_out: int) -> SamplingParams:
    kind = rng.random()
    stop = tuple(rng.sample(range(vocab), 3)) if rng.random() < 0.3 else ()
    common = dict(
        max_tokens=rng.randint(1, max_out), stop_token_ids=stop, ignore_eos=rng.random() < 0.5
    )
    if kind < 0.4:
        return SamplingParams(temperature=0.0, **common)
    return SamplingParams(
        temperature=rng.uniform(0.3, 1.5),
        top_k=rng.choice([-1, 1, 5, 50]),
        top_p=rng.choice([1.0, 0.9, 0.5]),
        seed=rng.choice([None, rng.randrange(1 << 30)]),
        **common,
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="checkpoint (default: the built-in model)")
    ap.add_argument("--requests", type=int, default=2000)
    ap.add_argument("--attention-ranks", type=int, default=2)
    ap.add_argument("--expert-ranks", type=int, default=2)
    ap.add_argument("--max-prompt", type=int, default=96)
    ap.add_argument("--max-output", type=int, default=24)
    ap.add_argument("--rate", type=float, default=400.0, help="mean arrivals per second")
    ap.add_argument("--num-kv-blocks", type=int, default=48, help="small: forces preemption")
    ap.add_argument("--block-size", type=int, default=8)
    ap.add_argument("--max-num-seqs", type=int, default=32)
    ap.add_argument("--max-growth-mb", type=float, default=64.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--kill", type=int, default=None, help="SIGKILL this rank during the run")
    ap.add_argument("--kill-at", type=int, default=None, help="finished requests before (1/3)")
    ap.add_argument("--redundant-experts", type=int, default=0)
    args = ap.parse_args()
    kill_at = args.requests // 3 if args.kill_at is None else args.kill_at
    args.model = args.model or default_model_path()
    cfg = ModelConfig.from_hf(args.model)
    eos = set(cfg.eos_token_ids)
    rng = random.Random(args.seed)
    slots = args.num_kv_blocks * args.block_size
    work = []
    for _ in range(args.requests):
        p = rng.randint(1, min(args.max_prompt, slots - args.max_output))
        work.append(
            (
                [rng.randrange(cfg.vocab_size) for _ in range(p)],
                random_params(rng, cfg.vocab_size, args.max_output),
            )
        )

    failures: list[str] = []
    start = time.perf_counter()
    with LLM(
        args.model,
        attention_ranks=args.attention_ranks,
        expert_ranks=args.expert_ranks,
        device="cpu",
        num_kv_blocks=args.num_kv_blocks,
        block_size=args.block_size,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=256,
        fault_tolerance=args.kill is not None,
        redundant_experts=args.redundant_experts,
    ) as llm:
        llm.generate([p for p, _ in work[:8]], [s for _, s in work[:8]])  # warm-up
        before = {s["rank"]: s["rss_mb"] for s in llm.stats()}
        llm.reset_metrics()
        params: dict[int, SamplingParams] = {}
        finished: dict[int, list[int]] = {}
        reasons: dict[int, str] = {}
        streams: dict[int, list[int]] = {}
        duplicates = 0
        killed_at = None
        nxt, t_next = 0, time.perf_counter()
        while nxt < len(work) or len(finished) < len(work):
            while nxt < len(work) and time.perf_counter() >= t_next:
                burst = rng.randint(1, 8)  # bursty arrivals
                chunk = work[nxt : nxt + burst]
                rids = llm.submit([p for p, _ in chunk], [s for _, s in chunk])
                params.update(zip(rids, (s for _, s in chunk)))
                nxt += len(chunk)
                t_next += rng.expovariate(args.rate / 4.5)
            for out, new in llm.poll(timeout=0.02):
                streams.setdefault(out.request_id, []).extend(new)
                if out.finished:
                    duplicates += out.request_id in finished
                    finished[out.request_id] = out.token_ids
                    reasons[out.request_id] = out.finish_reason
            if args.kill is not None and killed_at is None and len(finished) >= kill_at:
                os.kill(llm.rank_pids[args.kill], signal.SIGKILL)
                killed_at = time.perf_counter()
                print(f"killed rank {args.kill} after {len(finished)} finished requests")
        metrics = llm.metrics()
        recoveries = llm.recoveries
        stats = llm.stats()
    duration = time.perf_counter() - start

    lost = sorted(set(params) - set(finished))
    if lost:
        failures.append(f"{len(lost)} requests never finished, e.g. {lost[:5]}")
    if duplicates:
        failures.append(f"{duplicates} requests finished twice")
    torn = [rid for rid, toks in finished.items() if streams.get(rid, []) != toks]
    if torn:
        failures.append(f"{len(torn)} streams differ from their outputs, e.g. {torn[:5]}")
    if args.kill is not None and [r["lost"] for r in recoveries] != [[args.kill]]:
        failures.append(f"recoveries {recoveries} are not one of rank {args.kill}")
    for rid, toks in finished.items():
        sp = params[rid]
        if reasons[rid] == "length" and len(toks) != sp.max_tokens:
            failures.append(f"request {rid}: length finish with {len(toks)}/{sp.max_tokens} tokens")
        if reasons[rid] == "stop":
            ends = set(sp.stop_token_ids) | (set() if sp.ignore_eos else eos)
            if not toks or toks[-1] not in ends or len(toks) > sp.max_tokens:
                failures.append(f"request {rid}: stop finish but ends with {toks[-1:]}")
    for s in stats:
        if s["role"] == "attention" and (s["kv_blocks_used"] or s["running"] or s["waiting"]):
            failures.append(
                f"rank {s['rank']}: {s['kv_blocks_used']} KV blocks still used, "
                f"{s['running']} running, {s['waiting']} waiting"
            )
        growth = s["rss_mb"] - before[s["rank"]]
        if growth > args.max_growth_mb:
            failures.append(f"rank {s['rank']} ({s['role']}) memory grew {growth:.0f} MB")

    print(
        f"\nsoak: {len(work)} requests on {args.attention_ranks} attention + "
        f"{args.expert_ranks} expert ranks in {duration:.1f} s"
    )
    print(metrics.table())
    print("rank  role       rss MB (start -> end)  peak MB")
    for s in stats:
        print(
            f"{s['rank']:>4}  {s['role']:<9}  {before[s['rank']]:8.0f} -> {s['rss_mb']:6.0f}"
            f"  {s['peak_rss_mb']:10.0f}"
        )
    for r in recoveries:
        print(
            f"recovery: lost rank(s) {r['lost']}, members {r['members']}, rebuilt in "
            f"{r['seconds']:.2f} s, {r['weights_read']} expert weights read again"
        )
    stops = sum(r == "stop" for r in reasons.values())
    print(f"finish reasons: {len(finished) - stops} length, {stops} stop")
    if failures:
        print("FAILED:\n  " + "\n  ".join(failures[:20]))
        sys.exit(1)
    print("all end checks passed")


if __name__ == "__main__":
    main()
