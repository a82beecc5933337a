"""Decode attention over the paged KV cache: split-KV ("flash-decoding") Triton kernels.

Every sequence with exactly one query token attends to its whole context. At small batch a
program per (sequence, KV head) would leave most of the GPU idle on long contexts, so each
sequence's context is cut into ``num_splits`` segments (whole ``BLOCK_N`` tiles):

* ``_decode_kernel``, grid ``(B, num_kv_heads, num_splits)``: one segment, all ``GROUP`` query
  heads of one KV head as the rows of one tile (padded to 16 for ``tl.dot``), so each K/V tile is
  read once per GQA group. Writes the segment's normalised output and its log-sum-exp (base 2).
* ``_decode_reduce_kernel``, grid ``(B, num_heads)``: rescales the segments by
  ``exp2(lse_i - max lse)`` and sums them. With one split the first kernel writes the output
  directly and this one does not run.

Its reference is `paged_attention_ref`; rows with more than one query token go to
`prefill_attention`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from splitmoe.kernels.attention_metadata import AttentionMetadata, check_paged_inputs
from splitmoe.kernels.attention_tile import attend_tile
from splitmoe.kernels.triton_utils import (
    dot_precision,
    next_pow2,
    num_sms,
    require_triton,
)

LOG2E = 1.4426950408889634
MAX_SPLITS = 64
REDUCE_CHUNK = 16  # segments the reduction holds in registers at once
MIN_SPLIT_TOKENS = 128  # below this a segment's fixed cost outweighs the parallelism it adds


@dataclass(frozen=True)
class DecodeTiles:
    block_n: int  # keys per tile
    num_splits: int  # KV segments per sequence (a power of two)
    num_warps: int
    num_stages: int


def decode_tiles(
    num_decode: int,
    num_kv_heads: int,
    max_seq_len: int,
    head_dim: int,
    dtype: torch.dtype,
    sms: int,
) -> DecodeTiles:
    """About 2 programs per SM: H100 (132 SMs), 4 KV heads: batch 1 -> 64 splits at 32K context
    (512 keys each), 8 at 1K (128 keys each); batch 8 -> 8 splits; batch 64 (256 programs) and
    up -> no split.

    ``sms=0`` (CPU: the Triton interpreter runs programs one after another) never splits.
    """
    # 64 keys x 128 dims per K/V tile in 16 bits; wider heads halve it. float32 runs exact
    # ("ieee") dots on CUDA cores and spills registers above 16 keys (ptxas, sm_90).
    block_n = 16 if dtype == torch.float32 else 64 if head_dim <= 128 else 32
    splits = 1
    if sms:
        want = (2 * sms) // max(1, num_decode * num_kv_heads)
        splits = max(1, min(want, max_seq_len // MIN_SPLIT_TOKENS, MAX_SPLITS))
        splits = 1 << (splits.bit_length() - 1)  # powers of two: few compiled variants
    return DecodeTiles(block_n=block_n, num_splits=splits, num_warps=4, num_stages=3)


@triton.jit
def _first_key(seq_len, window, BLOCK_N: tl.constexpr):
    """The first key the segments cover: 0, or with a window (``window > 0``) the start of the
    tile holding the window's first key (earlier tiles are never read)."""
    lo = seq_len * 0
    if window > 0:
        lo = (tl.maximum(seq_len - window, 0) // BLOCK_N) * BLOCK_N
    return lo


@triton.jit
def _segment(seq_len, lo, split, NUM_SPLITS: tl.constexpr, BLOCK_N: tl.constexpr):
    """Keys ``[start, end)`` of segment ``split`` of the keys ``[lo, seq_len)``: whole tiles,
    the last segment shorter."""
    chunk = tl.cdiv(tl.cdiv(seq_len - lo, NUM_SPLITS), BLOCK_N) * BLOCK_N
    start = lo + split * chunk
    return start, tl.minimum(start + chunk, seq_len), chunk


@triton.jit(do_not_specialize=["stride_table"])  # the block table widens as contexts grow
def _decode_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    o_ptr,
    part_o_ptr,  # [B, num_heads, NUM_SPLITS, HEAD_DIM_PAD] float32
    part_lse_ptr,  # [B, num_heads, NUM_SPLITS] float32
    tables_ptr,
    query_start_ptr,
    seq_lens_ptr,
    sinks_ptr,  # [num_heads] float32 (read only with SINKS)
    qk_scale,
    window,  # keys a query sees (0: all)
    stride_qt,
    stride_qh,
    stride_ot,
    stride_oh,
    stride_kb,
    stride_ks,
    stride_kh,
    stride_table,
    BLOCK_SIZE: tl.constexpr,
    GROUP: tl.constexpr,
    BLOCK_H: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    BLOCK_N: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    SINKS: tl.constexpr = False,
    WINDOW: tl.constexpr = False,
):
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    q_start = tl.load(query_start_ptr + seq).to(tl.int64)
    q_len = tl.load(query_start_ptr + seq + 1).to(tl.int64) - q_start
    if q_len != 1:  # multi-token rows belong to the prefill kernel
        return
    seq_len = tl.load(seq_lens_ptr + seq).to(tl.int64)
    lo = _first_key(seq_len, window, BLOCK_N)
    start, end, _ = _segment(seq_len, lo, split, NUM_SPLITS, BLOCK_N)
    if start >= end:
        return

    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    head = kv_head * GROUP + offs_h  # [H]
    row_ok = offs_h < GROUP
    d_ok = offs_d[None, :] < HEAD_DIM
    q_off = q_start * stride_qt + head[:, None] * stride_qh + offs_d[None, :]
    q = tl.load(q_ptr + q_off, mask=row_ok[:, None] & d_ok, other=0.0)  # [H, D]
    q_pos = tl.full([BLOCK_H], 0, tl.int64) + (end - 1)  # every row sees keys < end
    win_lo = q_pos * 0 + (seq_len - window)  # (WINDOW) and none before the window
    kv_lo = seq_len * 0
    if WINDOW:
        kv_lo = seq_len - window

    table_ptr = tables_ptr + seq.to(tl.int64) * stride_table
    kv_head_off = kv_head.to(tl.int64) * stride_kh
    acc = tl.zeros([BLOCK_H, HEAD_DIM_PAD], dtype=tl.float32)
    l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
    m_i = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)
    for tile in range(start, end, BLOCK_N):
        acc, l_i, m_i = attend_tile(
            acc, l_i, m_i, q, q_pos, win_lo, tile, kv_lo, end, table_ptr, k_ptr, v_ptr,
            kv_head_off, stride_kb, stride_ks, qk_scale, BLOCK_SIZE, BLOCK_N, HEAD_DIM,
            HEAD_DIM_PAD, True, DOT_PRECISION, WINDOW,
        )  # fmt: skip
    out = acc / l_i[:, None]

    if NUM_SPLITS == 1:
        if SINKS:  # exp(sink) joins the denominator (base 2, relative to the row max)
            sink = tl.load(sinks_ptr + head, mask=row_ok, other=0.0).to(tl.float32)
            out = acc / (l_i + tl.math.exp2(sink * 1.4426950408889634 - m_i))[:, None]
        o_off = q_start * stride_ot + head[:, None] * stride_oh + offs_d[None, :]
        tl.store(o_ptr + o_off, out.to(o_ptr.dtype.element_ty), mask=row_ok[:, None] & d_ok)
    else:
        part = (seq * (GROUP * tl.num_programs(1)) + head) * NUM_SPLITS + split  # [H]
        p_off = part.to(tl.int64)[:, None] * HEAD_DIM_PAD + offs_d[None, :]
        tl.store(part_o_ptr + p_off, out, mask=row_ok[:, None])
        tl.store(part_lse_ptr + part, m_i + tl.math.log2(l_i), mask=row_ok)


