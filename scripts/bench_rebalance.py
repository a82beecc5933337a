"""The stall of a live rebalance: per-step times around the steps where the placement changes.

A steady decode batch runs while the expert placement is recomputed, either once by
``llm.rebalance()`` (``--mode call``) or every ``--interval`` steps (``--mode interval``). Expert
ranks read the new slots' weights in the background while serving the old placement, and all
ranks then switch one changed layer per step boundary (`splitmoe.eplb.rebalance`).
The script prints attention rank 0's step times (ms, from its step records) around each
rebalance: the step after the plan (the load all-reduce and planning), the steps while the
weights are read, and each switch step, with each one's ratio to the median of its
neighbouring plain steps (the issue's bound: a switch step at most 1.2x), and how long the
background read took (what a rebalance that read the weights between two steps would stall).

    python scripts/bench_rebalance.py --model realistic --mode call
    python scripts/bench_rebalance.py --model realistic --mode interval --interval 40
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from splitmoe import LLM, SamplingParams
from splitmoe.models.config import ModelConfig
from splitmoe.models.default_model import resolve_model


def step_times(llm: LLM) -> list[tuple[float, float]]:
    """(end time, duration ms) of attention rank 0's consecutive steps."""
    ends = [r.time for r in llm.step_records if r.rank == 0]
    return [(b, 1e3 * (b - a)) for a, b in zip(ends, ends[1:])]


def step_of(steps: list[tuple[float, float]], t: float) -> int | None:
    """Index of the step during or right after which the boundary at time ``t`` fell."""
    return next((i for i, (end, _) in enumerate(steps) if end > t), None)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--model", default="realistic", help="checkpoint dir or preset")
    ap.add_argument("--mode", choices=("call", "interval"), default="call")
    ap.add_argument("--interval", type=int, default=40, help="rebalance_interval (steps)")
    ap.add_argument("--attention-ranks", type=int, default=1)
    ap.add_argument("--expert-ranks", type=int, default=2)
    ap.add_argument("--redundant", type=int, default=8, help="redundant_experts")
    ap.add_argument("--balancer", default="global", choices=("static", "local", "global"))
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--prompt-len", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=160)
    ap.add_argument("--warm-steps", type=int, default=40, help="steps before llm.rebalance()")
    ap.add_argument("--neighbours", type=int, default=5, help="plain steps each side")
    args = ap.parse_args()
    model = resolve_model(args.model)
    vocab = ModelConfig.from_hf(model).vocab_size
    g = torch.Generator().manual_seed(0)
    prompts = torch.randint(1, vocab, (args.batch, args.prompt_len), generator=g).tolist()
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
    with LLM(
        model,
        attention_ranks=args.attention_ranks,
        expert_ranks=args.expert_ranks,
        redundant_experts=args.redundant,
        balancer=args.balancer,
        rebalance_interval=args.interval if args.mode == "interval" else None,
        device="cpu",
    ) as llm:
        llm.generate(prompts[:2], SamplingParams(max_tokens=4))  # warm-up
        llm.reset_metrics()
        rids = set(llm.submit(prompts, params))
        done: set[int] = set()
        asked = False
        while done != rids:
            for out, _ in llm.poll(timeout=0.05):
                if out.finished:
                    done.add(out.request_id)
            if args.mode == "call" and not asked and len(step_times(llm)) >= args.warm_steps:
                t0 = time.perf_counter()
                llm.rebalance()
                print(f"llm.rebalance() returned after {1e3 * (time.perf_counter() - t0):.1f} ms")
                asked = True
        steps = step_times(llm)
        stats = llm.stats()
    events = [e for s in stats if s["rank"] == 0 for e in s["balancer"]["rebalance_events"]]
    read = [
        e["read_s"] for s in stats if s["role"] == "expert"
        for e in s["balancer"]["rebalance_events"] if "read_s" in e
    ]  # fmt: skip
    switch_ms: dict[int, float] = {}  # the slowest rank's switch work at each boundary
    for s in stats:
        for e in s["balancer"]["rebalance_events"]:
            if "switch_s" in e or "plan_s" in e:
                i = step_of(steps, e["time"])
                took = 1e3 * e.get("switch_s", e.get("plan_s"))
                switch_ms[i] = max(switch_ms.get(i, 0.0), took)
    marks: dict[int, str] = {}
    for e in events:
        i = step_of(steps, e["time"])
        if i is not None:
            marks[i] = (marks.get(i, "") + " " + e["event"]).strip()
    print(
        f"{args.model}: {args.attention_ranks} attention + {args.expert_ranks} expert ranks, "
        f"{args.balancer}, R={args.redundant}, batch {args.batch}; {len(steps)} steps, "
        f"median {statistics.median(d for _, d in steps):.1f} ms"
    )
    if read:
        per_rank = ", ".join(f"{1e3 * r:.0f}" for r in read)
        print(f"background weight read per expert rank: {per_rank} ms")
    print(f"{'step':>5} {'ms':>7} {'x nbrs':>7}  event")
    worst = {}
    shown = sorted({j for i in marks for j in range(max(0, i - 3), min(len(steps), i + 4))})
    for j in shown:
        ms, tag = steps[j][1], marks.get(j, "")
        if not tag:
            print(f"{j:>5} {ms:>7.1f}")
            continue
        ratio = ms / neighbours(steps, marks, j, args.neighbours)
        kind = "switch" if "switch" in tag else "plan" if "plan" in tag else "other"
        worst[kind] = max(worst.get(kind, 0.0), ratio)
        work = f" ({switch_ms[j]:.1f} ms at the boundary)" if j in switch_ms else ""
        print(f"{j:>5} {ms:>7.1f} {ratio:>7.2f}  {tag}{work}")
    summary = ", ".join(f"{k} {v:.2f}x" for k, v in worst.items())
    print(f"worst step against its neighbours: {summary} (bound for the switch: 1.20x)")


def neighbours(steps, marks, i: int, n: int) -> float:
    """Median duration of the ``n`` nearest steps on each side of step ``i`` with no event."""
    before = [steps[j][1] for j in range(i - 1, -1, -1) if j not in marks][:n]
    after = [steps[j][1] for j in range(i + 1, len(steps)) if j not in marks][:n]
    return statistics.median(before + after)


if __name__ == "__main__":
    main()
