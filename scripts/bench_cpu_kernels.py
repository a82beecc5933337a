"""Native CPU kernels (`splitmoe.kernels.cpu_native`) against the PyTorch paths, one thread.

    python scripts/bench_cpu_kernels.py            # default model's heads and Qwen3-30B-A3B's
    python scripts/bench_cpu_kernels.py --smoke    # tiny shapes, a few seconds

Decode attention runs over a paged cache with scattered blocks, as many layers' pools as a
4-layer model holds, touching other memory between calls (``--hot``: the same pool again and
again instead), because inside a model step each layer finds its KV cold in cache. Each row gives
µs per call (median of interleaved repeats) of the reference and the native kernel, their ratio,
and the largest difference between their outputs. Then RMSNorm, the fused q/k norm + RoPE, and
the routed experts of the default model (16 experts, H 128) and of Qwen3-30B-A3B (128, H 2048).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from splitmoe.attention_nodes.model import AttentionModel, rms_norm
from splitmoe.kernels import cpu_native
from splitmoe.kernels.fused_moe import fused_moe
from splitmoe.kernels.paged_attention import AttentionMetadata, paged_attention_ref

# (name, query heads, kv heads, head_dim)
HEADS = [("default", 4, 2, 32), ("qwen3-30b", 32, 4, 128)]


def decode_case(B: int, ctx: int, nh: int, nkv: int, d: int, layers: int, block_size: int = 16):
    g = torch.Generator().manual_seed(0)
    nblk = -(-ctx // block_size)
    pool = B * nblk
    tables = torch.randperm(pool, generator=g)[: B * nblk].to(torch.int32).view(B, nblk)
    meta = AttentionMetadata(
        query_start_loc=torch.arange(B + 1, dtype=torch.int64),
        seq_lens=torch.full((B,), ctx, dtype=torch.int64),
        block_tables=tables.contiguous(),
        slot_mapping=torch.zeros(B, dtype=torch.int64),
        query_lens=[1] * B,
        seq_lens_list=[ctx] * B,
    )
    caches = [
        (
            torch.randn(pool, block_size, nkv, d, generator=g),
            torch.randn(pool, block_size, nkv, d, generator=g),
        )
        for _ in range(layers)
    ]
    return torch.randn(B, nh, d, generator=g), caches, meta


def timed(fn, rounds: int, between=None) -> list[float]:
    out = []
    for _ in range(rounds):
        if between is not None:
            between()
        t = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t)
    return out


def row(label: str, size: str, t_ref: list[float], t_nat: list[float], err: float) -> str:
    a, b = statistics.median(t_ref) * 1e6, statistics.median(t_nat) * 1e6
    return f"{label:<24}{size:>12}{a:>10.1f}{b:>10.1f}{a / b:>8.2f}x{err:>10.1e}"


HEADER = f"{'':<24}{'':>12}{'torch':>10}{'native':>10}{'speedup':>9}{'max err':>10}"


def decode_row(args, name: str, B: int, ctx: int, nh: int, nkv: int, d: int, other) -> str:
    q, caches, meta = decode_case(B, ctx, nh, nkv, d, 1 if args.hot else 4)
    out = torch.empty_like(q)
    scale = d**-0.5
    k, v = caches[0]
    cpu_native.decode_attention(q, k, v, meta, scale, out)
    err = (out - paged_attention_ref(q, k, v, meta, scale)).abs().max().item()
    layer = [0]

    def between():  # the next layer's pool; other work evicts it from cache meanwhile
        layer[0] = (layer[0] + 1) % len(caches)
        if not args.hot:
            other.mul_(1.0)

    def ref():
        k, v = caches[layer[0]]
        meta.derived.clear()  # the reference's plan is built once per step, not per layer
        paged_attention_ref(q, k, v, meta, scale)

    def native():
        k, v = caches[layer[0]]
        cpu_native.decode_attention(q, k, v, meta, scale, out)

    t_ref, t_nat = [], []
    for _ in range(args.repeat):
        t_ref += timed(ref, 3, between)
        t_nat += timed(native, 3, between)
    return row(f"decode {name}", f"{B} x {ctx}", t_ref, t_nat, err)


def bench_decode(args) -> None:
    print(f"decode attention ({'hot' if args.hot else 'cold'} cache), µs per call: batch x ctx")
    print(HEADER)
    other = torch.randn(4 << 20)  # 16 MB touched between calls: another layer's work
    batches = [1, 8] if args.smoke else [1, 8, 32, 128]
    contexts = [64, 300] if args.smoke else [64, 512, 2048]
    for name, nh, nkv, d in HEADS[:1] if args.smoke else HEADS:
        for B in batches:
            for ctx in contexts:
                if B * ctx * nkv * d <= 64 << 20:  # pools under ~2 GB
                    print(decode_row(args, name, B, ctx, nh, nkv, d, other))


def norm_rows(args, T: int) -> list[str]:
    n = 20 * args.repeat
    x, w = torch.randn(T, 2048), torch.randn(2048)
    err = (rms_norm(x, w, 1e-6) - cpu_native.rms_norm(x, w, 1e-6)).abs().max().item()
    t_ref = timed(lambda: rms_norm(x, w, 1e-6), n)
    t_nat = timed(lambda: cpu_native.rms_norm(x, w, 1e-6), n)
    rows = [row("rms_norm H 2048", f"T {T}", t_ref, t_nat, err)]
    nh, nkv, d = 32, 4, 128  # Qwen3-30B-A3B's heads
    qkv = torch.randn(T, nh + 2 * nkv, d)
    wh = torch.randn(nh + nkv, d)
    inv_freq = 1.0 / (1e6 ** (torch.arange(0, d, 2, dtype=torch.float32) / d))
    holder = type("Rope", (), {"inv_freq": inv_freq})()
    cos_sin = AttentionModel.rope(holder, torch.arange(T), torch.float32)
    qk = qkv[:, : nh + nkv]

    def ref():
        return AttentionModel.apply_rope(rms_norm(qk, None, 1e-6) * wh, cos_sin)

    got = cpu_native.norm_rope_(qkv.clone()[:, : nh + nkv], wh, 1e-6, *cos_sin)
    err = (got - ref()).abs().max().item()
    work = qkv.clone()[:, : nh + nkv]
    t_nat = timed(lambda: cpu_native.norm_rope_(work, wh, 1e-6, *cos_sin), n)
    rows.append(row("qk norm + rope 32/4x128", f"T {T}", timed(ref, n), t_nat, err))
    return rows


def bench_norms(args) -> None:
    print("\nRMSNorm and q/k head norm + RoPE, µs per call")
    print(HEADER)
    for T in [1, 32] if args.smoke else [1, 32, 128, 512]:
        print("\n".join(norm_rows(args, T)))


def moe_row(args, T: int, E: int, H: int, I: int, k: int) -> str:
    g = torch.Generator().manual_seed(T)
    w13 = torch.randn(E, 2 * I, H, generator=g) * H**-0.5
    w2 = torch.randn(E, H, I, generator=g) * I**-0.5
    x = torch.randn(T, H, generator=g)
    ids = torch.randn(T, E, generator=g).topk(k, dim=1).indices.to(torch.int32)
    w = torch.rand(T, k, generator=g)
    w13t, w2t = cpu_native.expert_layout(w13, w2)
    want = fused_moe(x, w13, w2, ids, w, "torch")
    err = (cpu_native.fused_moe(x, w13t, w2t, ids, w) - want).abs().max().item()
    n = 5 * args.repeat
    t_ref = timed(lambda: fused_moe(x, w13, w2, ids, w, "torch"), n)
    t_nat = timed(lambda: cpu_native.fused_moe(x, w13t, w2t, ids, w), n)
    return row(f"moe {E}e top-{k} {H}/{I}", f"T {T}", t_ref, t_nat, err)


def bench_moe(args) -> None:
    print("\nrouted experts (fused_moe, torch = the grouped CPU path), µs per call")
    print(HEADER)
    shapes = [(16, 128, 64, 4)] if args.smoke else [(16, 128, 64, 4), (128, 2048, 768, 8)]
    for E, H, I, k in shapes:
        tokens = [1, 32] if args.smoke else [1, 8, 32, 128, 512]
        for T in tokens if H < 1024 else [1, 32, 128]:
            print(moe_row(args, T, E, H, I, k))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--smoke", action="store_true", help="tiny shapes")
    ap.add_argument("--hot", action="store_true", help="one pool, warm in cache")
    ap.add_argument("--repeat", type=int, default=5, help="interleaved rounds per shape")
    args = ap.parse_args()
    torch.set_num_threads(1)
    if not cpu_native.available():
        raise SystemExit("the native CPU kernels do not build here (see the warning above)")
    with torch.inference_mode():
        bench_decode(args)
        bench_norms(args)
        bench_moe(args)


if __name__ == "__main__":
    main()
