"""Fused-MoE throughput with experts kept quantized (FP8 blocks, MXFP4) against the bf16 kernel,
at decode and prefill sizes, on DeepSeek-V3's and gpt-oss-120b's expert shapes; one table.

    python scripts/bench_quant_moe.py                     # CUDA: every model, format, size
    python scripts/bench_quant_moe.py --tokens 1,64,4096  # a few sizes
    python scripts/bench_quant_moe.py --compile-only      # no GPU: compile every quantized
                                                          # variant for --arch (90, 80, ...) and
                                                          # report registers, spills, smem

Each format runs the same Triton kernels (`splitmoe.kernels.moe_gemm`), reading a weight tile
as bf16, as FP8 bytes times their 128x128 block's scale, or as MXFP4 nibbles times their
power of two; ``fp8-w8a8`` (sm >= 89) also quantizes the activations to FP8 in groups of 128
and runs FP8 dots (``act_fp8=True``), as DeepSeek-V3's inference does.

Decode is memory-bound: weight GB/s (bytes of the experts used, in the format's
own size) is the figure of merit, and the ratio to bf16 is the point of keeping weights
quantized. Prefill is compute-bound: TFLOP/s, where in-register dequantization costs. Before
timing, each quantized kernel is checked against the bf16 kernel run on the same weights
dequantized (a few experts), so a wrong GPU build cannot print a fast number. Times are from
``triton.testing.do_bench`` (L2 flushed between calls), replayed from a CUDA graph.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from splitmoe.kernels.quant import QuantizedWeight  # noqa: E402

# name -> (experts, hidden H, intermediate I, top-k, formats timed next to bf16)
MODELS = {
    "deepseek-v3": (256, 7168, 2048, 8, ("fp8", "mxfp4")),
    "gpt-oss-120b": (128, 2880, 2880, 4, ("mxfp4", "fp8")),
}
TOKENS = (1, 8, 64, 2048, 8192)
FP8_BLOCK = (128, 128)  # DeepSeek-V3's weight_block_size


def random_quantized(E: int, N: int, K: int, fmt: str, device) -> QuantizedWeight:
    """Random experts ``[E, N, K]`` in ``fmt`` with weights of about ``K ** -0.5`` (the speed
    does not depend on the values; NaN codes are avoided so that the check below is meaningful)."""
    g = torch.Generator(device=device).manual_seed(E + N + K)
    if fmt == "fp8":
        data = torch.randint(0, 256, (E, N, K), generator=g, device=device, dtype=torch.uint8)
        for d in data:  # one expert at a time: no mask the size of every expert
            d[(d & 0x7F) == 0x7F] = 0  # the two NaN codes
        bn, bk = FP8_BLOCK
        scale = torch.rand(E, -(-N // bn), -(-K // bk), generator=g, device=device)
        scale = scale * (2 * K**-0.5 / 448)  # e4m3's largest value, 448, to about K^-0.5
        return QuantizedWeight(data.view(torch.float8_e4m3fn), scale, "fp8", FP8_BLOCK)
    data = torch.randint(0, 256, (E, N, K // 2), generator=g, device=device, dtype=torch.uint8)
    exp = round(torch.log2(torch.tensor(K**-0.5 / 3)).item())  # fp4 magnitudes up to 6
    scale = torch.randint(126 + exp, 129 + exp, (E, N, K // 32), generator=g, device=device)
    return QuantizedWeight(data, scale.to(torch.uint8), "mxfp4", (1, 32))


def check(w13q, w2q, H: int, k: int, dtype, **opts) -> float:
    """Max error of the quantized kernel (``opts``: ``act_fp8``) against the dense kernel on the
    same weights dequantized (the first 8 experts), relative to the output's scale."""
    from splitmoe.kernels.moe_gemm import fused_moe_triton

    E = 8
    idx = torch.arange(E, device=w13q.device)
    w13, w2 = w13q.select(idx), w2q.select(idx)
    g = torch.Generator(device=w13q.device).manual_seed(1)
    x = torch.randn(40, H, generator=g, device=w13q.device, dtype=dtype)
    w, ids = torch.rand(40, E, generator=g, device=w13q.device).topk(min(k, E), dim=-1)
    got = fused_moe_triton(x, w13, w2, ids, w, **opts).float()
    want = fused_moe_triton(x, w13.dequantize(dtype), w2.dequantize(dtype), ids, w).float()
    return ((got - want).abs().max() / want.abs().max().clamp(min=1e-6)).item()


def graph_ms(fn) -> float:
    import triton

    fn()  # compile outside the capture
    torch.cuda.synchronize()
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=s):
            fn()
    torch.cuda.synchronize()
    return triton.testing.do_bench(graph.replay, warmup=10, rep=50)


