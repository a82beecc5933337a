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

Weights are dense tensors or `QuantizedWeight`s kept in their released layout (FP8 blocks,
MXFP4 nibbles); a constexpr ``WFMT`` selects how `_weight_tile` reads a ``[BLOCK_K, BLOCK_N]``
tile: it loads the quantized bytes, dequantizes them in registers to float32 exactly (fp8 value
times its block's scale; fp4 value times ``2 ** (s - 127)``), casts to the activations' dtype,
and the same ``tl.dot`` runs as with dense weights (W8A16 / W4A16). In float32 that is the math
of dequantize-then-`fused_moe_ref`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from splitmoe.kernels.expert_sort import (
    ExpertSort,
    check_moe_inputs,
    check_moe_shapes,
    sort_by_expert,
)
from splitmoe.kernels.quant import MXFP4_GROUP, QuantizedWeight
from splitmoe.kernels.triton_utils import SUPPORTED_DTYPES, dot_precision, require_triton

# `_weight_tile`'s WFMT: how the kernels read a weight tile (`weight_format` picks one).
WFMT_DENSE = tl.constexpr(0)  # x's dtype
WFMT_FP8 = tl.constexpr(1)  # float8 pointer load + convert (CUDA sm >= 89, Triton's interpreter)
WFMT_FP8_BITS = tl.constexpr(2)  # e4m3fn bytes decoded with integer ops (older GPUs)
WFMT_MXFP4 = tl.constexpr(3)  # two e2m1 codes a byte, an e8m0 exponent per 32 values
WFMT_FP8_RAW = tl.constexpr(4)  # W8A8: e4m3 bytes for an FP8 dot, the caller scales the product
# Activation values sharing one FP8 scale in W8A8 (DeepSeek-V3's act_quant block_size).
ACT_GROUP = tl.constexpr(128)


@dataclass(frozen=True)
class MoeTiles:
    block_m: int  # rows (token, expert pairs) per tile; each expert's run is padded to it
    block_n: int
    block_k: int
    group_m: int  # row blocks per column sweep (L2 reuse of weight tiles)
    num_warps: int
    num_stages: int


def moe_tiles(
    num_pairs: int, num_experts: int, dtype: torch.dtype, act_fp8: bool = False
) -> MoeTiles:
    """H100 tiles by rows per expert. Few rows per expert (decode): 16-row tiles, the GEMMs read
    each expert's weights once and are bandwidth-bound. Many: 128 x 128 tensor-core tiles with
    L2-friendly ordering."""
    per_expert = num_pairs / max(1, num_experts)
    if act_fp8 and per_expert > 64:
        # W8A8's gate/up holds two accumulators and two scaled dot results: at 128 x 128 it
        # spills on sm_90 (ptxas, `bench_quant_moe.py --compile-only`); 128 x 64 does not.
        # Not yet swept on a GPU.
        return MoeTiles(block_m=128, block_n=64, block_k=128, group_m=8, num_warps=8, num_stages=3)
    if dtype == torch.float32:  # exact fp32 dots run on CUDA cores: half the K depth per stage
        # two stages, and 32 columns past 16 rows per expert: with the weight-format decode in
        # the kernels, three stages and gate/up's two 32 x 64 accumulators spill a few bytes on
        # sm_90 (ptxas, `bench_kernels.py --compile-only --dtype float32`)
        if per_expert <= 16:
            return MoeTiles(
                block_m=16, block_n=64, block_k=64, group_m=1, num_warps=4, num_stages=2
            )
        return MoeTiles(block_m=32, block_n=32, block_k=32, group_m=8, num_warps=4, num_stages=2)
    if per_expert <= 16:
        return MoeTiles(block_m=16, block_n=64, block_k=128, group_m=1, num_warps=4, num_stages=4)
    if per_expert <= 64:
        return MoeTiles(block_m=32, block_n=64, block_k=128, group_m=8, num_warps=4, num_stages=3)
    # Many rows per expert (prefill): 128 x 128 tiles, which on H100 (bf16, Qwen3-30B-A3B and
    # DeepSeek-V3 layers) beat 64 x 128 from a few thousand tokens on and tie it below.
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


@triton.jit
def _e4m3_bits_to_f32(b):
    """uint8 e4m3fn bytes -> float32 (NaN codes excepted: checkpoints hold none)."""
    b = b.to(tl.int32)
    e = (b >> 3) & 15
    m = b & 7
    normal = (((e + 120) << 23) | (m << 20)).to(tl.float32, bitcast=True)  # 2^(e-7) (1 + m/8)
    v = tl.where(e == 0, m.to(tl.float32) * 0.001953125, normal)  # subnormal: m * 2^-9
    return tl.where((b & 128) != 0, -v, v)


@triton.jit
def _e2m1_to_f32(c):
    """int32 FP4 codes 0..15 -> float32 (`quant.FP4_VALUES`), built as float32 bits."""
    e = (c >> 1) & 3
    m = c & 1
    bits = tl.where(e == 0, m * (126 << 23), ((e + 126) << 23) | (m << 22))
    return (bits | ((c & 8) << 28)).to(tl.float32, bitcast=True)


@triton.jit
def _e8m0_to_f32(s):
    """uint8 e8m0 exponents -> float32 ``2 ** (s - 127)`` exactly (0: the subnormal 2^-127)."""
    s = s.to(tl.int32)
    return tl.where(s == 0, 0x00400000, s << 23).to(tl.float32, bitcast=True)


@triton.jit
def _row_scales(
    s_ptr, rows, n_ok, k0, stride_sn, stride_sk, BN_Q: tl.constexpr, BK_Q: tl.constexpr
):
    """``[BLOCK_N]`` fp8 scales of weight ``rows`` at column ``k0`` (a K tile inside one block)."""
    s_ptrs = s_ptr + (rows // BN_Q) * stride_sn + (k0 // BK_Q) * stride_sk
    return tl.load(s_ptrs, mask=n_ok, other=0)


@triton.jit
def _weight_tile(
    w_ptr,  # this expert's data: [N, K] dense / fp8, [N, K // 2] uint8 mxfp4
    s_ptr,  # this expert's scales (not read when dense)
    rows,  # [BLOCK_N] weight rows of the tile
    n_ok,  # [BLOCK_N] rows in range
    k0,
    K,
    stride_wn,
    stride_sn,
    stride_sk,
    WFMT: tl.constexpr,
    K_UNIFORM: tl.constexpr,  # fp8: BLOCK_K divides bk, so the tile needs one scale per row
    BN_Q: tl.constexpr,  # rows per scale (fp8 bn; 1 for mxfp4)
    BK_Q: tl.constexpr,  # columns per scale (fp8 bk; 32 for mxfp4)
    BLOCK_K: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """The ``[BLOCK_K, BLOCK_N]`` tile ``W[rows, k0:k0 + BLOCK_K]^T``: dense weights as stored,
    quantized ones dequantized to float32 (the caller casts to its dot's dtype)."""
    if WFMT == WFMT_MXFP4:
        offs_b = k0 // 2 + tl.arange(0, BLOCK_K // 2)  # bytes along K
        mask = (offs_b < K // 2)[:, None] & n_ok[None, :]
        b = tl.load(w_ptr + rows[None, :] * stride_wn + offs_b[:, None], mask=mask, other=0)
        b = b.to(tl.int32)  # [BLOCK_K / 2, BLOCK_N]
        s_ptrs = s_ptr + rows[None, :] * stride_sn + (offs_b // (BK_Q // 2))[:, None] * stride_sk
        s = _e8m0_to_f32(tl.load(s_ptrs, mask=mask, other=127))
        lo = _e2m1_to_f32(b & 15) * s  # elements 2j
        hi = _e2m1_to_f32(b >> 4) * s  # elements 2j + 1
        w = tl.reshape(tl.permute(tl.join(lo, hi), (0, 2, 1)), (BLOCK_K, BLOCK_N))
    else:
        offs_k = k0 + tl.arange(0, BLOCK_K)
        mask = (offs_k < K)[:, None] & n_ok[None, :]
        w_ptrs = w_ptr + rows[None, :] * stride_wn + offs_k[:, None]
        if WFMT == WFMT_FP8:
            # no `other=` for float8 (the interpreter cannot cast it): zero the tail after the
            # convert, so that a stray NaN byte past K cannot reach the dot
            w = tl.where(mask, tl.load(w_ptrs, mask=mask).to(tl.float32), 0.0)
        else:
            w = tl.load(w_ptrs, mask=mask, other=0)
        if WFMT == WFMT_FP8_BITS:
            w = _e4m3_bits_to_f32(w)
        if WFMT == WFMT_FP8_RAW:
            w = w.to(tl.float8e4nv, bitcast=True)  # loaded as bytes: `other=0` casts
        elif WFMT != WFMT_DENSE:  # fp8: times its (bn x bk) block's scale
            if K_UNIFORM:
                s = _row_scales(s_ptr, rows, n_ok, k0, stride_sn, stride_sk, BN_Q, BK_Q)
                w = w.to(tl.float32) * s[None, :]
            else:
                srow = rows // BN_Q
                s_ptrs = s_ptr + srow[None, :] * stride_sn + (offs_k // BK_Q)[:, None] * stride_sk
                w = w.to(tl.float32) * tl.load(s_ptrs, mask=mask, other=0)
    return w


# Integers that change from call to call are not specialised: Triton would compile a variant for
# each value class (1, multiples of 16, others), each a second or more of JIT in a live request.
@triton.jit(do_not_specialize=["num_pairs", "num_m_blocks"])
def _gate_up_kernel(
    x_ptr,  # [N, H] (A_FP8: e4m3 bytes)
    xs_ptr,  # A_FP8: [N, ceil(H / ACT_GROUP)] float32 scales of x's groups
    w_ptr,  # [E, 2I, H]: gate rows, then up rows (its data, when quantized: `_weight_tile`)
    s_ptr,  # w's scales (read only when quantized)
    b_ptr,  # [E, 2I] gate then up biases (read only with HAS_BIAS)
    h_ptr,  # [R, I]: sorted rows
    sorted_ids_ptr,  # [R] int32 pair index (num_pairs = padding)
    block_expert_ptr,  # [R // BLOCK_M] int32 (-1: nothing to do)
    num_pairs,
    num_m_blocks,
    H,
    I,
    stride_xt,
    stride_xst,
    stride_we,
    stride_wn,
    stride_se,
    stride_sn,
    stride_sk,
    stride_ht,
    stride_be,
    swiglu_limit,
    swiglu_alpha,
    TOP_K: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    CLAMPED: tl.constexpr,  # GPT-OSS's clamped SwiGLU instead of SiLU(gate) * up
    A_FP8: tl.constexpr,  # W8A8: FP8 activations in groups, FP8 dots (WFMT_FP8_RAW)
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
    w_e = w_ptr + expert * stride_we
    s_e = s_ptr + expert * stride_se
    gate = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    up = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, H, BLOCK_K):
        k_ok = offs_k < H - k0
        a = tl.load(x_ptrs, mask=row_ok[:, None] & k_ok[None, :], other=0)
        g = _weight_tile(
            w_e, s_e, offs_n, n_ok, k0, H, stride_wn, stride_sn, stride_sk,
            WFMT, K_UNIFORM, BN_Q, BK_Q, BLOCK_K, BLOCK_N,
        )  # fmt: skip
        u = _weight_tile(
            w_e, s_e, I + offs_n, n_ok, k0, H, stride_wn, stride_sn, stride_sk,
            WFMT, K_UNIFORM, BN_Q, BK_Q, BLOCK_K, BLOCK_N,
        )  # fmt: skip
        if A_FP8:  # one K tile lies in one activation group and one weight block
            a = a.to(tl.float8e4nv, bitcast=True)
            a_s = tl.load(xs_ptr + token * stride_xst + k0 // ACT_GROUP, mask=row_ok, other=0)
            g_s = _row_scales(s_e, offs_n, n_ok, k0, stride_sn, stride_sk, BN_Q, BK_Q)
            u_s = _row_scales(s_e, I + offs_n, n_ok, k0, stride_sn, stride_sk, BN_Q, BK_Q)
            gate += tl.dot(a, g) * (a_s[:, None] * g_s[None, :])
            up += tl.dot(a, u) * (a_s[:, None] * u_s[None, :])
        else:
            gate = tl.dot(a, g.to(a.dtype), acc=gate, input_precision=DOT_PRECISION)
            up = tl.dot(a, u.to(a.dtype), acc=up, input_precision=DOT_PRECISION)
        x_ptrs += BLOCK_K
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
    h_ptr,  # [R, I]: sorted rows (A_FP8: e4m3 bytes)
    hs_ptr,  # A_FP8: [R, ceil(I / ACT_GROUP)] float32 scales of h's groups
    w_ptr,  # [E, H, I] (its data, when quantized: `_weight_tile`)
    s_ptr,  # w's scales (read only when quantized)
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
    stride_hst,
    stride_we,
    stride_wn,
    stride_se,
    stride_sn,
    stride_sk,
    stride_yt,
    stride_be,
    HAS_BIAS: tl.constexpr,
    A_FP8: tl.constexpr,
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
    w_e = w_ptr + expert * stride_we
    s_e = s_ptr + expert * stride_se
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, I, BLOCK_K):
        k_ok = offs_k < I - k0
        a = tl.load(a_ptrs, mask=row_ok[:, None] & k_ok[None, :], other=0)
        w = _weight_tile(
            w_e, s_e, offs_n, n_ok, k0, I, stride_wn, stride_sn, stride_sk,
            WFMT, K_UNIFORM, BN_Q, BK_Q, BLOCK_K, BLOCK_N,
        )  # fmt: skip
        if A_FP8:
            a = a.to(tl.float8e4nv, bitcast=True)
            a_s = tl.load(hs_ptr + rows * stride_hst + k0 // ACT_GROUP, mask=row_ok, other=0)
            w_s = _row_scales(s_e, offs_n, n_ok, k0, stride_sn, stride_sk, BN_Q, BK_Q)
            acc += tl.dot(a, w) * (a_s[:, None] * w_s[None, :])
        else:
            acc = tl.dot(a, w.to(a.dtype), acc=acc, input_precision=DOT_PRECISION)
        a_ptrs += BLOCK_K
    if HAS_BIAS:
        b = tl.load(b_ptr + expert * stride_be + offs_n, mask=n_ok, other=0.0)
        acc += b.to(tl.float32)[None, :]
    acc *= tl.load(router_w_ptr + pair, mask=row_ok, other=0.0).to(tl.float32)[:, None]
    y_ptrs = y_ptr + pair.to(tl.int64)[:, None] * stride_yt + offs_n[None, :]
    tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=row_ok[:, None] & n_ok[None, :])


@dataclass(frozen=True)
class WeightArgs:
    """How a kernel reads one weight operand (`weight_args`): ``data`` (the dense tensor, or a
    quantized weight's bytes), ``scale`` (``data`` again when dense: never read), the strides of
    both (leading stack dim first; 0 for a single ``[N, K]`` weight), the scale block
    ``(bn, bk)``, the kernels' ``wfmt`` and ``k_uniform`` (one fp8 scale per row of a K tile,
    when ``block_k`` divides bk), and ``block_k`` (the caller's, narrowed to divide bk where it
    can)."""

    data: torch.Tensor
    scale: torch.Tensor
    strides: tuple[int, int]
    scale_strides: tuple[int, int, int]
    block: tuple[int, int]
    wfmt: int
    k_uniform: bool
    block_k: int

    def kernel_args(self) -> tuple:
        """``stride_we, stride_wn, stride_se, stride_sn, stride_sk``."""
        return (*self.strides, *self.scale_strides)

    def constexprs(self) -> dict:
        """The block sizes are compile-time: divisions by them become shifts (128: one kernel
        per scale layout, and released checkpoints use one)."""
        bn, bk = self.block
        return dict(WFMT=self.wfmt, K_UNIFORM=self.k_uniform, BN_Q=bn, BK_Q=bk,
                    BLOCK_K=self.block_k)  # fmt: skip


def fp8_decodes_natively(device: torch.device) -> bool:
    """Whether float8 -> float32 converts in hardware here: CUDA sm >= 89 (Ada, Hopper,
    Blackwell), and Triton's interpreter. Older GPUs decode the e4m3 bits with integer ops."""
    if device.type != "cuda":
        return True
    return torch.cuda.get_device_capability(device) >= (8, 9)


def weight_args(
    w: torch.Tensor | QuantizedWeight,
    block_k: int,
    fp8_bits: bool | None = None,
    act_fp8: bool = False,
) -> WeightArgs:
    """The kernel operands of ``w`` (``[E, N, K]`` or ``[N, K]``, dense or quantized) for a
    GEMM with K tiles of ``block_k``. ``fp8_bits``: decode e4m3 bytes with integer ops instead
    of float8 loads (None: where the device lacks FP8 conversions; tests force both).
    ``act_fp8``: the e4m3 bytes for FP8 dots against FP8 activations (W8A8; `act_quant_fp8`),
    with K tiles inside one activation group and one weight block."""
    if act_fp8:
        return _w8a8_args(w, block_k)
    if not isinstance(w, QuantizedWeight):
        return WeightArgs(
            w, w, (_lead_stride(w), w.stride(-2)), (0, 0, 0), (1, 1), WFMT_DENSE.value, False,
            block_k,
        )  # fmt: skip
    data, scale = w.data, w.scale
    bn, bk = w.block
    strides = (_lead_stride(data), data.stride(-2))
    scale_strides = (_lead_stride(scale), scale.stride(-2), scale.stride(-1))
    if w.fmt == "mxfp4":
        # K tiles of at most 64: at 128, the nibble unpacking of the 16-row decode tile spills
        # on sm_90 (ptxas, `bench_quant_moe.py --compile-only`); at 64 it does not
        return WeightArgs(
            data, scale, strides, scale_strides, (1, MXFP4_GROUP), WFMT_MXFP4.value, False,
            min(max(block_k, 2), 64),
        )  # fmt: skip
    if fp8_bits is None:
        fp8_bits = not fp8_decodes_natively(data.device)
    wfmt = WFMT_FP8.value
    if fp8_bits and data.dtype == torch.float8_e4m3fn:
        data, wfmt = data.view(torch.uint8), WFMT_FP8_BITS.value
    # Narrow the K tile to a power of two dividing bk (>= 16, tl.dot's least): each K tile then
    # has one scale per row, a [BLOCK_N] load instead of a [BLOCK_K, BLOCK_N] gather.
    fit = block_k
    while fit > 16 and bk % fit:
        fit //= 2
    if bk % fit == 0:
        block_k = fit
    return WeightArgs(
        data, scale, strides, scale_strides, (bn, bk), wfmt, bk % block_k == 0, block_k
    )


def _w8a8_args(w, block_k: int) -> WeightArgs:
    if not isinstance(w, QuantizedWeight) or w.fmt != "fp8" or w.data.dtype != torch.float8_e4m3fn:
        raise ValueError(f"act_fp8 (W8A8) needs float8_e4m3fn weights, got {_describe(w)}")
    bn, bk = w.block
    fit = block_k
    while fit > 16 and (bk % fit or ACT_GROUP.value % fit):
        fit //= 2
    if bk % fit or ACT_GROUP.value % fit:
        raise ValueError(
            f"act_fp8 (W8A8): fp8 blocks {bn}x{bk} split no K tile of 16 or more that also "
            f"divides the activation group {ACT_GROUP.value}; run without act_fp8"
        )
    data, scale = w.data.view(torch.uint8), w.scale
    return WeightArgs(
        data, scale, (_lead_stride(data), data.stride(-2)),
        (_lead_stride(scale), scale.stride(-2), scale.stride(-1)), (bn, bk),
        WFMT_FP8_RAW.value, True, fit,
    )  # fmt: skip


def _describe(w) -> str:
    if isinstance(w, QuantizedWeight):
        return f"{w.fmt} {w.data.dtype}"
    return f"dense {w.dtype}"


def act_quant_fp8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``x [T, K]`` -> ``(q [T, K]`` float8_e4m3fn, ``scale [T, ceil(K / 128)]`` float32): each
    group of `ACT_GROUP` values along K divided by its largest magnitude / 448 (DeepSeek-V3's
    ``act_quant``), so that ``q * scale`` is x to e4m3's 3 mantissa bits."""
    T, K = x.shape
    g = ACT_GROUP.value
    G = -(-K // g)
    xf = F.pad(x.float(), (0, G * g - K)).view(T, G, g)
    scale = xf.abs().amax(-1).clamp(min=1e-12) / 448.0  # [T, G]; an all-zero group stays 0
    q = (xf / scale[..., None]).view(T, G * g)[:, :K].to(torch.float8_e4m3fn)
    return q.contiguous(), scale


def _lead_stride(t: torch.Tensor) -> int:
    return t.stride(0) if t.dim() == 3 else 0  # a single [N, K] weight: no stack dim


def check_quantized_weights(x: torch.Tensor, *ws) -> None:
    """What the kernels need of weights that may be `QuantizedWeight`s: dense ones in x's dtype,
    every weight's last dim contiguous and on x's device."""
    if x.dtype not in SUPPORTED_DTYPES:
        raise ValueError(f"x must be float16/bfloat16/float32, got {x.dtype}")
    for w in ws:
        data = w.data if isinstance(w, QuantizedWeight) else w
        if not isinstance(w, QuantizedWeight) and w.dtype != x.dtype:
            raise ValueError(f"a dense weight must have x's dtype {x.dtype}, got {w.dtype}")
        if data.stride(-1) != 1:
            raise ValueError(f"weights must be contiguous in their last dim, got {data.stride()}")
        scale = w.scale if isinstance(w, QuantizedWeight) else data
        if data.device != x.device or scale.device != x.device:
            raise ValueError(f"weights must be on x's device {x.device}, got {data.device}")


def fused_moe_triton(
    x: torch.Tensor,
    w13: torch.Tensor | QuantizedWeight,
    w2: torch.Tensor | QuantizedWeight,
    expert_ids: torch.Tensor,
    weights: torch.Tensor,
    tiles: MoeTiles | None = None,
    fp8_bits: bool | None = None,
    act_fp8: bool = False,
    **ffn,
) -> torch.Tensor:
    """Same contract as `fused_moe_ref`, with dense or `QuantizedWeight` experts; ``tiles`` and
    ``fp8_bits`` (`weight_args`) override the tile and FP8 decode choices (tests); ``act_fp8``:
    W8A8 (`launch_fused_moe`)."""
    require_triton("moe_backend", x.device)
    if isinstance(w13, QuantizedWeight) or isinstance(w2, QuantizedWeight):
        check_quantized_moe_inputs(x, w13, w2, expert_ids, weights)
    else:
        check_moe_inputs(x, w13, w2, expert_ids, weights)
    return launch_fused_moe(
        x, w13, w2, expert_ids, weights, tiles, fp8_bits=fp8_bits, act_fp8=act_fp8, **ffn
    )


def check_quantized_moe_inputs(x, w13, w2, expert_ids, weights) -> None:
    """`check_moe_inputs` for experts of which one or both are `QuantizedWeight`s."""
    check_moe_shapes(x, w13, w2, expert_ids, weights)
    check_quantized_weights(x, w13, w2)
    if expert_ids.dtype.is_floating_point or expert_ids.dtype == torch.bool:
        raise ValueError(f"fused_moe: expert_ids must be integers, got {expert_ids.dtype}")
    if not weights.dtype.is_floating_point:
        raise ValueError(f"fused_moe: weights must be floating point, got {weights.dtype}")
    if x.stride(-1) != 1:
        raise ValueError(f"fused_moe: x must be contiguous in its last dim, got {x.stride()}")
    for name, t in (("expert_ids", expert_ids), ("weights", weights)):
        if t.device != x.device:
            raise ValueError(f"fused_moe: {name} is on {t.device}, x on {x.device}")


def launch_fused_moe(
    x: torch.Tensor,
    w13: torch.Tensor | QuantizedWeight,
    w2: torch.Tensor | QuantizedWeight,
    expert_ids: torch.Tensor,
    weights: torch.Tensor,
    tiles: MoeTiles | None = None,
    b13: torch.Tensor | None = None,
    b2: torch.Tensor | None = None,
    swiglu_limit: float | None = None,
    swiglu_alpha: float = 1.702,
    fp8_bits: bool | None = None,
    act_fp8: bool = False,
) -> torch.Tensor:
    """`fused_moe_triton` for callers that have run `check_moe_inputs` (dense weights) or
    `check_quantized_moe_inputs` already. ``w13 [E, 2I, H]`` and ``w2 [E, H, I]`` are dense
    tensors in x's dtype or `QuantizedWeight`s of those logical shapes (FP8 blocks: W8A16;
    MXFP4: W4A16), dequantized tile by tile in registers. ``b13 [E, 2I]``, ``b2 [E, H]`` (both
    or neither) and ``swiglu_limit``: GPT-OSS's experts (`fused_moe_ref`).

    ``act_fp8`` (W8A8, as DeepSeek-V3's inference runs; float8_e4m3fn experts on GPUs with FP8
    tensor cores, sm >= 89): x, and the intermediate between the GEMMs, are quantized to e4m3
    in groups of 128 along K (`act_quant_fp8`), and each K tile is one FP8 dot scaled by its
    activation group's and weight block's scales. Not the dequantize-then-GEMM math: the
    activations lose all but 3 mantissa bits."""
    if (b13 is None) != (b2 is None):
        raise ValueError("fused_moe: pass both expert biases b13 and b2, or neither")
    if b13 is not None and (b13.stride(-1) != 1 or b2.stride(-1) != 1):
        raise ValueError("fused_moe: expert biases must be contiguous in their last dim")
    if act_fp8 and x.device.type == "cuda" and not fp8_decodes_natively(x.device):
        raise ValueError("fused_moe: act_fp8 (W8A8) needs FP8 tensor cores (CUDA sm >= 89)")
    N, H = x.shape
    E, two_i, _ = w13.shape
    I = two_i // 2
    k = expert_ids.shape[1]
    if N == 0 or k == 0:
        return torch.zeros_like(x)
    if tiles is None:
        tiles = moe_tiles(N * k, E, x.dtype, act_fp8)
    order: ExpertSort = sort_by_expert(expert_ids, E, tiles.block_m)
    num_m_blocks = order.block_expert.numel()
    h = torch.empty(num_m_blocks * tiles.block_m, I, dtype=x.dtype, device=x.device)
    # Slots served elsewhere (-1) are never written: zeros make them drop out of the sum.
    y = torch.zeros(N * k, H, dtype=x.dtype, device=x.device)
    meta = dict(num_warps=tiles.num_warps, num_stages=tiles.num_stages)
    meta.update(moe_constexprs(x.dtype, tiles), A_FP8=act_fp8)
    wa = weight_args(w13, tiles.block_k, fp8_bits, act_fp8)
    a, a_s = _activations(x, act_fp8)
    grid = (num_m_blocks * triton.cdiv(I, tiles.block_n),)
    _gate_up_kernel[grid](
        a, a_s, wa.data, wa.scale, wa.data if b13 is None else b13, h, order.sorted_ids,
        order.block_expert, N * k, num_m_blocks, H, I, a.stride(0), a_s.stride(0),
        *wa.kernel_args(), h.stride(0), 0 if b13 is None else b13.stride(0),
        0.0 if swiglu_limit is None else float(swiglu_limit), float(swiglu_alpha),
        TOP_K=k, HAS_BIAS=b13 is not None, CLAMPED=swiglu_limit is not None,
        **dict(meta, **wa.constexprs()),
    )  # fmt: skip
    wa = weight_args(w2, tiles.block_k, fp8_bits, act_fp8)
    # W8A8: h makes a round trip through memory to be quantized (a fused epilogue would not)
    a, a_s = _activations(h, act_fp8)
    grid = (num_m_blocks * triton.cdiv(H, tiles.block_n),)
    _down_kernel[grid](
        a, a_s, wa.data, wa.scale, wa.data if b2 is None else b2, y, weights.reshape(-1),
        order.sorted_ids, order.block_expert, N * k, num_m_blocks, H, I, a.stride(0),
        a_s.stride(0), *wa.kernel_args(), y.stride(0), 0 if b2 is None else b2.stride(0),
        HAS_BIAS=b2 is not None, **dict(meta, **wa.constexprs()),
    )  # fmt: skip
    return y.view(N, k, H).sum(1) if k > 1 else y


def _activations(a: torch.Tensor, act_fp8: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """A GEMM's left operand and its group scales: ``a`` itself (the scales never read), or
    `act_quant_fp8`'s e4m3 bytes (loaded as uint8: `other=0` casts) and scales."""
    if not act_fp8:
        return a, a
    q, scale = act_quant_fp8(a)
    return q.view(torch.uint8), scale


def moe_constexprs(dtype: torch.dtype, tiles: MoeTiles) -> dict:
    """Compile-time parameters of both kernels but TOP_K, for dense weights (a quantized
    weight's: `WeightArgs.constexprs`). Also used by the kernel bench."""
    return dict(
        BLOCK_M=tiles.block_m, BLOCK_N=tiles.block_n, BLOCK_K=tiles.block_k,
        GROUP_M=tiles.group_m, DOT_PRECISION=dot_precision(dtype),
        WFMT=WFMT_DENSE.value, K_UNIFORM=False, BN_Q=1, BK_Q=1, A_FP8=False,
    )  # fmt: skip
