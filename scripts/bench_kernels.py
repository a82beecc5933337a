"""Kernel micro-benchmarks: paged decode and prefill attention, multi-head latent attention (MLA)
decode and prefill, fused MoE; Triton next to the
PyTorch references, PyTorch's own scaled_dot_product_attention (FlashAttention) on dense K/V,
and torch._grouped_mm, in one run, as one table.

    python scripts/bench_kernels.py                  # GPU: realistic layer shapes (bf16)
    python scripts/bench_kernels.py --only decode    # decode | prefill | mla_decode |
                                                     # mla_prefill | moe, comma-separated
    python scripts/bench_kernels.py --smoke          # tiny shapes; on CPU through Triton's
                                                     # interpreter (checks, not speed)
    python scripts/bench_kernels.py --compile-only   # no GPU needed: compile every Triton
                                                     # kernel of the GPU run for sm_90 and report
                                                     # registers, spills and shared memory
    python scripts/bench_kernels.py --only decode,moe --profile-fragment h100-kernels.json
                                                     # GPU: the simulator's measured constants

Decode attention and small-batch MoE are memory-bound: read GB/s is the figure of merit (bytes
that must move: the K/V of every context; the weights of every expert used plus activations).
Prefill and large-batch MoE are compute-bound: TFLOP/s of the matmuls (causal pairs only).
Times are per call, from ``triton.testing.do_bench`` (L2 flushed between calls) on CUDA, two
ways: ``ms`` launches the call eagerly, as a Python loop would, so at small shapes it is the
host's launch cost (tens of microseconds per operation on a slow host CPU); ``graph ms`` replays
a CUDA graph of the same call, which is the GPU's own time and what a graph-captured step pays.
GB/s and TFLOP/s come from ``graph ms`` where the call could be captured (the torch references
synchronise with the host and cannot).

``--profile-fragment FILE`` (CUDA only; without a GPU it says so, writes nothing and exits 0)
also writes what the simulator's GPU profiles take as measured (`profile_fragment`): the best
HBM bytes/s of the Triton paged-decode kernel, the best grouped-GEMM FLOP/s of the MoE kernels
per token count (the largest count's is the GEMM figure), and the host's launch overhead per
eager operation. `splitmoe.sim.calibrate.apply_kernel_fragment` puts it over a profile.
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import io
import os
import re
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

# Attention layer shapes (num_heads, num_kv_heads, head_dim); DeepSeek-V3's MLA is MLA_MODELS.
ATTENTION_MODELS = {
    "qwen3-30b-a3b": (32, 4, 128),
    "qwen3-235b-a22b": (64, 4, 128),
}
# MLA layer shapes (num_heads, kv_lora_rank, qk_rope_head_dim): one attention rank holds every
# head (attention data-parallel), the latent cache kv_lora_rank + qk_rope_head_dim per token.
MLA_MODELS = {"deepseek-v3": (128, 512, 64)}
# MoE layer shapes (num_experts, hidden, moe_intermediate, top_k).
MOE_MODELS = {
    "qwen3-30b-a3b": (128, 2048, 768, 8),
    "deepseek-v3": (256, 7168, 2048, 8),
}
DECODE_BATCHES = (1, 8, 64, 256)
DECODE_CONTEXTS = (1024, 8192, 32768)
# (new tokens per sequence, cached tokens per sequence, sequences)
PREFILL_CASES = ((512, 0, 1), (2048, 0, 1), (8192, 0, 1), (2048, 6144, 1), (1024, 0, 8))
MOE_TOKENS = (1, 8, 64, 256, 1024, 4096, 8192)
BLOCK_SIZE = 16
H100_SMS = 132  # --compile-only plans the launches of an H100 run
REF_MAX_BYTES = 6 << 30  # the references gather K/V or loop over experts: skip beyond this

SMOKE_ATTENTION = {"tiny": (8, 2, 64)}
SMOKE_MOE = {"tiny": (8, 64, 32, 2)}
SMOKE_MLA = {"tiny": (20, 64, 16)}
KERNELS = ("decode", "prefill", "mla_decode", "mla_prefill", "moe")


@dataclass
class Row:
    kernel: str
    model: str
    shape: str
    impl: str
    ms: float | None
    graph_ms: float | None = None
    gbps: float | None = None
    tflops: float | None = None
    err: float | None = None  # max |output - reference| (float32 reference)
    note: str = ""


def bench(fn, device: torch.device, smoke: bool) -> float:
    """Milliseconds per call, launched eagerly."""
    if device.type == "cuda":
        import triton.testing

        return triton.testing.do_bench(fn, warmup=10, rep=50)
    fn()
    t = time.perf_counter()
    reps = 1 if smoke else 3
    for _ in range(reps):
        fn()
    return (time.perf_counter() - t) * 1e3 / reps


def capture(fn) -> torch.cuda.CUDAGraph | None:
    """A CUDA graph of ``fn``, warmed up first (None where ``fn`` cannot be captured: it
    synchronises with the host)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up off the capture stream, as torch.cuda.graph asks
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.graph(graph):
            fn()
    except RuntimeError:
        return None
    return graph