@triton.jit
def _decode_reduce_kernel(
    o_ptr,
    part_o_ptr,
    part_lse_ptr,
    query_start_ptr,
    seq_lens_ptr,
    sinks_ptr,
    window,
    stride_ot,
    stride_oh,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    BLOCK_N: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    SPLIT_CHUNK: tl.constexpr,
    SINKS: tl.constexpr = False,
):
    seq = tl.program_id(0)
    head = tl.program_id(1)
    q_start = tl.load(query_start_ptr + seq).to(tl.int64)
    q_len = tl.load(query_start_ptr + seq + 1).to(tl.int64) - q_start
    if q_len != 1:
        return
    seq_len = tl.load(seq_lens_ptr + seq).to(tl.int64)
    lo = _first_key(seq_len, window, BLOCK_N)
    _, _, chunk = _segment(seq_len, lo, 0, NUM_SPLITS, BLOCK_N)
    used = tl.cdiv(seq_len - lo, chunk)  # segments that hold keys
    base = (seq * tl.num_programs(1) + head).to(tl.int64) * NUM_SPLITS
    offs_s = tl.arange(0, NUM_SPLITS)
    lse = tl.load(part_lse_ptr + base + offs_s, mask=offs_s < used, other=float("-inf"))  # [S]
    top = tl.max(lse, 0)
    total = tl.sum(tl.math.exp2(lse - top), 0)  # empty segments weigh 0
    if SINKS:
        total += tl.math.exp2(tl.load(sinks_ptr + head).to(tl.float32) * 1.4426950408889634 - top)
    # The [S, D] partial outputs a chunk of segments at a time: all 64 at once spill registers.
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    acc = tl.zeros([HEAD_DIM_PAD], dtype=tl.float32)
    for first in tl.static_range(0, NUM_SPLITS, SPLIT_CHUNK):
        offs_c = first + tl.arange(0, SPLIT_CHUNK)
        c_ok = offs_c < used
        lse_c = tl.load(part_lse_ptr + base + offs_c, mask=c_ok, other=float("-inf"))
        w = tl.math.exp2(lse_c - top)  # [C]
        parts = tl.load(
            part_o_ptr + (base + offs_c)[:, None] * HEAD_DIM_PAD + offs_d[None, :],
            mask=c_ok[:, None],
            other=0.0,
        )  # [C, D]
        acc += tl.sum(parts * w[:, None], 0)
    out = acc / total
    tl.store(
        o_ptr + q_start * stride_ot + head * stride_oh + offs_d,
        out.to(o_ptr.dtype.element_ty),
        mask=offs_d < HEAD_DIM,
    )


def decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    out: torch.Tensor | None = None,
    tiles: DecodeTiles | None = None,
    sinks: torch.Tensor | None = None,
    window: int | None = None,
) -> torch.Tensor:
    """Writes the attention output of every sequence with ``query_lens[i] == 1`` into ``out``.

    q ``[T, num_heads, head_dim]``; caches ``[num_blocks, block_size, num_kv_heads, head_dim]``;
    out like q (allocated when None; rows of multi-token sequences are left untouched).
    ``tiles`` overrides the tile and split choice (tests use it to force splits on CPU).
    ``sinks [num_heads]`` / ``window``: see `paged_attention`.
    """
    require_triton("attention_backend", q.device)
    check_paged_inputs(q, k_cache, v_cache, meta, out)
    if out is None:
        out = torch.empty_like(q)
    launch_decode(q, k_cache, v_cache, meta, scale, out, tiles, sinks, window)
    return out


def launch_decode(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    out: torch.Tensor,
    tiles: DecodeTiles | None = None,
    sinks: torch.Tensor | None = None,
    window: int | None = None,
) -> None:
    """`decode_attention` for callers that have run `check_paged_inputs` already."""
    num_decode = meta.query_lens.count(1)
    if num_decode == 0:
        return
    _, nh, d = q.shape
    _, block_size, nkv, _ = k_cache.shape
    group = nh // nkv
    if tiles is None:
        sms = num_sms(q.device.index or 0) if q.device.type == "cuda" else 0
        ctx = max(meta.seq_lens_list)
        tiles = decode_tiles(num_decode, nkv, min(ctx, window or ctx), d, q.dtype, sms)
    splits = tiles.num_splits
    if splits & (splits - 1):
        raise ValueError(f"decode_attention: num_splits={splits} must be a power of two")
    B = meta.num_seqs
    consts = decode_constexprs(block_size, group, d, q.dtype, tiles)
    d_pad = consts["HEAD_DIM_PAD"]
    if splits > 1:
        part_o = torch.empty(B, nh, splits, d_pad, dtype=torch.float32, device=q.device)
        part_lse = torch.empty(B, nh, splits, dtype=torch.float32, device=q.device)
    else:
        part_o = part_lse = out  # not written
    sinks_arg = meta.seq_lens if sinks is None else sinks.float().contiguous()  # (not read)
    _decode_kernel[(B, nkv, splits)](
        q, k_cache, v_cache, out, part_o, part_lse,
        meta.block_tables, meta.query_start_loc, meta.seq_lens, sinks_arg,
        scale * LOG2E, window or 0,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), meta.block_tables.stride(0),
        num_warps=tiles.num_warps, num_stages=tiles.num_stages, **consts,
        SINKS=sinks is not None, WINDOW=window is not None,
    )  # fmt: skip
    if splits > 1:
        _decode_reduce_kernel[(B, nh)](
            out, part_o, part_lse, meta.query_start_loc, meta.seq_lens, sinks_arg, window or 0,
            out.stride(0), out.stride(1),
            HEAD_DIM=d, HEAD_DIM_PAD=d_pad, BLOCK_N=tiles.block_n, NUM_SPLITS=splits,
            SPLIT_CHUNK=min(splits, REDUCE_CHUNK), SINKS=sinks is not None, num_warps=4,
        )  # fmt: skip


def decode_constexprs(
    block_size: int, group: int, head_dim: int, dtype: torch.dtype, tiles: DecodeTiles
) -> dict:
    """The kernels' compile-time parameters (also used by `scripts/bench_kernels.py`)."""
    return dict(
        BLOCK_SIZE=block_size, GROUP=group, BLOCK_H=max(16, next_pow2(group)),
        HEAD_DIM=head_dim, HEAD_DIM_PAD=max(16, next_pow2(head_dim)), BLOCK_N=tiles.block_n,
        NUM_SPLITS=tiles.num_splits, DOT_PRECISION=dot_precision(dtype),
    )  # fmt: skip
