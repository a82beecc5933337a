"""Where each rank's time goes in a decode step, for several micro-batch counts side by side.

    python scripts/trace_step.py --model realistic --batch 64 --topologies 1+1,1+2,2+1 \
        --micro-batches 1,2,auto

For each topology (``A+E``; ``A+0`` runs colocated, where ``auto`` runs one micro-batch) and
micro-batch count (an integer or ``auto``, `splitmoe.scheduler.micro_batches`), runs a
decode-heavy batch (every request decodes ``--max-tokens`` tokens), takes the timelines of every
rank (`LLM.trace`) and averages the last ``--steps`` full decode steps: the step time, per rank
the compute / comm / wait per step and, on expert ranks, the expert compute per micro-batch (one
layer's GEMMs for one micro-batch), and for ``auto`` the counts it ran. ``speed``: the best fixed
count's step time over this one's, in the same run (1.00 is as fast as the best fixed count).
Writes a Chrome-trace / Perfetto JSON per run under ``--out`` (open it in chrome://tracing or
ui.perfetto.dev).

An attention-heavy workload (where two micro-batches should pay): ``--prompt-len 1024 --batch
16``. Timings need a quiet machine: other processes on the cores show up as wait.
"""

from __future__ import annotations

import argparse
import json
import time
from collections import Counter
from pathlib import Path

import torch

from splitmoe import LLM, SamplingParams
from splitmoe.models.config import ModelConfig
from splitmoe.models.default_model import resolve_model
from splitmoe.timeline import KINDS, breakdown, chrome_trace


def parse_topology(text: str) -> tuple[int, int]:
    a, sep, e = text.partition("+")
    if not sep or not a.isdigit() or not e.isdigit() or int(a) < 1:
        raise argparse.ArgumentTypeError(f"topology {text!r}: write A+E, e.g. 1+1 or 2+0")
    return int(a), int(e)


def parse_count(text: str) -> int | str:
    if text == "auto":
        return text
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"micro-batch count {text!r}: an integer >= 1 or auto")
    return int(text)


def run(args, prompts, topology: tuple[int, int], m: int | str) -> dict:
    """One job: its ranks' spans over the last ``args.steps`` full decode steps, and the wall
    time of the whole generate call."""
    a, e = topology
    with LLM(
        args.model,
        attention_ranks=a,
        expert_ranks=e,
        micro_batches=m,
        transport=args.transport,
        device="cpu",
        dtype=args.dtype,
        threads_per_rank=args.threads_per_rank,
        max_num_seqs=max(64, args.batch),  # the whole batch decodes together
    ) as llm:
        params = SamplingParams(max_tokens=args.max_tokens, temperature=0, ignore_eos=True)
        start = time.perf_counter()
        llm.generate(prompts, params)
        seconds = time.perf_counter() - start
        traces = llm.trace()
    # Every request decodes until max_tokens (ignore_eos), so the steps before the last are full
    # decode steps; prompts are prefilled in the first steps (a prefill step costs several
    # decode steps), which the window must not reach.
    last = min(max(s.step for s in t["timeline"]) for t in traces)
    chosen = set(range(max(1, last - args.steps), last))
    spans = {t["rank"]: [s for s in t["timeline"] if s.step in chosen] for t in traces}
    roles = {t["rank"]: t["role"] for t in traces}
    return {"spans": spans, "roles": roles, "steps": len(chosen), "seconds": seconds}


def summarize(result: dict) -> dict:
    """Per-step figures of one run (milliseconds)."""
    steps, spans, roles = result["steps"], result["spans"], result["roles"]
    ranks = {}
    for rank, ss in spans.items():
        b = breakdown(ss)
        row = {k: b[k] * 1e3 / steps for k in (*KINDS, "other", "wall")}
        served = [s for s in ss if s.kind == "compute" and s.name.startswith("experts L")]
        if served:
            row["per_micro_batch"] = sum(s.end - s.start for s in served) * 1e3 / len(served)
        ranks[rank] = row
    attention = [r for r in spans if roles[r] == "attention"]
    used: Counter = Counter()
    for s in spans[attention[0]]:
        if s.name.startswith("forward m="):
            used[int(s.name.removeprefix("forward m="))] += 1
    return {
        "step_ms": max(ranks[r]["wall"] for r in attention),
        "ranks": ranks,
        "used": dict(sorted(used.items())),
    }