def bench_graph(fn) -> float | None:
    """Milliseconds per replay of a CUDA graph of ``fn`` (None where it cannot be captured)."""
    import triton.testing

    graph = capture(fn)
    return None if graph is None else triton.testing.do_bench(graph.replay, warmup=10, rep=50)


def paged_batch(seqs, nh, nkv, d, dtype, device, seed=0):
    """Queries and a paged cache (scattered blocks) for sequences ``(new, cached)``."""
    from splitmoe.kernels.attention_metadata import AttentionMetadata

    g = torch.Generator(device=device).manual_seed(seed)
    lens = [n + c for n, c in seqs]
    nblk = [-(-n // BLOCK_SIZE) for n in lens]
    total = sum(nblk)
    k_cache = torch.randn(total, BLOCK_SIZE, nkv, d, generator=g, device=device, dtype=dtype)
    v_cache = torch.randn(total, BLOCK_SIZE, nkv, d, generator=g, device=device, dtype=dtype)
    perm = torch.randperm(total, generator=g, device=device).to(torch.int32)
    width = max(nblk)
    tables = torch.zeros(len(seqs), width, dtype=torch.int32, device=device)
    start = 0
    for i, n in enumerate(nblk):
        tables[i, :n] = perm[start : start + n]
        start += n
    qlens = [n for n, _ in seqs]
    q = torch.randn(sum(qlens), nh, d, generator=g, device=device, dtype=dtype)
    loc = [0]
    for n in qlens:
        loc.append(loc[-1] + n)
    meta = AttentionMetadata(
        query_start_loc=torch.tensor(loc, device=device),
        seq_lens=torch.tensor(lens, device=device),
        block_tables=tables,
        slot_mapping=torch.zeros(sum(qlens), dtype=torch.int64, device=device),
        query_lens=qlens,
        seq_lens_list=lens,
    )
    return q, k_cache, v_cache, meta


def dense_kv(k_cache, meta, seq):
    """Sequence ``seq``'s K (or V) as a contiguous ``[1, nkv, ctx, d]`` tensor for SDPA."""
    ctx = meta.seq_lens_list[seq]
    table = meta.block_tables[seq, : -(-ctx // BLOCK_SIZE)].long()
    return k_cache[table].flatten(0, 1)[:ctx].transpose(0, 1)[None].contiguous()


def timed(
    rows: list[Row], row: Row, fn, device, smoke, moved=None, flops=None, ref=None, view=None
) -> None:
    """Times ``fn`` into ``row`` (GB/s from ``moved`` bytes, TFLOP/s from ``flops``) and
    compares its output, reshaped by ``view``, with ``ref``. The torch references are not
    graph-captured: they synchronise with the host."""
    try:
        if ref is not None:
            out = fn() if view is None else view(fn())
            row.err = (out.float() - ref).abs().max().item()
        row.ms = bench(fn, device, smoke)
        if device.type == "cuda" and row.impl != "torch-ref":
            row.graph_ms = bench_graph(fn)
    except RuntimeError as e:  # an SDPA backend or grouped_mm this build/GPU lacks
        row.note = "unavailable: " + str(e).splitlines()[0][:60]
    else:
        ms = row.ms if row.graph_ms is None else row.graph_ms
        row.gbps = None if moved is None else moved / ms / 1e6
        row.tflops = None if flops is None else flops / ms / 1e9
    rows.append(row)


def sdpa_impls(device):
    """PyTorch's SDPA as it dispatches, and pinned to its FlashAttention backend."""
    impls = [("sdpa", contextlib.nullcontext)]
    if device.type == "cuda":
        from torch.nn.attention import SDPBackend, sdpa_kernel

        impls.append(("sdpa-flash", lambda: sdpa_kernel(SDPBackend.FLASH_ATTENTION)))
    return impls


def run_sdpa(rows, make_row, device, smoke, q, k, v, mask, ref, moved=None, flops=None):
    """SDPA on ``q [B, nh, n, d]``; its output goes back to the packed ``[B * n, nh, d]``."""
    B, nh, n, d = q.shape
    for name, backend in sdpa_impls(device):

        def fn(backend=backend):
            with backend():
                return F.scaled_dot_product_attention(
                    q, k, v, attn_mask=mask, is_causal=mask is None and q.shape[2] > 1,
                    scale=q.shape[-1] ** -0.5, enable_gqa=True,
                )  # fmt: skip

        view = lambda o: o.transpose(1, 2).reshape(B * n, nh, d)  # noqa: E731
        timed(rows, make_row(name, "dense K/V"), fn, device, smoke, moved, flops, ref, view)


def decode_case(model, shape, B, ctx, dtype, device, smoke) -> list[Row]:
    from splitmoe.kernels.paged_attention import paged_attention, paged_attention_ref

    nh, nkv, d = shape
    rows: list[Row] = []
    q, kc, vc, meta = paged_batch([(1, ctx - 1)] * B, nh, nkv, d, dtype, device)
    elem = q.element_size()
    moved = 2 * B * ctx * nkv * d * elem + 2 * q.numel() * elem  # K, V, q, out

    def make_row(impl, note=""):
        return Row("decode", model, f"B={B} ctx={ctx}", impl, None, note=note)

    scale = d**-0.5
    ref = None
    if moved <= REF_MAX_BYTES:
        ref = paged_attention_ref(q.float(), kc.float(), vc.float(), meta, scale)
    fn = lambda: paged_attention(q, kc, vc, meta, scale, "triton")  # noqa: E731
    timed(rows, make_row("triton"), fn, device, smoke, moved, ref=ref)
    if ref is not None:
        fn = lambda: paged_attention_ref(q, kc, vc, meta, scale)  # noqa: E731
        timed(rows, make_row("torch-ref"), fn, device, smoke, moved, ref=ref)
    # SDPA on contiguous K/V (every sequence one length): the dense-layout yardstick.
    k = torch.cat([dense_kv(kc, meta, i) for i in range(B)])  # [B, nkv, ctx, d]
    v = torch.cat([dense_kv(vc, meta, i) for i in range(B)])
    run_sdpa(rows, make_row, device, smoke, q.view(B, nh, 1, d), k, v, None, ref, moved=moved)
    return rows


def prefill_case(model, shape, n, cached, B, dtype, device, smoke) -> list[Row]:
    from splitmoe.kernels.paged_attention import paged_attention, paged_attention_ref

    nh, nkv, d = shape
    rows: list[Row] = []
    q, kc, vc, meta = paged_batch([(n, cached)] * B, nh, nkv, d, dtype, device)
    flops = 4 * B * (n * cached + n * (n + 1) / 2) * nh * d  # causal (query, key) pairs only
    label = f"{B}x{n} new" + (f" +{cached} cached" if cached else "")

    def make_row(impl, note=""):
        return Row("prefill", model, label, impl, None, note=note)

    scale = d**-0.5
    ref = None
    if 4 * 4 * nh * n * (n + cached) <= REF_MAX_BYTES:  # the reference's float32 scores
        ref = paged_attention_ref(q.float(), kc.float(), vc.float(), meta, scale)
    fn = lambda: paged_attention(q, kc, vc, meta, scale, "triton")  # noqa: E731
    timed(rows, make_row("triton"), fn, device, smoke, flops=flops, ref=ref)
    if ref is not None:
        fn = lambda: paged_attention_ref(q, kc, vc, meta, scale)  # noqa: E731
        timed(rows, make_row("torch-ref"), fn, device, smoke, flops=flops, ref=ref)
    k = torch.cat([dense_kv(kc, meta, i) for i in range(B)])  # [B, nkv, ctx, d]
    v = torch.cat([dense_kv(vc, meta, i) for i in range(B)])
    qd = q.view(B, n, nh, d).transpose(1, 2)  # [B, nh, n, d]
    mask = None  # no cached prefix: is_causal
    if cached:  # the queries are the last n positions: a bottom-right causal mask
        from torch.nn.attention.bias import causal_lower_right

        mask = causal_lower_right(n, n + cached)
    run_sdpa(rows, make_row, device, smoke, qd, k, v, mask, ref, flops=flops)
    return rows


def mla_batch(seqs, nh, dl, dr, dtype, device):
    """Absorbed queries and a paged latent cache ``[blocks, BLOCK_SIZE, 1, dl + dr]``."""
    q, cache, _, meta = paged_batch(seqs, nh, 1, dl + dr, dtype, device)
    return q, cache, meta


def mla_case(kind, model, shape, B, n, ctx, dtype, device, smoke) -> list[Row]:
    """MLA decode (``n`` = 1: memory-bound, GB/s of the latent rows read) or prefill
    (TFLOP/s of the causal pairs: q.k over ``dl + dr``, p.v over ``dl``)."""
    from splitmoe.kernels.mla_attention import mla_attention, mla_attention_ref

    nh, dl, dr = shape
    q, cache, meta = mla_batch([(n, ctx - n)] * B, nh, dl, dr, dtype, device)
    elem = q.element_size()
    pairs = B * (n * (ctx - n) + n * (n + 1) / 2)
    moved = flops = None
    if n == 1:
        moved = B * ctx * (dl + dr) * elem + q.numel() * elem + B * nh * dl * elem
        label = f"B={B} ctx={ctx}"
    else:
        flops = 2 * pairs * nh * (2 * dl + dr)
        label = f"{B}x{n} new" + (f" +{ctx - n} cached" if ctx > n else "")
    scale = (128 + dr) ** -0.5
    ref = None
    if 4 * nh * pairs * 4 <= REF_MAX_BYTES and B * ctx * (dl + dr) * 8 <= REF_MAX_BYTES:
        ref = mla_attention_ref(q.float(), cache.float(), meta, scale, dl)
    rows: list[Row] = []
    fn = lambda: mla_attention(q, cache, meta, scale, dl, "triton")  # noqa: E731
    timed(rows, Row(kind, model, label, "triton", None), fn, device, smoke, moved, flops, ref)
    if ref is not None:
        fn = lambda: mla_attention_ref(q, cache, meta, scale, dl)  # noqa: E731
        row = Row(kind, model, label, "torch-ref", None)
        timed(rows, row, fn, device, smoke, moved, flops, ref)
    return rows


def moe_case(model, w13, w2, k, N, device, smoke) -> list[Row]:
    from splitmoe.kernels import fused_moe as moe
    from splitmoe.kernels.moe_gemm import fused_moe_triton

    E, two_i, H = w13.shape
    I = two_i // 2
    rows: list[Row] = []
    g = torch.Generator(device=device).manual_seed(N)
    x = torch.randn(N, H, generator=g, device=device, dtype=w13.dtype)
    scores = torch.rand(N, E, generator=g, device=device)
    w, ids = scores.topk(k, dim=-1)  # k distinct experts per token, uniform load
    used = int(torch.unique(ids).numel())
    elem = x.element_size()
    moved = used * 3 * H * I * elem + 2 * N * H * elem  # weights of the experts used, x, out
    flops = 2 * N * k * 3 * H * I

    def make_row(impl, note=""):
        return Row("moe", model, f"N={N}", impl, None, note=note)

    args = (x, w13, w2, ids, w)
    ref = None
    if N * k * (2 * I + H) * 4 <= REF_MAX_BYTES:
        ref = moe.fused_moe_ref(x.float(), w13.float(), w2.float(), ids, w)
    note = f"{used} experts used"
    if device.type == "cuda":  # what fused_moe(backend="triton") runs for this shape
        note += f"; backend picks {moe._faster_path(*args)}"
    fn = lambda: fused_moe_triton(*args)  # noqa: E731
    timed(rows, make_row("triton", note), fn, device, smoke, moved, flops, ref)
    if hasattr(torch, "_grouped_mm"):
        fn = lambda: moe.fused_moe_grouped_mm(*args)  # noqa: E731
        timed(rows, make_row("grouped_mm"), fn, device, smoke, moved, flops, ref)
    if ref is not None:
        fn = lambda: moe.fused_moe_ref(*args)  # noqa: E731
        timed(rows, make_row("torch-ref"), fn, device, smoke, moved, flops, ref)
    return rows


def launch_overhead_s(n: int = 200, tries: int = 5) -> float:
    """Seconds the host adds per eager operation: ``n`` one-element adds launched eagerly,
    timed on the host until the last has run, against the same ``n`` replayed from one CUDA
    graph (the GPU's own time), the median of ``tries`` each. (Not `triton.testing.do_bench`:
    it flushes the L2 between calls, a cost on the GPU's side that hides the host's.)"""
    x = torch.zeros(1, device="cuda")

    def eager() -> None:
        for _ in range(n):
            x.add_(1)

    graph = capture(eager)

    def median_s(fn) -> float:
        times = []
        for _ in range(tries):
            torch.cuda.synchronize()
            t = time.perf_counter()
            fn()
            torch.cuda.synchronize()
            times.append(time.perf_counter() - t)
        return sorted(times)[tries // 2]

    return max(0.0, median_s(eager) - median_s(graph.replay)) / n


def profile_fragment(rows: list[Row], device: str, dtype: str, launch_s: float | None) -> dict:
    """The measured constants of a GPU profile, from this run's rows: ``hbm_bytes_per_s`` (the
    Triton paged-decode kernel's best GB/s and the shape it came from), ``gemm_flops`` (the MoE
    kernels' best FLOP/s at the largest token count), ``gemm_flops_by_tokens``, and
    ``launch_s``. Only graph-timed rows count (eager times at small shapes are the host's)."""
    decode = [r for r in rows if r.kernel == "decode" and r.impl == "triton" and r.graph_ms
              and r.gbps]  # fmt: skip
    moe = [r for r in rows if r.kernel == "moe" and r.impl in ("triton", "grouped_mm")
           and r.graph_ms and r.tflops]  # fmt: skip
    from splitmoe.sim.calibrate import KERNEL_FRAGMENT

    out: dict = {"kind": KERNEL_FRAGMENT, "device": device, "dtype": dtype, "measured": {}}
    measured = out["measured"]
    if decode:
        best = max(decode, key=lambda r: r.gbps)
        measured["hbm_bytes_per_s"] = best.gbps * 1e9
        measured["hbm_shape"] = f"paged decode {best.model} {best.shape}"
    if moe:
        by_tokens: dict[int, float] = {}
        for r in moe:
            n = int(r.shape.removeprefix("N="))
            by_tokens[n] = max(by_tokens.get(n, 0.0), r.tflops * 1e12)
        measured["gemm_flops_by_tokens"] = {str(n): by_tokens[n] for n in sorted(by_tokens)}
        measured["gemm_flops"] = by_tokens[max(by_tokens)]
    if launch_s is not None:
        measured["launch_s"] = launch_s
    out["source"] = {
        "measured_by": "scripts/bench_kernels.py --profile-fragment",
        "torch": torch.__version__,
        "when": time.strftime("%Y-%m-%d %H:%M:%S"),
    }
    return out


def print_table(rows: list[Row], out=sys.stdout) -> None:
    head = (
        "kernel", "model", "shape", "impl", "ms", "graph ms", "GB/s", "TFLOP/s", "max err", "note"
    )  # fmt: skip
    cells = [
        (
            r.kernel, r.model, r.shape, r.impl,
            "-" if r.ms is None else f"{r.ms:.4f}",
            "-" if r.graph_ms is None or r.ms is None else f"{r.graph_ms:.4f}",
            "-" if r.gbps is None or r.ms is None else f"{r.gbps:.0f}",
            "-" if r.tflops is None or r.ms is None else f"{r.tflops:.2f}",
            "-" if r.err is None else f"{r.err:.1e}",
            r.note,
        )
        for r in rows
    ]  # fmt: skip
    widths = [max(len(h), *(len(c[i]) for c in cells)) for i, h in enumerate(head)]
    right = {4, 5, 6, 7, 8}

    def line(c):
        return "  ".join(
            s.rjust(w) if i in right else s.ljust(w) for i, (s, w) in enumerate(zip(c, widths))
        ).rstrip()

    print(line(head), file=out)
    print("  ".join("-" * w for w in widths), file=out)
    group = None
    for r, c in zip(rows, cells):
        if group is not None and (r.kernel, r.model) != group:
            print(file=out)
        group = (r.kernel, r.model)
        print(line(c), file=out)


# --- compile-only: every Triton kernel of the GPU run, compiled for a GPU this machine lacks ---


def _compile(fn, args: dict, consts: dict, num_warps: int, num_stages: int, arch: int):
    """Compiles ``fn`` as a launch with ``args`` would (pointer dtypes as strings, ints by value
    so that multiples of 16 get Triton's divisibility specialisation) for ``sm_<arch>``."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    sig, attrs, constexprs = {}, {}, {}
    for i, name in enumerate(fn.arg_names):
        if name in consts:
            sig[name] = "constexpr"
            constexprs[(i,)] = consts[name]
            continue
        value = args[name]
        if isinstance(value, str):  # pointer: allocations are 16-byte aligned
            sig[name] = "*" + value
            attrs[(i,)] = [["tt.divisibility", 16]]
        elif isinstance(value, float):
            sig[name] = "fp32"
        else:
            sig[name] = "i64" if abs(value) >= 2**31 else "i32"
            if value % 16 == 0:
                attrs[(i,)] = [["tt.divisibility", 16]]
    src = ASTSource(fn=fn, signature=sig, constexprs=constexprs, attrs=attrs)
    triton.knobs.nvidia.dump_ptxas_log = True
    triton.knobs.compilation.always_compile = True  # a cache hit would skip ptxas and its log
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        compiled = triton.compile(
            src,
            target=GPUTarget("cuda", arch, 32),
            options={"num_warps": num_warps, "num_stages": num_stages},
        )
    log = buf.getvalue()
    regs = re.search(r"Used (\d+) registers", log)
    spills = re.search(r"(\d+) bytes spill stores", log)
    return {
        "regs": int(regs.group(1)) if regs else -1,
        "spill_bytes": int(spills.group(1)) if spills else 0,
        "shared_bytes": compiled.metadata.shared,
    }


def compile_plan(attention_models, moe_models, dtype: torch.dtype, arch: int) -> list[dict]:
    """Compiles the distinct kernel configurations the full GPU run would launch."""
    from splitmoe.kernels import decode_attention as dec
    from splitmoe.kernels import moe_gemm
    from splitmoe.kernels import prefill_attention as pre

    t = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}[dtype]
    plans: dict[tuple, tuple] = {}
    for nh, nkv, d in attention_models.values():
        group = nh // nkv
        att = dict(
            q_ptr=t, k_ptr=t, v_ptr=t, o_ptr=t, part_o_ptr="fp32", part_lse_ptr="fp32",
            tables_ptr="i32", query_start_ptr="i64", seq_lens_ptr="i64", sinks_ptr="fp32",
            qk_scale=1.0, window=128, num_seqs=3, stride_qt=nh * d, stride_qh=d,
            stride_ot=nh * d, stride_oh=d,
            stride_kb=BLOCK_SIZE * nkv * d, stride_ks=nkv * d, stride_kh=d, stride_table=129,
        )  # fmt: skip
        for n, _, _ in PREFILL_CASES:
            tiles = pre.prefill_tiles(d, group, n, dtype)
            for gpt_oss in (False, True):  # attention sinks and a sliding window
                consts = pre.prefill_constexprs(BLOCK_SIZE, group, d, dtype, tiles)
                consts.update(SINKS=gpt_oss, WINDOW=gpt_oss)
                plans[("prefill",) + tuple(consts.items())] = (
                    pre._prefill_kernel, att, consts, tiles
                )  # fmt: skip
        for B in DECODE_BATCHES:
            for ctx in DECODE_CONTEXTS:
                tiles = dec.decode_tiles(B, nkv, ctx, d, dtype, H100_SMS)
                splits = tiles.num_splits
                for gpt_oss in (False, True):
                    consts = dec.decode_constexprs(BLOCK_SIZE, group, d, dtype, tiles)
                    consts.update(SINKS=gpt_oss, WINDOW=gpt_oss)
                    plans[("decode",) + tuple(consts.items())] = (
                        dec._decode_kernel, att, consts, tiles
                    )  # fmt: skip
                if splits > 1:
                    red = {
                        k: consts[k] for k in ("HEAD_DIM", "HEAD_DIM_PAD", "BLOCK_N", "NUM_SPLITS")
                    }
                    red["SPLIT_CHUNK"] = min(splits, dec.REDUCE_CHUNK)
                    red["SINKS"] = True
                    plans[("reduce",) + tuple(red.items())] = (
                        dec._decode_reduce_kernel, att, red, dec.DecodeTiles(64, splits, 4, 1)
                    )  # fmt: skip
    for nh, dl, dr in MLA_MODELS.values():
        plans.update(mla_compile_plans(nh, dl, dr, dtype, t))
    for E, H, I, k in moe_models.values():
        args = dict(
            x_ptr=t, w_ptr=t, b_ptr=t, h_ptr=t, y_ptr=t, router_w_ptr="fp32",
            sorted_ids_ptr="i32", block_expert_ptr="i32", num_pairs=8 * 8 + 1, num_m_blocks=33,
            H=H, I=I, stride_xt=H, stride_we=2 * I * H, stride_wn=H, stride_ht=I, stride_yt=H,
            stride_be=2 * I, swiglu_limit=7.0, swiglu_alpha=1.702,
            s_ptr=t, stride_se=0, stride_sn=0, stride_sk=0,  # scales: quantized weights only
            xs_ptr="fp32", hs_ptr="fp32", stride_xst=0, stride_hst=0,  # W8A8 only
        )  # fmt: skip
        for N in MOE_TOKENS:
            tiles = moe_gemm.moe_tiles(N * k, E, dtype)
            for gpt_oss in (False, True):  # expert biases and the clamped SwiGLU
                consts = dict(moe_gemm.moe_constexprs(dtype, tiles), HAS_BIAS=gpt_oss)
                up = dict(consts, TOP_K=k, CLAMPED=gpt_oss)
                plans[("gate_up",) + tuple(up.items())] = (
                    moe_gemm._gate_up_kernel, args, up, tiles
                )  # fmt: skip
                down = dict(args, stride_we=H * I, stride_wn=I, stride_be=H)
                plans[("down",) + tuple(consts.items())] = (
                    moe_gemm._down_kernel, down, consts, tiles
                )  # fmt: skip
    results = []
    for key, (fn, args, consts, tiles) in plans.items():
        t0 = time.perf_counter()
        info = _compile(fn, args, consts, tiles.num_warps, tiles.num_stages, arch)
        info.update(
            kernel=key[0],
            config=" ".join(f"{k}={v}" for k, v in consts.items() if k != "DOT_PRECISION"),
            warps=tiles.num_warps,
            stages=tiles.num_stages,
            seconds=time.perf_counter() - t0,
        )
        results.append(info)
    return results


def mla_compile_plans(nh: int, dl: int, dr: int, dtype: torch.dtype, t: str) -> dict:
    """The MLA decode (every split count an H100 run picks) and prefill configurations."""
    from splitmoe.kernels import decode_attention as dec
    from splitmoe.kernels import mla_decode, mla_prefill

    dk = dl + dr
    args = dict(
        q_ptr=t, c_ptr=t, o_ptr=t, part_o_ptr="fp32", part_lse_ptr="fp32", tables_ptr="i32",
        query_start_ptr="i64", seq_lens_ptr="i64", qk_scale=1.0, num_seqs=3, num_heads=nh,
        stride_qt=nh * dk, stride_qh=dk, stride_ot=nh * dl, stride_oh=dl,
        stride_cb=BLOCK_SIZE * dk, stride_cs=dk, stride_table=129,
    )  # fmt: skip
    widths = mla_decode.mla_constexprs(dl, dr, dtype)
    plans: dict[tuple, tuple] = {}
    tiles = mla_prefill.mla_prefill_tiles(nh, dtype)
    consts = dict(
        widths, BLOCK_SIZE=BLOCK_SIZE, BLOCK_H=tiles.block_h, BLOCK_Q=tiles.block_q,
        BLOCK_N=tiles.block_n,
    )  # fmt: skip
    plans[("mla_pre",) + tuple(consts.items())] = (
        mla_prefill._mla_prefill_kernel, args, consts, tiles
    )  # fmt: skip
    for B in DECODE_BATCHES:
        for ctx in DECODE_CONTEXTS:
            tiles = mla_decode.mla_decode_tiles(B, nh, ctx, dtype, H100_SMS)
            splits = tiles.num_splits
            consts = dict(
                widths, BLOCK_SIZE=BLOCK_SIZE, BLOCK_H=tiles.block_h, BLOCK_N=tiles.block_n,
                NUM_SPLITS=splits,
            )  # fmt: skip
            plans[("mla_dec",) + tuple(consts.items())] = (
                mla_decode._mla_decode_kernel, args, consts, tiles
            )  # fmt: skip
            if splits > 1:
                red = dict(
                    HEAD_DIM=dl, HEAD_DIM_PAD=widths["DL_PAD"], BLOCK_N=tiles.block_n,
                    NUM_SPLITS=splits, SPLIT_CHUNK=min(splits, dec.REDUCE_CHUNK), SINKS=False,
                )  # fmt: skip
                red_args = dict(
                    args, stride_ot=nh * dl, stride_oh=dl, o_ptr=t, part_o_ptr="fp32",
                    sinks_ptr="fp32", window=0,
                )  # fmt: skip
                plans[("reduce",) + tuple(red.items())] = (
                    dec._decode_reduce_kernel, red_args, red, dec.DecodeTiles(64, splits, 4, 1)
                )  # fmt: skip
    return plans


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--only", default=",".join(KERNELS), help="comma-separated kernels")
    ap.add_argument("--dtype", default=None, help="bfloat16 (CUDA default) | float16 | float32")
    ap.add_argument("--smoke", action="store_true", help="tiny shapes (CPU: Triton interpreter)")
    ap.add_argument("--compile-only", action="store_true", help="compile for --arch, no GPU")
    ap.add_argument("--arch", type=int, default=90, help="compute capability for --compile-only")
    ap.add_argument("--csv", type=Path, default=None, help="also write the rows here")
    ap.add_argument(
        "--profile-fragment", type=Path, default=None,
        help="also write the simulator's measured GPU constants here (CUDA only)",
    )  # fmt: skip
    args = ap.parse_args(argv)
    if args.profile_fragment and not torch.cuda.is_available():
        print("no CUDA device: a profile fragment is a GPU's measurement; nothing written")
        return 0
    kernels = {k.strip() for k in args.only.split(",") if k.strip()}
    unknown = kernels - set(KERNELS)
    if unknown:
        ap.error(f"--only: unknown kernels {sorted(unknown)}; choose from {', '.join(KERNELS)}")

    if args.compile_only:
        if os.environ.get("TRITON_INTERPRET") == "1":
            ap.error("--compile-only compiles for a GPU: unset TRITON_INTERPRET")
        dtype = getattr(torch, args.dtype or "bfloat16")
        results = compile_plan(ATTENTION_MODELS, MOE_MODELS, dtype, args.arch)
        print(f"sm_{args.arch}  {'kernel':<8} {'regs':>4} {'spill B':>7} {'smem KB':>7}  config")
        for r in results:
            print(
                f"       {r['kernel']:<8} {r['regs']:>4} {r['spill_bytes']:>7} "
                f"{r['shared_bytes'] / 1024:>7.1f}  warps={r['warps']} stages={r['stages']} "
                f"{r['config']}"
            )
        bad = [r for r in results if r["spill_bytes"] or r["shared_bytes"] > 227 * 1024]
        print(f"{len(results)} configurations, {len(bad)} spilling or over 227 KB shared memory")
        return 1 if bad else 0

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.type == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        # Triton only interprets on CPU, and must know before it is imported (below).
        os.environ["TRITON_INTERPRET"] = "1"
    smoke = args.smoke or device.type == "cpu"
    if device.type == "cpu" and not args.smoke:
        print("no CUDA device: running the --smoke shapes through Triton's interpreter")
    dtype = getattr(torch, args.dtype or ("bfloat16" if device.type == "cuda" else "float32"))
    mla_models = SMOKE_MLA if smoke else MLA_MODELS
    if smoke:
        attention, moe_models = SMOKE_ATTENTION, SMOKE_MOE
        batches, contexts, prefill, tokens = (1, 4), (64, 200), ((32, 0, 1), (24, 40, 2)), (1, 16)
    else:
        attention, moe_models = ATTENTION_MODELS, MOE_MODELS
        batches, contexts, prefill, tokens = (
            DECODE_BATCHES, DECODE_CONTEXTS, PREFILL_CASES, MOE_TOKENS
        )  # fmt: skip
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU (interpreter)"
    print(f"# {name}, {dtype}, block_size={BLOCK_SIZE}, torch {torch.__version__}")
    rows: list[Row] = []
    with torch.inference_mode():
        if "decode" in kernels:
            for model, shape in attention.items():
                for B in batches:
                    for ctx in contexts:
                        rows += decode_case(model, shape, B, ctx, dtype, device, smoke)
        if "prefill" in kernels:
            for model, shape in attention.items():
                for n, cached, B in prefill:
                    rows += prefill_case(model, shape, n, cached, B, dtype, device, smoke)
        if "mla_decode" in kernels:
            for model, shape in mla_models.items():
                for B in batches:
                    for ctx in contexts:
                        rows += mla_case(
                            "mla_decode", model, shape, B, 1, ctx, dtype, device, smoke
                        )
        if "mla_prefill" in kernels:
            for model, shape in mla_models.items():
                for n, cached, B in prefill:
                    rows += mla_case(
                        "mla_prefill", model, shape, B, n, n + cached, dtype, device, smoke
                    )
        if "moe" in kernels:
            for model, (E, H, I, k) in moe_models.items():
                w13 = torch.empty(E, 2 * I, H, dtype=dtype, device=device).normal_(std=H**-0.5)
                w2 = torch.empty(E, H, I, dtype=dtype, device=device).normal_(std=I**-0.5)
                for N in tokens:
                    rows += moe_case(model, w13, w2, k, N, device, smoke)
    print_table(rows)
    if args.csv:
        with args.csv.open("w", newline="") as f:
            w = csv.writer(f)
            w.writerow(Row.__dataclass_fields__)
            for r in rows:
                w.writerow([getattr(r, k) for k in Row.__dataclass_fields__])
    if args.profile_fragment:
        import json

        frag = profile_fragment(rows, name, str(dtype).removeprefix("torch."), launch_overhead_s())
        args.profile_fragment.write_text(json.dumps(frag, indent=2) + "\n")
        print(f"profile fragment: {args.profile_fragment} ({', '.join(frag['measured'])})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
