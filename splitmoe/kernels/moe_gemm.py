"""Fused MoE grouped GEMMs in Triton: the kernels behind ``fused_moe(..., backend="triton")``.

The (token, expert) pairs are first sorted by local expert and each expert's run is padded to a
multiple of ``BLOCK_M`` (`sort_by_expert`), so every ``BLOCK_M`` rows belong to one expert. Then:

* ``_gate_up_kernel``: ``h = silu(x @ W_gate^T) * (x @ W_up^T)`` for a ``[BLOCK_M, BLOCK_N]``
  tile of the ``[pairs, I]`` intermediate. Rows gather their token from ``x`` directly (no
  permuted copy of x); gate and up accumulate side by side and SiLU-and-multiply runs on the
  float32 accumulators, so the ``[pairs, 2I]`` pre-activation never reaches memory.
* ``_down_kernel``: ``y = (h @ W_down^T) * router_weight`` per pair, stored at the pair's
  unsorted index, so the per-token sum is a plain ``y.view(N, k, H).sum(1)`` (deterministic).

Both use a 1-D grid over (row block, column block) with grouped ordering (``GROUP_M`` row
blocks share each column sweep, so a weight tile stays in L2 while several row blocks use it).
Row blocks past the padded total and those of skipped slots have expert -1 and exit at once.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from splitmoe.kernels.expert_sort import ExpertSort, check_moe_inputs, sort_by_expert
from splitmoe.kernels.triton_utils import dot_precision, require_triton


@dataclass(frozen=True)
class MoeTiles:
    block_m: int  # rows (token, expert pairs) per tile; each expert's run is padded to it
    block_n: int
    block_k: int
    group_m: int  # row blocks per column sweep (L2 reuse of weight tiles)
    num_warps: int
    num_stages: int


def moe_tiles(num_pairs: int, num_experts: int, dtype: torch.dtype) -> MoeTiles:
    """H100 tiles by rows per expert. Few rows per expert (decode): 16-row tiles, the GEMMs read
    each expert's weights once and are bandwidth-bound. Many: 128 x 128 tensor-core tiles with
    L2-friendly ordering."""
    per_expert = num_pairs / max(1, num_experts)
    if dtype == torch.float32:  # exact fp32 dots run on CUDA cores: half the K depth per stage
        if per_expert <= 16:
            return MoeTiles(
                block_m=16, block_n=64, block_k=64, group_m=1, num_warps=4, num_stages=3
            )
        return MoeTiles(block_m=32, block_n=64, block_k=32, group_m=8, num_warps=4, num_stages=3)
    if per_expert <= 16:
        return MoeTiles(block_m=16, block_n=64, block_k=128, group_m=1, num_warps=4, num_stages=4)
    if per_expert <= 64:
        return MoeTiles(block_m=32, block_n=64, block_k=128, group_m=8, num_warps=4, num_stages=3)
    # Swept on an H100 (bf16, Qwen3-30B-A3B and DeepSeek-V3 layers, 1024-8192 tokens): 128 x 128
    # beat 64 x 128 by 13-27% from 4096 tokens on, and tied it at 1024.
    return MoeTiles(block_m=128, block_n=128, block_k=64, group_m=8, num_warps=8, num_stages=3)


@triton.jit
def _tile_ids(num_m_blocks, N, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):
    pid = tl.program_id(0)
    num_n = tl.cdiv(N, BLOCK_N)
    per_group = GROUP_M * num_n
    first_m = (pid // per_group) * GROUP_M
    group_size = tl.minimum(num_m_blocks - first_m, GROUP_M)
    pid_m = first_m + (pid % per_group) % group_size
    pid_n = (pid % per_group) // group_size
    return pid_m, pid_n


# Integers that change from call to call are not specialised: Triton would compile a variant for
# each value class (1, multiples of 16, others), each a second or more of JIT in a live request.
@triton.jit(do_not_specialize=["num_pairs", "num_m_blocks"])
def _gate_up_kernel(
    x_ptr,  # [N, H]
    w_ptr,  # [E, 2I, H]: gate rows, then up rows
    b_ptr,  # [E, 2I] gate then up biases (read only with HAS_BIAS)
    h_ptr,  # [R, I]: sorted rows
    sorted_ids_ptr,  # [R] int32 pair index (num_pairs = padding)
    block_expert_ptr,  # [R // BLOCK_M] int32 (-1: nothing to do)
    num_pairs,
    num_m_blocks,
    H,
    I,
    stride_xt,
    stride_we,
    stride_wn,
    stride_ht,
    stride_be,
    swiglu_limit,
    swiglu_alpha,
    TOP_K: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    CLAMPED: tl.constexpr,  # GPT-OSS's clamped SwiGLU instead of SiLU(gate) * up
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    pid_m, pid_n = _tile_ids(num_m_blocks, I, BLOCK_N, GROUP_M)
    expert = tl.load(block_expert_ptr + pid_m).to(tl.int64)
    if expert < 0:
        return
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    pair = tl.load(sorted_ids_ptr + rows)
    row_ok = pair < num_pairs
    token = (pair // TOP_K).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < I
    offs_k = tl.arange(0, BLOCK_K)
    x_ptrs = x_ptr + token[:, None] * stride_xt + offs_k[None, :]  # [M, K]
    g_ptrs = w_ptr + expert * stride_we + offs_n[None, :] * stride_wn + offs_k[:, None]  # [K, N]
    u_ptrs = g_ptrs + I * stride_wn
    gate = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    up = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, H, BLOCK_K):
        k_ok = offs_k < H - k0
        a = tl.load(x_ptrs, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        w_mask = k_ok[:, None] & n_ok[None, :]
        gate = tl.dot(
            a, tl.load(g_ptrs, mask=w_mask, other=0.0), acc=gate, input_precision=DOT_PRECISION
        )
        up = tl.dot(
            a, tl.load(u_ptrs, mask=w_mask, other=0.0), acc=up, input_precision=DOT_PRECISION
        )
        x_ptrs += BLOCK_K
        g_ptrs += BLOCK_K
        u_ptrs += BLOCK_K
    if HAS_BIAS:
        b = b_ptr + expert * stride_be + offs_n
        gate += tl.load(b, mask=n_ok, other=0.0).to(tl.float32)[None, :]
        up += tl.load(b + I, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    if CLAMPED:  # transformers' GptOssExperts._apply_gate
        gate = tl.minimum(gate, swiglu_limit)
        up = tl.minimum(tl.maximum(up, -swiglu_limit), swiglu_limit)
        h = (up + 1) * (gate * tl.sigmoid(gate * swiglu_alpha))
    else:
        h = gate * tl.sigmoid(gate) * up  # SiLU(gate) * up, in float32
    h_ptrs = h_ptr + rows.to(tl.int64)[:, None] * stride_ht + offs_n[None, :]
    tl.store(h_ptrs, h.to(h_ptr.dtype.element_ty), mask=row_ok[:, None] & n_ok[None, :])


@triton.jit(do_not_specialize=["num_pairs", "num_m_blocks"])
def _down_kernel(
    h_ptr,  # [R, I]: sorted rows
    w_ptr,  # [E, H, I]
    b_ptr,  # [E, H] biases (read only with HAS_BIAS)
    y_ptr,  # [N * TOP_K, H]: per pair, unsorted
    router_w_ptr,  # [N * TOP_K]
    sorted_ids_ptr,
    block_expert_ptr,
    num_pairs,
    num_m_blocks,
    H,
    I,
    stride_ht,
    stride_we,
    stride_wn,
    stride_yt,
    stride_be,
    HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    pid_m, pid_n = _tile_ids(num_m_blocks, H, BLOCK_N, GROUP_M)
    expert = tl.load(block_expert_ptr + pid_m).to(tl.int64)
    if expert < 0:
        return
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    pair = tl.load(sorted_ids_ptr + rows)
    row_ok = pair < num_pairs
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < H
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = h_ptr + rows.to(tl.int64)[:, None] * stride_ht + offs_k[None, :]  # [M, K]
    w_ptrs = w_ptr + expert * stride_we + offs_n[None, :] * stride_wn + offs_k[:, None]  # [K, N]
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, I, BLOCK_K):
        k_ok = offs_k < I - k0
        a = tl.load(a_ptrs, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        w = tl.load(w_ptrs, mask=k_ok[:, None] & n_ok[None, :], other=0.0)
        acc = tl.dot(a, w, acc=acc, input_precision=DOT_PRECISION)
        a_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    if HAS_BIAS:
        b = tl.load(b_ptr + expert * stride_be + offs_n, mask=n_ok, other=0.0)
        acc += b.to(tl.float32)[None, :]
    acc *= tl.load(router_w_ptr + pair, mask=row_ok, other=0.0).to(tl.float32)[:, None]
    y_ptrs = y_ptr + pair.to(tl.int64)[:, None] * stride_yt + offs_n[None, :]
    tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=row_ok[:, None] & n_ok[None, :])


def fused_moe_triton(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    expert_ids: torch.Tensor,
    weights: torch.Tensor,
    tiles: MoeTiles | None = None,
    **ffn,
) -> torch.Tensor:
    """Same contract as `fused_moe_ref`; ``tiles`` overrides the tile choice (tests)."""
    require_triton("moe_backend", x.device)
    check_moe_inputs(x, w13, w2, expert_ids, weights)
    return launch_fused_moe(x, w13, w2, expert_ids, weights, tiles, **ffn)


def launch_fused_moe(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    expert_ids: torch.Tensor,
    weights: torch.Tensor,
    tiles: MoeTiles | None = None,
    b13: torch.Tensor | None = None,
    b2: torch.Tensor | None = None,
    swiglu_limit: float | None = None,
    swiglu_alpha: float = 1.702,
) -> torch.Tensor:
    """`fused_moe_triton` for callers that have run `check_moe_inputs` already. ``b13 [E, 2I]``,
    ``b2 [E, H]`` (both or neither) and ``swiglu_limit``: GPT-OSS's experts (`fused_moe_ref`)."""
    if (b13 is None) != (b2 is None):
        raise ValueError("fused_moe: pass both expert biases b13 and b2, or neither")
    if b13 is not None and (b13.stride(-1) != 1 or b2.stride(-1) != 1):
        raise ValueError("fused_moe: expert biases must be contiguous in their last dim")
    N, H = x.shape
    E, two_i, _ = w13.shape
    I = two_i // 2
    k = expert_ids.shape[1]
    if N == 0 or k == 0:
        return torch.zeros_like(x)
    if tiles is None:
        tiles = moe_tiles(N * k, E, x.dtype)
    order: ExpertSort = sort_by_expert(expert_ids, E, tiles.block_m)
    num_m_blocks = order.block_expert.numel()
    h = torch.empty(num_m_blocks * tiles.block_m, I, dtype=x.dtype, device=x.device)
    # Slots served elsewhere (-1) are never written: zeros make them drop out of the sum.
    y = torch.zeros(N * k, H, dtype=x.dtype, device=x.device)
    meta = dict(num_warps=tiles.num_warps, num_stages=tiles.num_stages)
    meta.update(moe_constexprs(x.dtype, tiles))
    grid = (num_m_blocks * triton.cdiv(I, tiles.block_n),)
    _gate_up_kernel[grid](
        x, w13, w13 if b13 is None else b13, h, order.sorted_ids, order.block_expert,
        N * k, num_m_blocks, H, I, x.stride(0), w13.stride(0), w13.stride(1), h.stride(0),
        0 if b13 is None else b13.stride(0),
        0.0 if swiglu_limit is None else float(swiglu_limit), float(swiglu_alpha),
        TOP_K=k, HAS_BIAS=b13 is not None, CLAMPED=swiglu_limit is not None, **meta,
    )  # fmt: skip
    grid = (num_m_blocks * triton.cdiv(H, tiles.block_n),)
    _down_kernel[grid](
        h, w2, w2 if b2 is None else b2, y, weights.reshape(-1), order.sorted_ids,
        order.block_expert, N * k, num_m_blocks, H, I, h.stride(0), w2.stride(0), w2.stride(1),
        y.stride(0), 0 if b2 is None else b2.stride(0), HAS_BIAS=b2 is not None, **meta,
    )  # fmt: skip
    return y.view(N, k, H).sum(1) if k > 1 else y


def moe_constexprs(dtype: torch.dtype, tiles: MoeTiles) -> dict:
    """Compile-time parameters of both kernels but TOP_K (also used by the kernel bench)."""
    return dict(
        BLOCK_M=tiles.block_m, BLOCK_N=tiles.block_n, BLOCK_K=tiles.block_k,
        GROUP_M=tiles.group_m, DOT_PRECISION=dot_precision(dtype),
    )  # fmt: skip
