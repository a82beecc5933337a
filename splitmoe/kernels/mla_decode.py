"""Paged multi-head latent attention, decode rows: a split-KV Triton kernel (absorbed form).

Each cached token is one row of ``Dk = DL + DR`` values (the latent ``c`` of ``DL =
kv_lora_rank``, the rotary key of ``DR = qk_rope_head_dim``) shared by every query head; a
query head's score is ``q_lat . c + q_pe . k_pe`` and its output ``sum p c``
(`splitmoe.kernels.mla_attention`). So a program takes ``BLOCK_H`` heads of one token as the rows
of its tiles and reads each cached row once for all of them: the latent part serves as key and
value (FlashMLA's layout), the rotary part only as key. The latent and rotary dot products are
separate ``tl.dot``s, so neither is padded to the other's width (576 -> 1024 would be).

* ``_mla_decode_kernel``, grid ``(B, cdiv(num_heads, BLOCK_H), num_splits)``: one segment of a
  one-token sequence's context (whole ``BLOCK_N`` tiles, `decode_attention._segment`), its
  normalised output and base-2 log-sum-exp per head, or the output itself with one split.
* the segments are combined by `decode_attention`'s ``_decode_reduce_kernel`` (the same partial
  layout: ``[B, num_heads, splits, DL_PAD]``).

Rows of multi-token sequences go to `splitmoe.kernels.mla_prefill`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from splitmoe.kernels.attention_metadata import AttentionMetadata
from splitmoe.kernels.decode_attention import (
    LOG2E,
    MAX_SPLITS,
    MIN_SPLIT_TOKENS,
    REDUCE_CHUNK,
    _decode_reduce_kernel,
    _segment,
)
from splitmoe.kernels.triton_utils import SUPPORTED_DTYPES, dot_precision, next_pow2, num_sms


@dataclass(frozen=True)
class MlaTiles:
    block_h: int  # query heads per program (the rows of its tiles, with the tokens)
    block_n: int  # cached tokens per tile
    block_q: int  # tokens per program (prefill; 1 for decode)
    num_splits: int  # KV segments per sequence (decode; a power of two)
    num_warps: int
    num_stages: int


def mla_decode_tiles(
    num_decode: int, num_heads: int, max_seq_len: int, dtype: torch.dtype, sms: int
) -> MlaTiles:
    """16 heads x 32 cached tokens per tile in 16 bits (the fp32 accumulator of 16 x 512 latent
    values is 64 registers a thread at 4 warps), 16 tokens in float32 (exact dots). Splits as
    `decode_attention.decode_tiles`: about two programs per SM; none on CPU (``sms=0``)."""
    block_h = min(16, max(16, next_pow2(num_heads)))
    block_n = 16 if dtype == torch.float32 else 32
    splits = 1
    if sms:
        programs = num_decode * triton.cdiv(num_heads, block_h)
        want = (2 * sms) // max(1, programs)
        splits = max(1, min(want, max_seq_len // MIN_SPLIT_TOKENS, MAX_SPLITS))
        splits = 1 << (splits.bit_length() - 1)
    return MlaTiles(block_h, block_n, 1, splits, num_warps=4, num_stages=2)


@triton.jit
def mla_tile(
    acc,  # [M, DL_PAD] float32: unnormalised latent outputs
    l_i,  # [M] float32
    m_i,  # [M] float32 (base-2 logits)
    q_lat,  # [M, DL_PAD]
    q_pe,  # [M, DR_PAD]
    q_pos,  # [M]: each row sees cached tokens at positions <= q_pos
    start,  # first position of this tile
    kv_end,  # positions >= kv_end are never read
    table_ptr,  # this sequence's block-table row
    c_ptr,  # the latent cache
    stride_cb,
    stride_cs,
    qk_scale,  # softmax scale * log2(e)
    BLOCK_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    DL: tl.constexpr,
    DL_PAD: tl.constexpr,
    DR: tl.constexpr,
    DR_PAD: tl.constexpr,
    MASK: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """One tile of cached latent rows folded into the online softmax of ``M`` query rows."""
    offs_n = tl.arange(0, BLOCK_N)
    offs_l = tl.arange(0, DL_PAD)
    offs_r = tl.arange(0, DR_PAD)
    pos = start + offs_n
    in_seq = pos < kv_end
    block = tl.load(table_ptr + pos // BLOCK_SIZE, mask=in_seq, other=0).to(tl.int64)
    row = block * stride_cb + (pos % BLOCK_SIZE) * stride_cs  # [N] int64
    c = tl.load(
        c_ptr + row[:, None] + offs_l[None, :],
        mask=in_seq[:, None] & (offs_l[None, :] < DL),
        other=0.0,
    )  # [N, DL]: keys and values
    k_pe = tl.load(
        c_ptr + row[:, None] + DL + offs_r[None, :],
        mask=in_seq[:, None] & (offs_r[None, :] < DR),
        other=0.0,
    )  # [N, DR]
    s = tl.dot(q_lat, tl.trans(c), input_precision=DOT_PRECISION)
    s += tl.dot(q_pe, tl.trans(k_pe), input_precision=DOT_PRECISION)
    s = s * qk_scale  # [M, N]
    if MASK:
        s = tl.where(pos[None, :] <= q_pos[:, None], s, float("-inf"))
    else:
        s = tl.where(in_seq[None, :], s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    p = tl.math.exp2(s - m_new[:, None])
    alpha = tl.math.exp2(m_i - m_new)
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(c.dtype), c, input_precision=DOT_PRECISION)
    return acc, l_i, m_new


@triton.jit
def load_queries(
    q_ptr, tok, head, row_ok, stride_qt, stride_qh,
    DL: tl.constexpr, DL_PAD: tl.constexpr, DR: tl.constexpr, DR_PAD: tl.constexpr,
):  # fmt: skip
    """Rows ``(tok, head)`` of the absorbed queries, split into latent and rotary parts."""
    offs_l = tl.arange(0, DL_PAD)
    offs_r = tl.arange(0, DR_PAD)
    base = tok.to(tl.int64)[:, None] * stride_qt + head[:, None] * stride_qh
    q_lat = tl.load(
        q_ptr + base + offs_l[None, :], mask=row_ok[:, None] & (offs_l[None, :] < DL), other=0.0
    )
    q_pe = tl.load(
        q_ptr + base + DL + offs_r[None, :],
        mask=row_ok[:, None] & (offs_r[None, :] < DR),
        other=0.0,
    )
    return q_lat, q_pe


@triton.jit(do_not_specialize=["stride_table"])
def _mla_decode_kernel(
    q_ptr,
    c_ptr,
    o_ptr,
    part_o_ptr,  # [B, num_heads, NUM_SPLITS, DL_PAD] float32
    part_lse_ptr,  # [B, num_heads, NUM_SPLITS] float32
    tables_ptr,
    query_start_ptr,
    seq_lens_ptr,
    qk_scale,
    num_heads,
    stride_qt,
    stride_qh,
    stride_ot,
    stride_oh,
    stride_cb,
    stride_cs,
    stride_table,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_N: tl.constexpr,
    DL: tl.constexpr,
    DL_PAD: tl.constexpr,
    DR: tl.constexpr,
    DR_PAD: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    seq = tl.program_id(0)
    head_block = tl.program_id(1)
    split = tl.program_id(2)
    q_start = tl.load(query_start_ptr + seq).to(tl.int64)
    q_len = tl.load(query_start_ptr + seq + 1).to(tl.int64) - q_start
    if q_len != 1:  # multi-token rows belong to the prefill kernel
        return
    seq_len = tl.load(seq_lens_ptr + seq).to(tl.int64)
    start, end, _ = _segment(seq_len, seq_len * 0, split, NUM_SPLITS, BLOCK_N)
    if start >= end:
        return
    head = head_block * BLOCK_H + tl.arange(0, BLOCK_H)  # [H]
    row_ok = head < num_heads
    tok = tl.full([BLOCK_H], 0, tl.int64) + q_start
    q_lat, q_pe = load_queries(
        q_ptr, tok, head, row_ok, stride_qt, stride_qh, DL, DL_PAD, DR, DR_PAD
    )
    q_pos = tl.full([BLOCK_H], 0, tl.int64) + (end - 1)  # every row sees the whole segment

    table_ptr = tables_ptr + seq.to(tl.int64) * stride_table
    acc = tl.zeros([BLOCK_H, DL_PAD], dtype=tl.float32)
    l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
    m_i = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)
    for tile in range(start, end, BLOCK_N):
        acc, l_i, m_i = mla_tile(
            acc, l_i, m_i, q_lat, q_pe, q_pos, tile, end, table_ptr, c_ptr, stride_cb,
            stride_cs, qk_scale, BLOCK_SIZE, BLOCK_N, DL, DL_PAD, DR, DR_PAD, False,
            DOT_PRECISION,
        )  # fmt: skip
    out = acc / l_i[:, None]
    offs_l = tl.arange(0, DL_PAD)
    if NUM_SPLITS == 1:
        o_off = q_start * stride_ot + head[:, None] * stride_oh + offs_l[None, :]
        o_mask = row_ok[:, None] & (offs_l[None, :] < DL)
        tl.store(o_ptr + o_off, out.to(o_ptr.dtype.element_ty), mask=o_mask)
    else:
        part = (seq * num_heads + head) * NUM_SPLITS + split  # [H]
        p_off = part.to(tl.int64)[:, None] * DL_PAD + offs_l[None, :]
        tl.store(part_o_ptr + p_off, out, mask=row_ok[:, None])
        tl.store(part_lse_ptr + part, m_i + tl.math.log2(l_i), mask=row_ok)


def check_mla_inputs(q: torch.Tensor, cache: torch.Tensor, meta: AttentionMetadata) -> None:
    """What the Triton MLA kernels assume beyond the shapes: dtypes, devices and strides."""
    if q.dtype != cache.dtype or q.dtype not in SUPPORTED_DTYPES:
        raise ValueError(
            f"mla_attention: q and the cache must share one of {SUPPORTED_DTYPES}; got "
            f"{q.dtype} and {cache.dtype}"
        )
    if q.stride(-1) != 1 or cache.stride(-1) != 1 or cache.stride(1) != cache.shape[-1]:
        raise ValueError("mla_attention: q and the cache rows must be contiguous")
    if meta.block_tables.dtype != torch.int32:
        raise ValueError("mla_attention: block_tables must be int32")


def mla_decode_attention(
    q: torch.Tensor,
    cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    v_dim: int,
    out: torch.Tensor,
    tiles: MlaTiles | None = None,
) -> None:
    """Writes the latent attention output ``out [T, num_heads, v_dim]`` of every one-token row.
    ``q [T, num_heads, Dk]``; ``cache [blocks, block_size, 1, Dk]``; ``tiles`` overrides the
    choice (tests force splits on CPU)."""
    num_decode = meta.query_lens.count(1)
    if num_decode == 0:
        return
    _, nh, dk = q.shape
    block_size = cache.shape[1]
    if tiles is None:
        sms = num_sms(q.device.index or 0) if q.device.type == "cuda" else 0
        tiles = mla_decode_tiles(num_decode, nh, max(meta.seq_lens_list), q.dtype, sms)
    splits = tiles.num_splits
    if splits & (splits - 1):
        raise ValueError(f"mla_decode_attention: num_splits={splits} must be a power of two")
    B = meta.num_seqs
    consts = mla_constexprs(v_dim, dk - v_dim, q.dtype)
    dl_pad = consts["DL_PAD"]
    if splits > 1:
        part_o = torch.empty(B, nh, splits, dl_pad, dtype=torch.float32, device=q.device)
        part_lse = torch.empty(B, nh, splits, dtype=torch.float32, device=q.device)
    else:
        part_o = part_lse = out  # not written
    grid = (B, triton.cdiv(nh, tiles.block_h), splits)
    _mla_decode_kernel[grid](
        q, cache, out, part_o, part_lse,
        meta.block_tables, meta.query_start_loc, meta.seq_lens,
        scale * LOG2E, nh,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        cache.stride(0), cache.stride(1), meta.block_tables.stride(0),
        BLOCK_SIZE=block_size, BLOCK_H=tiles.block_h, BLOCK_N=tiles.block_n,
        NUM_SPLITS=splits, **consts,
        num_warps=tiles.num_warps, num_stages=tiles.num_stages,
    )  # fmt: skip
    if splits > 1:
        _decode_reduce_kernel[(B, nh)](
            out, part_o, part_lse, meta.query_start_loc, meta.seq_lens,
            meta.seq_lens, 0,  # no sinks (not read), no window
            out.stride(0), out.stride(1),
            HEAD_DIM=v_dim, HEAD_DIM_PAD=dl_pad, BLOCK_N=tiles.block_n, NUM_SPLITS=splits,
            SPLIT_CHUNK=min(splits, REDUCE_CHUNK), num_warps=4,
        )  # fmt: skip


def mla_constexprs(dl: int, dr: int, dtype: torch.dtype) -> dict:
    """The widths and dot precision of the MLA kernels (also used by `scripts/bench_kernels.py`);
    the launchers add the tile sizes."""
    return dict(
        DL=dl, DL_PAD=max(16, next_pow2(dl)), DR=dr, DR_PAD=max(16, next_pow2(dr)),
        DOT_PRECISION=dot_precision(dtype),
    )  # fmt: skip