def run(models: dict, tokens, dtype) -> int:
    from splitmoe.kernels.moe_gemm import fused_moe_triton

    dev = torch.device("cuda")
    print(f"# {torch.cuda.get_device_name(dev)}, activations {dtype}, torch {torch.__version__}")
    head = ("model", "tokens", "weights", "ms", "weight GB/s", "TFLOP/s", "vs bf16", "note")
    print("  ".join(f"{h:>12}" for h in head))
    bad = 0
    for model, (E, H, I, k, fmts) in models.items():
        dense13 = torch.empty(E, 2 * I, H, dtype=dtype, device=dev).normal_(std=H**-0.5)
        dense2 = torch.empty(E, H, I, dtype=dtype, device=dev).normal_(std=I**-0.5)
        weights = {"bf16": (dense13, dense2, {})}
        notes = {"bf16": ""}
        for fmt in fmts:
            w13q = random_quantized(E, 2 * I, H, fmt, dev)
            w2q = random_quantized(E, H, I, fmt, dev)
            runs = {fmt: {}}
            if fmt == "fp8" and torch.cuda.get_device_capability(dev) >= (8, 9):
                runs["fp8-w8a8"] = {"act_fp8": True}
            for name, opts in runs.items():
                err = check(w13q, w2q, H, k, dtype, **opts)
                # W8A8 rounds the activations to 3 mantissa bits: a few percent
                ok = err < (0.1 if opts else 2e-2)
                bad += not ok
                notes[name] = f"check {err:.1e}" + ("" if ok else " WRONG")
                weights[name] = (w13q, w2q, opts)
        per_expert = {
            name: (w13.nbytes + w2.nbytes) / E if name != "bf16" else 3 * H * I * 2
            for name, (w13, w2, _) in weights.items()
        }
        for N in tokens:
            g = torch.Generator(device=dev).manual_seed(N)
            x = torch.randn(N, H, generator=g, device=dev, dtype=dtype)
            w, ids = torch.rand(N, E, generator=g, device=dev).topk(k, dim=-1)
            used = int(torch.unique(ids).numel())
            flops = 2 * N * k * 3 * H * I
            base = None
            for name, (w13, w2, opts) in weights.items():
                ms = graph_ms(lambda: fused_moe_triton(x, w13, w2, ids, w, **opts))  # noqa: B023
                base = ms if base is None else base
                gbps = used * per_expert[name] / ms / 1e6
                cells = (
                    model, str(N), name, f"{ms:.4f}", f"{gbps:.0f}", f"{flops / ms / 1e9:.1f}",
                    f"{base / ms:.2f}x", f"{used} experts used; {notes[name]}".rstrip("; "),
                )  # fmt: skip
                print("  ".join(f"{c:>12}" for c in cells[:-1]) + "  " + cells[-1])
            print()
        del dense13, dense2, weights
        torch.cuda.empty_cache()
    if bad:
        print(f"{bad} quantized kernels disagree with the bf16 kernel on dequantized weights")
    return 1 if bad else 0


