"""The PyTorch CPU kernels against their references, on the built-in models' shapes.

    python scripts/bench_cpu_kernels.py             # default and realistic presets, 1 and 2 threads
    python scripts/bench_cpu_kernels.py --smoke     # tiny sizes, a few seconds
    python scripts/bench_cpu_kernels.py --threads 2 --only moe
    python scripts/bench_cpu_kernels.py --fresh     # measure every kernel choice again
    python scripts/bench_cpu_kernels.py --dtypes bfloat16 --threads 2

Each thread count runs in each of ``--dtypes`` (default: float32, and bfloat16 where the CPU
multiplies it natively, `splitmoe.config.cpu_native_bf16`: what ``dtype="auto"`` runs there).

Routed experts: `fused_moe` (``"torch"``, on CPU `fused_moe_cpu`) against `fused_moe_ref`, and
each GEMM layout `fused_moe_cpu` chooses among (one oneDNN / MKL GEMM per expert, W-left grouped,
x-left grouped) forced, for a decode or prefill step of N tokens: ms per step through all of
the preset's layers, each layer its own weights, as in a model step (the realistic preset's
288 MB of experts stream from memory; the default model's stay in cache). Each shape class is
settled first, as a rank settles it before serving (`splitmoe.kernels.cpu_choice.settle` of
`fused_moe.moe_trials`, `linear.linear_trials`). Each row says which layout the shape got and
why: each layout's median per-layer time as the settle step measured it (``timed``), or as an
earlier process stored it in the cache file of kernel choices (``cache file``). Dense
projections: which of oneDNN / MKL `linear` chose for each of the preset's weights at each row
count, and the timings that decided it. Decode
attention: the torch path of `paged_attention` over a paged cache with scattered blocks against
dense SDPA on contiguous K/V (the same math without the paging gather), us per layer. Each
figure is the median of interleaved rounds, each round warmed up by an untimed call; memory is
kept for reuse as in a rank (`runtime.keep_freed_memory`).
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time

import torch
import torch.nn.functional as F

import splitmoe.kernels.fused_moe as fm
from splitmoe.config import cpu_native_bf16
from splitmoe.kernels.attention_metadata import AttentionMetadata
from splitmoe.kernels.cpu_choice import Decision, settle
from splitmoe.kernels.fused_moe import fused_moe, fused_moe_ref
from splitmoe.kernels.linear import linear, linear_decision, linear_trials
from splitmoe.kernels.paged_attention import decode_attention_trials, paged_attention
from splitmoe.models.default_model import PRESETS
from splitmoe.runtime import keep_freed_memory

PATHS = fm.CPU_MOE_PATHS


def timed(fns: dict, rounds: int) -> dict[str, float]:
    """Median seconds per call of each of ``fns``, rounds interleaved (on a shared machine the
    load drifts, and interleaving exposes every candidate to the same drift)."""
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            fn()  # the first call after other work wakes the threads up: untimed
            t = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t)
    return {name: statistics.median(ts) for name, ts in times.items()}


def moe_weights(cfg: dict, dtype: torch.dtype, seed: int = 0):
    """Each layer's ``(w13 [E, 2I, H], w2 [E, H, I])`` in ``dtype``."""
    g = torch.Generator().manual_seed(seed)
    E, H, I = cfg["num_experts"], cfg["hidden_size"], cfg["moe_intermediate_size"]
    return [
        (
            (torch.randn(E, 2 * I, H, generator=g) * H**-0.5).to(dtype),
            (torch.randn(E, H, I, generator=g) * I**-0.5).to(dtype),
        )
        for _ in range(cfg["num_hidden_layers"])
    ]


def why(decision: Decision | None) -> str:
    """``name (source: candidate ms, ...)``: a choice and the timings that decided it."""
    if decision is None:
        return "not settled (runs the default)"
    ms = ", ".join(f"{n} {t:.3f}" for n, t in sorted(decision.ms.items(), key=lambda i: i[1]))
    return f"{decision.choice} ({decision.source}: {ms} ms)"