def _used(used: dict[int, int]) -> str:
    return " ".join(f"{m}x{n}" for m, n in used.items()) or "-"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--model", default=None, help="checkpoint directory, or a preset: default, realistic"
    )
    ap.add_argument(
        "--topologies",
        type=lambda s: [parse_topology(t) for t in s.split(",")],
        default=[(1, 1)],
        help="comma-separated A+E (attention + expert ranks; A+0: colocated), default 1+1",
    )
    ap.add_argument(
        "--micro-batches",
        type=lambda s: [parse_count(c) for c in s.split(",")],
        default=[1, 2, "auto"],
        help="comma-separated counts, integers or auto (default 1,2,auto)",
    )
    ap.add_argument("--transport", default="flat")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--prompt-len", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=40)
    ap.add_argument("--steps", type=int, default=16, help="decode steps averaged (the last)")
    ap.add_argument("--threads-per-rank", type=int, default=None)
    ap.add_argument("--dtype", default="auto", help="auto (bfloat16 where the CPU multiplies it "
                    "natively), float32 (what the scaling study runs and the simulator's CPU "
                    "profile models), bfloat16")  # fmt: skip
    ap.add_argument("--out", default="out/trace", help="directory for the Chrome traces")
    args = ap.parse_args()
    args.model = resolve_model(args.model)
    cfg = ModelConfig.from_hf(args.model)
    prompts = torch.randint(
        1,
        cfg.vocab_size,
        (args.batch, args.prompt_len),
        generator=torch.Generator().manual_seed(0),
    ).tolist()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    print(
        f"batch {args.batch}, prompts of {args.prompt_len}, the last {args.steps} of "
        f"{args.max_tokens} decode steps; times per step (ms)"
    )
    print(
        f"{'topology':<9}{'m':>5}{'step':>8}{'speed':>7}{'tok/s':>8}  {'counts run':<12}"
        f"{'rank':>5} {'role':<10}{'compute':>8}{'comm':>7}{'wait':>7}{'other':>7}{'exp/mb':>8}"
    )
    for topology in args.topologies:
        counts = args.micro_batches
        name = f"{topology[0]}+{topology[1]}"
        rows = {}
        for m in counts:
            result = run(args, prompts, topology, m)
            path = out / f"trace-{name}-m{m}.json"
            path.write_text(json.dumps(chrome_trace(result["spans"], result["roles"])))
            rows[m] = (summarize(result), result)
        fixed = [rows[m][0]["step_ms"] for m in counts if m != "auto"]
        best = min(fixed) if fixed else None
        for m in counts:
            s, result = rows[m]
            speed = f"{best / s['step_ms']:.2f}" if best else "-"
            tok_s = args.batch * args.max_tokens / result["seconds"]
            head = (
                f"{name:<9}{m!s:>5}{s['step_ms']:>8.2f}{speed:>7}{tok_s:>8.0f}  "
                f"{_used(s['used']):<12}"
            )
            for i, (rank, r) in enumerate(sorted(s["ranks"].items())):
                per_mb = f"{r['per_micro_batch']:.2f}" if "per_micro_batch" in r else "-"
                print(
                    (head if i == 0 else " " * len(head))
                    + f"{rank:>5} {result['roles'][rank]:<10}"
                    + "".join(f"{r[k]:>{w}.2f}" for k, w in zip((*KINDS, "other"), (8, 7, 7, 7)))
                    + f"{per_mb:>8}"
                )
    print(f"traces: {out}/trace-*.json")


if __name__ == "__main__":
    main()
