"""Chrome trace of engine steps across all ranks, and where each rank's time goes.

    python scripts/trace_step.py --model realistic --attention-ranks 1 --expert-ranks 1 \
        --micro-batches 2 --batch 32 --out out/trace.json

Runs a decode-heavy batch, takes the timelines of every rank (`LLM.trace`), and writes a
Chrome-trace / Perfetto JSON (open it in chrome://tracing or ui.perfetto.dev) of ``--steps``
decode steps: one process per rank, one row per kind of work (compute, comm, wait). Prints, per
rank, the share of those steps spent computing, communicating and waiting.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from splitmoe import LLM, SamplingParams
from splitmoe.config import ModelConfig
from splitmoe.models.default_model import resolve_model
from splitmoe.timeline import breakdown, chrome_trace


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--model", default=None, help="checkpoint directory, or a preset: default, realistic"
    )
    ap.add_argument("--attention-ranks", type=int, default=1)
    ap.add_argument("--expert-ranks", type=int, default=1)
    ap.add_argument("--micro-batches", type=int, default=2)
    ap.add_argument("--transport", default="flat")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=24)
    ap.add_argument("--steps", type=int, default=3, help="decode steps in the trace (the last)")
    ap.add_argument("--threads-per-rank", type=int, default=None)
    ap.add_argument("--out", default="out/trace.json")
    args = ap.parse_args()
    args.model = resolve_model(args.model)
    cfg = ModelConfig.from_hf(args.model)
    prompts = torch.randint(
        1, cfg.vocab_size, (args.batch, 16), generator=torch.Generator().manual_seed(0)
    ).tolist()
    with LLM(
        args.model,
        attention_ranks=args.attention_ranks,
        expert_ranks=args.expert_ranks,
        micro_batches=args.micro_batches,
        transport=args.transport,
        device="cpu",
        threads_per_rank=args.threads_per_rank,
        max_num_seqs=max(64, args.batch),  # the whole batch decodes together
    ) as llm:
        llm.generate(
            prompts, SamplingParams(max_tokens=args.max_tokens, temperature=0, ignore_eos=True)
        )
        traces = llm.trace()
    # Every request decodes until max_tokens (ignore_eos), so the steps before the last are full
    # decode steps; prompts are prefilled in the first steps, which a window from the middle of
    # the run could still catch (a prefill step costs several decode steps).
    last = min(max(s.step for s in t["timeline"]) for t in traces)
    chosen = set(range(max(1, last - args.steps), last))
    spans = {t["rank"]: [s for s in t["timeline"] if s.step in chosen] for t in traces}
    roles = {t["rank"]: t["role"] for t in traces}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(chrome_trace(spans, roles)))
    print(
        f"{args.attention_ranks}+{args.expert_ranks}, m={args.micro_batches}, batch "
        f"{args.batch}: steps {sorted(chosen)} -> {out}"
    )
    print(f"{'rank':<16}{'wall ms':>9}{'compute':>9}{'comm':>8}{'wait':>8}{'other':>8}")
    for rank, ss in spans.items():
        b = breakdown(ss)
        w = b["wall"] or 1.0
        print(
            f"{rank:>2} {roles[rank]:<13}{b['wall'] * 1e3 / len(chosen):>9.2f}"
            + "".join(f"{b[k] / w:>8.0%}" for k in ("compute", "comm", "wait", "other"))
        )


if __name__ == "__main__":
    main()