def moe_row(name: str, cfg: dict, layers, N: int, rounds: int) -> str:
    E, H, k = cfg["num_experts"], cfg["hidden_size"], cfg["num_experts_per_tok"]
    g = torch.Generator().manual_seed(N)
    w13, w2 = layers[0]
    x = torch.randn(N, H, generator=g).to(w13.dtype)
    ids = torch.randn(N, E, generator=g).topk(k, dim=1).indices.to(torch.int32)
    w = torch.rand(N, k, generator=g).softmax(-1)
    err = (fused_moe(x, w13, w2, ids, w, "torch") - fused_moe_ref(x, w13, w2, ids, w)).abs().max()
    rows = N * k / len(ids.unique())
    settle(fm.moe_trials(layers, {}, [N * k], k, k, w13.dtype))  # (as a rank before serving)

    def step(fn):
        return lambda: [fn(x, w13, w2, ids, w) for w13, w2 in layers]

    fns = {"torch": step(lambda *a: fused_moe(*a, "torch")), "ref": step(fused_moe_ref)}
    fns.update({p: step(lambda *a, p=p: fm.fused_moe_cpu(*a, path=p)) for p in PATHS})
    t = timed(fns, rounds)  # ("torch": the layout the settle step kept)
    decision = fm.cpu_moe_decision(x, w13, ids)
    cells = "".join(f"{t[n] * 1e3:>11.2f}" for n in ("torch", "ref", *PATHS))
    speedup = t["ref"] / t["torch"]
    return f"{name:<10}{N:>6}{rows:>7.1f}{cells}{speedup:>8.2f}x{err:>9.1e}  {why(decision)}"


def bench_moe(args, dtype: torch.dtype) -> None:
    print("routed experts, ms per step (every layer, each its own weights)")
    print(
        f"{'preset':<10}{'tokens':>6}{'rows':>7}{'torch':>11}{'ref':>11}"
        + "".join(f"{p:>11}" for p in PATHS)
        + f"{'speedup':>9}{'max err':>9}  chosen layout (why: median ms per layer)"
    )
    tokens = [1, 32] if args.smoke else [1, 8, 32, 64, 128, 512, 2048]
    for name in args.presets:
        cfg = PRESETS[name]
        if args.smoke:
            cfg = {**cfg, "num_hidden_layers": 1}
        layers = moe_weights(cfg, dtype)
        for N in tokens:
            print(moe_row(name, cfg, layers, N, args.rounds if N <= 512 else 3))


def bench_linear(args, dtype: torch.dtype) -> None:
    print("\ndense projections (`linear`): oneDNN or MKL, as chosen, and why (ms per call)")
    print(f"{'preset':<10}{'weight':<8}{'[N, K]':>12}{'rows':>6}  chosen (why)")
    tokens = [1, 32] if args.smoke else [1, 8, 32, 128, 512]
    for name in args.presets:
        cfg = PRESETS[name]
        H, d = cfg["hidden_size"], cfg["head_dim"]
        nh, nkv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
        weights = {
            "qkv": ((nh + 2 * nkv) * d, H),
            "o_proj": (H, nh * d),
            "lm_head": (cfg["vocab_size"], H),
            "expert13": (2 * cfg["moe_intermediate_size"], H),
            "expert2": (H, cfg["moe_intermediate_size"]),
        }
        g = torch.Generator().manual_seed(0)
        for wname, shape in weights.items():
            w = torch.randn(*shape, generator=g).to(dtype)
            for T in tokens:
                x = torch.randn(T, shape[1], generator=g).to(dtype)
                settle(linear_trials([(w, None)], [T], dtype))  # (as a rank before serving)
                linear(x, w)
                decision = linear_decision(x, w)
                label = f"[{shape[0]}, {shape[1]}]"
                print(f"{name:<10}{wname:<8}{label:>12}{T:>6}  {why(decision)}")


