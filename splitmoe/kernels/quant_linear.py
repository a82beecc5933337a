"""A Triton linear that reads a `QuantizedWeight` in its released layout: ``y = x W^T + b``.

The dense linears that ship FP8 (attention ranks' projections of DeepSeek-V3/R1, Kimi-K2,
MiniMax-M2, Qwen3 FP8) stay 1 byte a weight plus their block scales; each ``[BLOCK_K, BLOCK_N]``
tile of ``W^T`` is dequantized in registers by the fused-MoE kernels' `_weight_tile` (FP8
blocks or MXFP4 nibbles to float32 exactly, then cast to x's dtype) and fed to the same
``tl.dot`` as a dense weight would be (W8A16 / W4A16). In float32 that is the math of
`linear_quant_ref`: dequantize, then ``F.linear``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from splitmoe.kernels.moe_gemm import (
    ACT_GROUP,
    _activations,
    _row_scales,
    _tile_ids,
    _weight_tile,
    check_quantized_weights,
    fp8_decodes_natively,
    weight_args,
)
from splitmoe.kernels.quant import QuantizedWeight
from splitmoe.kernels.triton_utils import dot_precision, require_triton


@dataclass(frozen=True)
class LinearTiles:
    block_m: int
    block_n: int
    block_k: int
    group_m: int  # row blocks per column sweep (L2 reuse of weight tiles)
    num_warps: int
    num_stages: int


def linear_tiles(num_tokens: int, dtype: torch.dtype) -> LinearTiles:
    """Few tokens (decode): 16-row tiles, the GEMM streams the weight once and is bandwidth-bound.
    Many: tensor-core tiles with grouped ordering. float32 dots run on CUDA cores: half the K."""
    if dtype == torch.float32:
        return LinearTiles(16 if num_tokens <= 16 else 32, 64, 32, 8, 4, 3)
    if num_tokens <= 16:
        return LinearTiles(16, 64, 128, 1, 4, 4)
    if num_tokens <= 64:
        return LinearTiles(32, 64, 128, 8, 4, 3)
    return LinearTiles(128, 128, 64, 8, 8, 3)


@triton.jit(do_not_specialize=["T"])
def _quant_linear_kernel(
    x_ptr,  # [T, K] (A_FP8: e4m3 bytes)
    xs_ptr,  # A_FP8: [T, ceil(K / ACT_GROUP)] float32 scales of x's groups
    w_ptr,  # [N, K] weight data (`_weight_tile`)
    s_ptr,  # its scales (read only when quantized)
    b_ptr,  # [N] bias (read only with HAS_BIAS)
    y_ptr,  # [T, N]
    T,
    N,
    K,
    stride_xt,
    stride_xst,
    stride_we,  # unused: one weight, no stack dim (kept for `WeightArgs.kernel_args`)
    stride_wn,
    stride_se,
    stride_sn,
    stride_sk,
    stride_yt,
    HAS_BIAS: tl.constexpr,
    A_FP8: tl.constexpr,  # W8A8 (`moe_gemm.launch_fused_moe`'s act_fp8)
    WFMT: tl.constexpr,
    K_UNIFORM: tl.constexpr,
    BN_Q: tl.constexpr,
    BK_Q: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    pid_m, pid_n = _tile_ids(tl.cdiv(T, BLOCK_M), N, BLOCK_N, GROUP_M)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < T
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < N
    offs_k = tl.arange(0, BLOCK_K)
    x_ptrs = x_ptr + rows.to(tl.int64)[:, None] * stride_xt + offs_k[None, :]  # [M, K]
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        a = tl.load(x_ptrs, mask=row_ok[:, None] & (offs_k < K - k0)[None, :], other=0)
        w = _weight_tile(
            w_ptr, s_ptr, offs_n, n_ok, k0, K, stride_wn, stride_sn, stride_sk,
            WFMT, K_UNIFORM, BN_Q, BK_Q, BLOCK_K, BLOCK_N,
        )  # fmt: skip
        if A_FP8:  # one K tile lies in one activation group and one weight block
            a = a.to(tl.float8e4nv, bitcast=True)
            a_s = tl.load(xs_ptr + rows * stride_xst + k0 // ACT_GROUP, mask=row_ok, other=0)
            w_s = _row_scales(s_ptr, offs_n, n_ok, k0, stride_sn, stride_sk, BN_Q, BK_Q)
            acc += tl.dot(a, w) * (a_s[:, None] * w_s[None, :])
        else:
            acc = tl.dot(a, w.to(a.dtype), acc=acc, input_precision=DOT_PRECISION)
        x_ptrs += BLOCK_K
    if HAS_BIAS:
        acc += tl.load(b_ptr + offs_n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    y_ptrs = y_ptr + rows.to(tl.int64)[:, None] * stride_yt + offs_n[None, :]
    tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=row_ok[:, None] & n_ok[None, :])


def linear_quant_ref(
    x: torch.Tensor, w: QuantizedWeight | torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """The reference: ``w`` dequantized (float32 exactly, then x's dtype), then ``F.linear``."""
    dense = w.dequantize(x.dtype) if isinstance(w, QuantizedWeight) else w.to(x.dtype)
    return F.linear(x, dense, bias)


def linear_quant_triton(
    x: torch.Tensor,
    w: QuantizedWeight | torch.Tensor,
    bias: torch.Tensor | None = None,
    tiles: LinearTiles | None = None,
    fp8_bits: bool | None = None,
    act_fp8: bool = False,
) -> torch.Tensor:
    """``y [T, N] = x [T, K] @ W^T + bias``, in x's dtype (more leading dims of x are tokens
    too), reading ``w`` (a `QuantizedWeight` ``[N, K]``, FP8 blocks or MXFP4; or a dense
    ``[N, K]`` tensor in x's dtype) in its stored layout. ``bias [N]`` is added in float32
    before the cast. ``tiles`` and ``fp8_bits`` (`moe_gemm.weight_args`) override the tile and
    FP8 decode choices (tests, benchmarks). ``act_fp8``: W8A8 for float8_e4m3fn weights on GPUs
    with FP8 tensor cores: x quantized to e4m3 per 128 values along K, FP8 dots
    (`moe_gemm.launch_fused_moe`; not the dequantize-then-GEMM math)."""
    require_triton("linear_backend", x.device)
    if x.dim() == 0 or len(w.shape) != 2 or w.shape[1] != x.shape[-1]:
        raise ValueError(
            f"linear_quant_triton: x {tuple(x.shape)} and w {tuple(w.shape)} must be [..., K] "
            "and [N, K]"
        )
    if x.dim() != 2:  # leading dims are tokens
        y = linear_quant_triton(x.reshape(-1, x.shape[-1]), w, bias, tiles, fp8_bits, act_fp8)
        return y.view(*x.shape[:-1], w.shape[0])
    check_quantized_weights(x, w)
    N, K = w.shape
    if bias is not None and (bias.shape != (N,) or bias.device != x.device):
        raise ValueError(
            f"linear_quant_triton: bias {tuple(bias.shape)} on {bias.device} must be [{N}] on "
            f"{x.device}"
        )
    if act_fp8 and x.device.type == "cuda" and not fp8_decodes_natively(x.device):
        raise ValueError("linear_quant_triton: act_fp8 (W8A8) needs FP8 tensor cores (sm >= 89)")
    if x.stride(-1) != 1:
        x = x.contiguous()
    T = x.shape[0]
    y = torch.empty(T, N, dtype=x.dtype, device=x.device)
    if T == 0:
        return y
    if tiles is None:
        tiles = linear_tiles(T, x.dtype)
    wa = weight_args(w, tiles.block_k, fp8_bits, act_fp8)
    a, a_s = _activations(x, act_fp8)
    grid = (triton.cdiv(T, tiles.block_m) * triton.cdiv(N, tiles.block_n),)
    _quant_linear_kernel[grid](
        a, a_s, wa.data, wa.scale, wa.data if bias is None else bias, y, T, N, K, a.stride(0),
        a_s.stride(0), *wa.kernel_args(), y.stride(0), HAS_BIAS=bias is not None, A_FP8=act_fp8,
        BLOCK_M=tiles.block_m,
        BLOCK_N=tiles.block_n, GROUP_M=tiles.group_m, DOT_PRECISION=dot_precision(x.dtype),
        num_warps=tiles.num_warps, num_stages=tiles.num_stages, **wa.constexprs(),
    )  # fmt: skip
    return y
