"""Decode with CUDA graphs against eager, at several batch sizes, one engine per configuration.

    python scripts/bench_graphs.py --model realistic --device cuda --expert-ranks 0,1 \
        --batches 1,8,64 --prompt-len 64 --max-tokens 64 --repeat 3

For each expert-rank count, an eager engine (``enforce_eager=True``) and a graphed one
(``enforce_eager=False``: the compiled per-layer pieces, and decode steps replayed from the
captured bucket at or above the batch) are started once, with ``max_num_seqs`` the largest
batch; each is warmed up at every batch, then measured ``--repeat`` rounds, every batch in each
round, and reported by its median run (`bench_generate.measure_splitmoe`: decode tokens/s from
the requests' own timings). Two ranks share the device (``--expert-ranks 1`` on one GPU:
exchanging through host memory), with one micro-batch. The table gives both rates, their ratio,
whether the greedy tokens agree, the decode steps replayed from graphs, the expert calls (one per
MoE layer and micro-batch) replayed from the experts' graphs, and the start-up time
(which includes compiling and capturing). Without CUDA the graphed engine compiles its pieces
and captures nothing (on CPU ``enforce_eager=False`` compiles only).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
from bench_generate import make_prompts, measure_splitmoe, median_run

from splitmoe import LLM, SamplingParams
from splitmoe.models.config import ModelConfig
from splitmoe.models.default_model import resolve_model


def bench(args, experts: int, eager: bool, prompts: dict, warmups: dict) -> dict:
    """One engine: start-up time, then per batch its median run and the graph steps it took."""
    t0 = time.perf_counter()
    with LLM(
        args.model,
        expert_ranks=experts,
        micro_batches=1,
        dtype=args.dtype,
        device=args.device,
        max_num_seqs=max(prompts),
        enforce_eager=eager,
        timeout_s=900.0,
    ) as llm:
        startup = time.perf_counter() - t0
        for b in prompts:
            llm.generate(warmups[b], SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True))
        runs: dict[int, list] = {b: [] for b in prompts}
        steps: dict[int, tuple[int, int]] = {}
        for _ in range(args.repeat):
            for b in prompts:
                before = _graph_steps(llm.stats())
                runs[b].append(measure_splitmoe(llm, args, prompts[b]))
                steps[b] = tuple(n - m for n, m in zip(_graph_steps(llm.stats()), before))
        all_stats = llm.stats()
        stats = all_stats[0]
    expert_sizes = all_stats[1]["cuda_graph_sizes"] if experts else stats["expert_cuda_graph_sizes"]
    out = {"startup_s": startup, "sizes": stats["cuda_graph_sizes"], "batches": {}}
    out["expert_sizes"] = expert_sizes
    out["compile_errors"] = stats["compile_errors"]
    for b, rs in runs.items():
        med = median_run(rs)
        out["batches"][b] = dict(
            decode_tok_s=med["decode_tok_s"],
            tpot_ms=med["tpot_ms"],
            spread=(min(r["decode_tok_s"] for r in rs), max(r["decode_tok_s"] for r in rs)),
            graph_steps=steps[b][0],
            expert_graph_calls=steps[b][1],
            tokens=med["tokens"],
        )
    return out


def _graph_steps(stats: list[dict]) -> tuple[int, int]:
    """Decode steps the attention rank replayed from graphs, and expert calls (layer,
    micro-batch) replayed on the expert rank (or colocated, by the attention rank)."""
    attn = stats[0]
    experts = stats[1]["cuda_graph_steps"] if len(stats) > 1 else attn["expert_cuda_graph_steps"]
    return attn["cuda_graph_steps"], experts


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="realistic", help="a checkpoint or preset")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--expert-ranks", default="0,1", help="comma-separated, e.g. 0,1")
    ap.add_argument("--batches", default="1,8,64", help="comma-separated batch sizes")
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--json", type=Path, default=None, help="also write the results here")
    args = ap.parse_args()
    if args.max_tokens < 2 or args.repeat < 1:
        ap.error("--max-tokens must be >= 2 and --repeat >= 1")
    try:
        batches = [int(b) for b in args.batches.split(",")]
        experts = [int(e) for e in args.expert_ranks.split(",")]
    except ValueError:
        ap.error("--batches and --expert-ranks take comma-separated integers")
    if min(batches) < 1 or min(experts) < 0:
        ap.error("--batches must be >= 1 and --expert-ranks >= 0")
    args.model = resolve_model(args.model)
    vocab = ModelConfig.from_hf(args.model).vocab_size
    prompts = {b: make_prompts(vocab, b, args.prompt_len, seed=b) for b in batches}
    warmups = {b: make_prompts(vocab, b, args.prompt_len, seed=1000 + b) for b in batches}
    print(
        f"device {torch.cuda.get_device_name() if args.device == 'cuda' else args.device}, "
        f"torch {torch.__version__}, dtype {args.dtype}, {args.prompt_len}+{args.max_tokens} "
        f"tokens, median of {args.repeat}",
        flush=True,
    )
    results = {}
    for e in experts:
        for eager in (True, False):
            r = bench(args, e, eager, prompts, warmups)
            results[f"1+{e} {'eager' if eager else 'graphs'}"] = r
            print(
                f"1+{e} {'eager' if eager else 'graphs'}: start-up {r['startup_s']:.1f} s, "
                f"buckets {r['sizes'] or 'none'}, expert buckets {r['expert_sizes'] or 'none'}, "
                f"compile errors {r['compile_errors'] or 'none'}",
                flush=True,
            )
    print("topology  batch  eager tok/s  graphs tok/s  ratio  TPOT eager/graphs ms  "
          "tokens agree  graph steps  expert calls replayed")  # fmt: skip
    for e in experts:
        ea, gr = results[f"1+{e} eager"]["batches"], results[f"1+{e} graphs"]["batches"]
        for b in batches:
            x, y = ea[b], gr[b]
            agree = statistics.mean(
                float(p == q) for p, q in zip(x["tokens"], y["tokens"])
            )  # fmt: skip
            print(
                f"1+{e:<7} {b:>5}  {x['decode_tok_s']:>11.0f}  {y['decode_tok_s']:>12.0f}  "
                f"{y['decode_tok_s'] / x['decode_tok_s']:>5.2f}  "
                f"{x['tpot_ms']:>9.2f} / {y['tpot_ms']:<9.2f}  {agree:>11.0%}  "
                f"{y['graph_steps']:>11}  {y['expert_graph_calls']:>21}"
            )
    if args.json:
        for r in results.values():
            for v in r["batches"].values():
                del v["tokens"]
        args.json.write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