def decode_case(cfg: dict, B: int, ctx: int, dtype: torch.dtype, block_size: int = 16):
    """A decode step of ``B`` sequences of ``ctx`` tokens over scattered cache blocks, each
    layer its own pool, in ``dtype``; and the same K/V contiguous per sequence."""
    nh, nkv, d = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
    g = torch.Generator().manual_seed(0)
    nblk = -(-ctx // block_size)
    tables = torch.randperm(B * nblk, generator=g).to(torch.int32).view(B, nblk)
    meta = AttentionMetadata(
        query_start_loc=torch.arange(B + 1, dtype=torch.int64),
        seq_lens=torch.full((B,), ctx, dtype=torch.int64),
        block_tables=tables.contiguous(),
        slot_mapping=torch.zeros(B, dtype=torch.int64),
        query_lens=[1] * B,
        seq_lens_list=[ctx] * B,
    )
    pools = [
        (
            torch.randn(B * nblk, block_size, nkv, d, generator=g).to(dtype),
            torch.randn(B * nblk, block_size, nkv, d, generator=g).to(dtype),
        )
        for _ in range(cfg["num_hidden_layers"])
    ]
    # the same K/V as [B, nkv, ctx, d] contiguous: what attention reads without the paging
    dense = [
        tuple(
            p[tables.long()]
            .view(B, nblk * block_size, nkv, d)[:, :ctx]
            .transpose(1, 2)
            .contiguous()
            for p in pool
        )
        for pool in pools
    ]
    return torch.randn(B, nh, d, generator=g).to(dtype), pools, dense, meta


def decode_row(name: str, cfg: dict, B: int, ctx: int, rounds: int, dtype: torch.dtype) -> str:
    q, pools, dense, meta = decode_case(cfg, B, ctx, dtype)
    nh, nkv, d = q.shape[1], pools[0][0].shape[2], q.shape[2]
    scale = d**-0.5

    def paged():
        meta.derived.clear()  # the plan is built once per step, as in a model step
        return [paged_attention(q, k, v, meta, scale, "torch") for k, v in pools]

    def contiguous():
        qg = q.view(-1, nkv, nh // nkv, d)  # a GQA group's heads as its query rows
        return [
            F.scaled_dot_product_attention(qg, k, v, scale=scale).view(-1, nh, d) for k, v in dense
        ]

    # (the class's kernel settled first, as a rank settles it before serving)
    block = pools[0][0].shape[1]
    settle(decode_attention_trials(nkv, nh // nkv, d, q.dtype, block, [B], [ctx], 64 << 20))
    err = (paged()[0] - contiguous()[0]).abs().max().item()
    t = timed({"paged": paged, "dense": contiguous}, rounds)
    n = len(pools)
    a, b = t["paged"] * 1e6 / n, t["dense"] * 1e6 / n
    return f"{name:<10}{B:>6}{ctx:>7}{a:>11.1f}{b:>11.1f}{a / b:>8.2f}x{err:>9.1e}"


def bench_decode(args, dtype: torch.dtype) -> None:
    print(
        "\ndecode attention, us per layer: paged (torch path) against dense SDPA on contiguous K/V"
    )
    print(
        f"{'preset':<10}{'batch':>6}{'ctx':>7}{'paged':>11}{'dense':>11}{'ratio':>9}{'max err':>9}"
    )
    batches = [1, 32] if args.smoke else [1, 8, 32, 128]
    contexts = [64, 300] if args.smoke else [64, 512, 2048]
    for name in args.presets:
        cfg = PRESETS[name]
        if args.smoke:
            cfg = {**cfg, "num_hidden_layers": 1}
        for B in batches:
            for ctx in contexts:
                if B * ctx <= 1 << 17:  # pools under ~0.5 GB per layer
                    print(decode_row(name, cfg, B, ctx, args.rounds, dtype))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--smoke", action="store_true", help="tiny sizes, one layer")
    ap.add_argument("--presets", default="default,realistic", help="comma-separated presets")
    ap.add_argument("--threads", default="1,2", help="comma-separated torch thread counts")
    ap.add_argument("--only", choices=("moe", "linear", "decode"), default=None)
    ap.add_argument(
        "--fresh",
        action="store_true",
        help="measure every kernel choice again (a throwaway cache file, not the machine's)",
    )
    ap.add_argument("--rounds", type=int, default=7, help="interleaved rounds per figure")
    ap.add_argument(
        "--dtypes",
        default=None,
        help="comma-separated: float32, bfloat16 (default: float32, and bfloat16 where the CPU "
        "has AMX / AVX512-BF16)",
    )
    args = ap.parse_args()
    names = args.dtypes.split(",") if args.dtypes else ["float32"]
    if not args.dtypes and cpu_native_bf16():
        names.append("bfloat16")
    dtypes = {"float32": torch.float32, "bfloat16": torch.bfloat16}
    if not set(names) <= set(dtypes):
        ap.error(f"--dtypes {args.dtypes!r}: use float32 and/or bfloat16")
    args.presets = args.presets.split(",")
    unknown = sorted(set(args.presets) - set(PRESETS))
    if unknown:
        ap.error(f"unknown presets {unknown}; use some of {sorted(PRESETS)}")
    if args.fresh:
        fresh = tempfile.TemporaryDirectory(prefix="splitmoe-bench-")  # removed at exit
        os.environ["SPLITMOE_CACHE_DIR"] = fresh.name
    keep_freed_memory()  # as a rank does: freed temporaries are reused, not faulted in again
    with torch.inference_mode():
        for threads in (int(t) for t in args.threads.split(",")):
            torch.set_num_threads(threads)
            for name in names:
                dtype = dtypes[name]
                print(f"\n=== {threads} thread{'s' if threads > 1 else ''}, {name} ===")
                if args.only in (None, "moe"):
                    bench_moe(args, dtype)
                if args.only in (None, "linear"):
                    bench_linear(args, dtype)
                if args.only in (None, "decode"):
                    bench_decode(args, dtype)


if __name__ == "__main__":
    main()