def compile_only(models: dict, tokens, dtype, arch: int) -> int:
    """Every quantized variant of the gate/up and down kernels (and the dense ones) an H100 run
    of these models launches, compiled for ``sm_<arch>`` with Triton's ptxas; no GPU needed."""
    import bench_kernels as bk

    from splitmoe.kernels import moe_gemm
    from splitmoe.kernels.quant_linear import _quant_linear_kernel, linear_tiles

    t = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}[dtype]
    variants = {  # name -> (data pointer, scale pointer, WeightArgs-like constexprs)
        "bf16": (t, t, dict(WFMT=0, K_UNIFORM=False, BN_Q=1, BK_Q=1)),
        "fp8": ("fp8e4nv", "fp32", dict(WFMT=1, K_UNIFORM=True, BN_Q=128, BK_Q=128)),
        "fp8-bits": ("u8", "fp32", dict(WFMT=2, K_UNIFORM=True, BN_Q=128, BK_Q=128)),
        "mxfp4": ("u8", "u8", dict(WFMT=3, K_UNIFORM=False, BN_Q=1, BK_Q=32)),
        "w8a8": ("u8", "fp32", dict(WFMT=4, K_UNIFORM=True, BN_Q=128, BK_Q=128, A_FP8=True)),
    }
    plans = {}
    for E, H, I, k, _ in models.values():
        for N in tokens:
            for name, (wp, sp, wc) in variants.items():
                if name in ("fp8", "w8a8") and arch < 89 or name == "fp8-bits" and arch >= 89:
                    continue  # FP8 conversions and dots from sm_89; the bits decode below
                tiles = moe_gemm.moe_tiles(N * k, E, dtype, act_fp8=name == "w8a8")
                consts = dict(moe_gemm.moe_constexprs(dtype, tiles), **wc)
                consts["BLOCK_K"] = min(tiles.block_k, 64 if name == "mxfp4" else 128)
                args = dict(
                    x_ptr=t, w_ptr=wp, s_ptr=sp, b_ptr=t, h_ptr=t, y_ptr=t, router_w_ptr="fp32",
                    sorted_ids_ptr="i32", block_expert_ptr="i32", num_pairs=N * k + 1,
                    num_m_blocks=33, H=H, I=I, stride_xt=H, stride_we=2 * I * H, stride_wn=H,
                    stride_se=64, stride_sn=16, stride_sk=1, stride_ht=I, stride_yt=H,
                    stride_be=2 * I, swiglu_limit=7.0, swiglu_alpha=1.702, xs_ptr="fp32",
                    hs_ptr="fp32", stride_xst=2, stride_hst=16,
                )  # fmt: skip
                if name == "w8a8":  # e4m3 activations, loaded as bytes
                    args["x_ptr"] = "u8"
                for bias in (False, True):
                    if name == "w8a8" and bias:
                        continue  # DeepSeek-style experts: no biases
                    up = dict(consts, TOP_K=k, HAS_BIAS=bias, CLAMPED=bias)
                    plans[("gate_up", name, *up.items())] = (
                        moe_gemm._gate_up_kernel, args, up, tiles
                    )  # fmt: skip
                    down = dict(consts, HAS_BIAS=bias)
                    down_args = dict(args, h_ptr="u8") if name == "w8a8" else args
                    plans[("down", name, *down.items())] = (
                        moe_gemm._down_kernel, down_args, down, tiles
                    )  # fmt: skip
            lt = linear_tiles(N, dtype)
            for name, (wp, sp, wc) in variants.items():
                if name in ("fp8", "w8a8") and arch < 89 or name == "fp8-bits" and arch >= 89:
                    continue
                if name == "bf16":
                    continue  # dense linears run in cuBLAS (`kernels.linear`), not this kernel
                consts = dict(
                    {"A_FP8": False, **wc}, HAS_BIAS=False, BLOCK_M=lt.block_m,
                    BLOCK_N=lt.block_n, BLOCK_K=lt.block_k, GROUP_M=lt.group_m,
                    DOT_PRECISION="tf32",
                )  # fmt: skip
                args = dict(
                    x_ptr="u8" if name == "w8a8" else t, xs_ptr="fp32", w_ptr=wp, s_ptr=sp,
                    b_ptr=t, y_ptr=t, T=N, N=2 * I, K=H, stride_xt=H, stride_xst=2, stride_we=0,
                    stride_wn=H, stride_se=0, stride_sn=16, stride_sk=1, stride_yt=2 * I,
                )  # fmt: skip
                plans[("linear", name, *consts.items())] = (_quant_linear_kernel, args, consts, lt)
    print(f"sm_{arch}  {'kernel':<8} {'weights':<8} {'regs':>4} {'spill B':>7} {'smem KB':>7}")
    bad = 0
    for key, (fn, args, consts, tiles) in plans.items():
        info = bk._compile(fn, args, consts, tiles.num_warps, tiles.num_stages, arch)
        over = info["spill_bytes"] or info["shared_bytes"] > 227 * 1024
        bad += bool(over)
        cfg = f"M{tiles.block_m} N{tiles.block_n} K{consts['BLOCK_K']} w{tiles.num_warps}"
        print(
            f"       {key[0]:<8} {key[1]:<8} {info['regs']:>4} {info['spill_bytes']:>7} "
            f"{info['shared_bytes'] / 1024:>7.1f}  {cfg} s{tiles.num_stages}"
            f"{' bias' if consts.get('HAS_BIAS') else ''}"
        )
    print(f"{len(plans)} configurations, {bad} spilling or over 227 KB shared memory")
    return 1 if bad else 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", default=",".join(map(str, TOKENS)), help="comma-separated")
    ap.add_argument("--models", default=",".join(MODELS), help="comma-separated")
    ap.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16"))
    ap.add_argument("--compile-only", action="store_true", help="compile for --arch, no GPU")
    ap.add_argument("--arch", type=int, default=90, help="compute capability for --compile-only")
    args = ap.parse_args(argv)
    tokens = [int(n) for n in args.tokens.split(",")]
    unknown = set(args.models.split(",")) - set(MODELS)
    if unknown:
        ap.error(f"unknown models {sorted(unknown)}; choose from {', '.join(MODELS)}")
    models = {m: MODELS[m] for m in args.models.split(",")}
    dtype = getattr(torch, args.dtype)
    if args.compile_only:
        if os.environ.get("TRITON_INTERPRET") == "1":
            ap.error("--compile-only compiles for a GPU: unset TRITON_INTERPRET")
        return compile_only(models, tokens, dtype, args.arch)
    if not torch.cuda.is_available():
        print(
            "bench_quant_moe: no CUDA device here. The kernels need a GPU to be timed; on CPU "
            "they are checked by tests/kernels/test_quant_moe_triton.py in Triton's "
            "interpreter, and `--compile-only` compiles them for a GPU without one.",
            file=sys.stderr,
        )
        return 2
    with torch.inference_mode():
        return run(models, tokens, dtype)


if __name__ == "__main__":
    sys.exit(main())
