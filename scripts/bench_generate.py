"""Decode throughput, TTFT and TPOT of splitmoe next to HF transformers, in one run.

    python scripts/bench_generate.py --model CKPT --attention-ranks 1 --expert-ranks 1 --batch 8

Both engines get the same random prompts (equal lengths, so HF needs no padding), greedy decoding
and the same number of new tokens; the figures are printed side by side, and the script reports
whether the generated tokens agree. Without --model the built-in default model is written to
.splitmoe/default-model and used.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch

from splitmoe import LLM, SamplingParams
from splitmoe.config import ModelConfig
from splitmoe.models.default_model import default_model_path


def make_prompts(vocab: int, batch: int, length: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(1, vocab, (batch, length), generator=g).tolist()


def bench_splitmoe(args, prompts, micro_batches=None):
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
    t0 = time.perf_counter()
    with LLM(
        args.model,
        attention_ranks=args.attention_ranks,
        expert_ranks=args.expert_ranks,
        micro_batches=micro_batches,
        transport=args.transport,
        dtype=args.dtype,
        device=args.device,
        threads_per_rank=args.threads_per_rank,
        max_num_seqs=max(64, args.batch),
        shared_memory=not args.no_shared_memory,
    ) as llm:
        startup = time.perf_counter() - t0
        llm.generate(prompts[:2], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
        t = time.perf_counter()
        outs = llm.generate(prompts, params)
        wall = time.perf_counter() - t
        metrics = llm.metrics()
    ttft = [o.metrics.ttft for o in outs]
    decode_time = max(o.metrics.e2e_latency for o in outs) - max(ttft)
    n = sum(len(o.token_ids) for o in outs)
    return dict(
        tokens=[o.token_ids for o in outs],
        startup_s=startup,
        wall_s=wall,
        ttft_ms=1e3 * statistics.mean(ttft),
        tpot_ms=1e3 * statistics.mean(o.metrics.tpot for o in outs),
        decode_tok_s=len(outs) * (args.max_tokens - 1) / decode_time,
        output_tok_s=n / wall,
        metrics=metrics,
    )


def median_run(runs: list[dict]) -> dict:
    """The run with the median decode throughput (the upper median of an even count)."""
    return sorted(runs, key=lambda r: r["decode_tok_s"])[len(runs) // 2]


def bench_hf(args, prompts):
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(args.hf_threads)
    dtype = {
        "auto": torch.float32,
        "float32": torch.float32,
        "bfloat16": torch.bfloat16,
        "float16": torch.float16,
    }[args.dtype]
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=dtype)
    model.eval()
    # No EOS: every row runs to n tokens, like splitmoe's ignore_eos (min_new_tokens would
    # instead mask EOS out of the logits and change the greedy tokens).
    model.generation_config.eos_token_id = None
    x = torch.tensor(prompts)
    kw = dict(do_sample=False, eos_token_id=None, pad_token_id=0)

    def run(n):
        t = time.perf_counter()
        with torch.inference_mode():
            out = model.generate(x, max_new_tokens=n, **kw)
        assert out.shape[1] == x.shape[1] + n, "HF stopped early"
        return time.perf_counter() - t, out

    run(2)  # warm-up
    ttft, _ = run(1)
    wall, out = run(args.max_tokens)
    decode = wall - ttft
    return dict(
        tokens=out[:, x.shape[1] :].tolist(),
        wall_s=wall,
        ttft_ms=1e3 * ttft,
        tpot_ms=1e3 * decode / (args.max_tokens - 1),
        decode_tok_s=len(prompts) * (args.max_tokens - 1) / decode,
        output_tok_s=len(prompts) * args.max_tokens / wall,
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--attention-ranks", type=int, default=1)
    ap.add_argument("--expert-ranks", type=int, default=1)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--threads-per-rank", type=int, default=None)
    ap.add_argument("--hf-threads", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--skip-hf", action="store_true")
    ap.add_argument("--transport", default="flat")
    ap.add_argument(
        "--no-shared-memory",
        action="store_true",
        help="exchange through torch.distributed (gloo) even between ranks on this host",
    )
    ap.add_argument(
        "--micro-batches",
        default="auto",
        help="comma-separated counts to compare in one run, e.g. 1,2 (auto: chosen per step)",
    )
    ap.add_argument(
        "--repeat",
        type=int,
        default=1,
        help="runs per configuration, interleaved; each is reported by its median run",
    )
    ap.add_argument("--metrics", action="store_true", help="print each run's serving metrics")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    if args.max_tokens < 2:
        ap.error("--max-tokens must be >= 2 to measure decoding")
    args.model = args.model or default_model_path()
    cfg = ModelConfig.from_hf(args.model)
    prompts = make_prompts(cfg.vocab_size, args.batch, args.prompt_len, args.seed)
    topo = f"{args.attention_ranks}+{args.expert_ranks}"
    counts = (
        [None] if args.micro_batches == "auto" else [int(m) for m in args.micro_batches.split(",")]
    )
    if args.repeat < 1 or len(set(counts)) != len(counts):
        ap.error("--repeat must be >= 1 and --micro-batches must not repeat a count")
    # Each configuration runs --repeat times, interleaved (m=1, m=2, m=1, m=2, ...), and is
    # reported by its median run: on a shared machine the load drifts, and interleaving exposes
    # every configuration to the same drift.
    runs: dict = {m: [] for m in counts}
    for _ in range(args.repeat):
        for m in counts:
            runs[m].append(bench_splitmoe(args, prompts, m))
    rows = [
        (f"splitmoe {topo}" + ("" if m is None else f" m={m}"), median_run(runs[m])) for m in counts
    ]
    if args.repeat > 1:
        for m in counts:
            each = ", ".join(f"{r['decode_tok_s']:.0f}" for r in runs[m])
            print(f"decode tok/s of each run, m={m or 'auto'}: {each}")
    if not args.skip_hf:
        rows.insert(0, ("HF transformers", bench_hf(args, prompts)))
    print(
        f"\nmodel {args.model} ({cfg.model_type}, {cfg.num_layers} layers, {cfg.num_experts} "
        f"experts, top-{cfg.top_k}), batch {args.batch}, prompt {args.prompt_len}, "
        f"{args.max_tokens} new tokens, {args.dtype}, {os.cpu_count()} CPU cores"
    )
    print(
        f"{'engine':<18}{'decode tok/s':>14}{'output tok/s':>14}{'TTFT ms':>10}"
        f"{'TPOT ms':>10}{'wall s':>9}"
    )
    for name, r in rows:
        print(
            f"{name:<18}{r['decode_tok_s']:>14.1f}{r['output_tok_s']:>14.1f}"
            f"{r['ttft_ms']:>10.1f}{r['tpot_ms']:>10.2f}{r['wall_s']:>9.2f}"
        )
    base = rows[0][1]
    for name, r in rows[1:]:
        ratio = r["decode_tok_s"] / base["decode_tok_s"]
        same = r["tokens"] == base["tokens"]
        print(f"decode throughput {name} / {rows[0][0]}: {ratio:.2f}x; tokens identical: {same}")
    if args.metrics:
        for name, r in rows:
            if "metrics" in r:
                print(f"\n{name}\n{r['metrics'].table()}")


if __name__ == "__main__":
    main()
