"""Paged multi-head latent attention, prefill/extend rows: a FlashAttention-2 style Triton
kernel in the absorbed form (`splitmoe.kernels.mla_decode` explains the layout and its tile).

Grid ``(T // BLOCK_Q + B, cdiv(num_heads, BLOCK_H))``, numbered as `prefill_attention`'s (a
program finds its sequence by binary search over ``query_start_loc``): a program owns
``BLOCK_Q`` tokens of one multi-token sequence times ``BLOCK_H`` heads, folded into the rows of
its tiles, so each cached latent row is read once for all of them. Keys before the program's
first token are read without the causal mask, the diagonal tiles with it.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from splitmoe.kernels.attention_metadata import AttentionMetadata
from splitmoe.kernels.decode_attention import LOG2E
from splitmoe.kernels.mla_decode import MlaTiles, load_queries, mla_constexprs, mla_tile
from splitmoe.kernels.prefill_attention import query_tile


def mla_prefill_tiles(num_heads: int, dtype: torch.dtype) -> MlaTiles:
    """16 heads x 2 tokens = 32 rows x 32 cached tokens in 16 bits (the 32 x 512 float32
    accumulator is 64 registers a thread at 8 warps); 16 x 1 x 16 in float32."""
    if dtype == torch.float32:
        return MlaTiles(block_h=16, block_n=16, block_q=1, num_splits=1, num_warps=4, num_stages=1)
    return MlaTiles(block_h=16, block_n=32, block_q=2, num_splits=1, num_warps=8, num_stages=2)


@triton.jit(do_not_specialize=["num_seqs", "stride_table"])
def _mla_prefill_kernel(
    q_ptr,
    c_ptr,
    o_ptr,
    tables_ptr,
    query_start_ptr,
    seq_lens_ptr,
    qk_scale,
    num_seqs,
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
    BLOCK_Q: tl.constexpr,
    BLOCK_N: tl.constexpr,
    DL: tl.constexpr,
    DL_PAD: tl.constexpr,
    DR: tl.constexpr,
    DR_PAD: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    BLOCK_M: tl.constexpr = BLOCK_Q * BLOCK_H
    pid = tl.program_id(0)
    head_block = tl.program_id(1)
    seq, q_start, q_len, q_tile, seq_len, prefix, active = query_tile(
        query_start_ptr, seq_lens_ptr, pid, num_seqs, BLOCK_Q
    )
    if not active:  # decode rows, spare programs
        return

    offs_m = tl.arange(0, BLOCK_M)
    tok = q_tile * BLOCK_Q + offs_m // BLOCK_H  # [M] within the chunk
    head = head_block * BLOCK_H + offs_m % BLOCK_H  # [M]
    row_ok = (tok < q_len) & (head < num_heads)
    q_lat, q_pe = load_queries(
        q_ptr, q_start + tok, head, row_ok, stride_qt, stride_qh, DL, DL_PAD, DR, DR_PAD
    )
    q_pos = prefix + tok

    table_ptr = tables_ptr + seq.to(tl.int64) * stride_table
    acc = tl.zeros([BLOCK_M, DL_PAD], dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    first = prefix + q_tile * BLOCK_Q
    last = tl.minimum(first + BLOCK_Q, seq_len)
    full_end = (first // BLOCK_N) * BLOCK_N  # every row sees the keys before here
    for start in range(0, full_end, BLOCK_N):
        acc, l_i, m_i = mla_tile(
            acc, l_i, m_i, q_lat, q_pe, q_pos, start, seq_len, table_ptr, c_ptr, stride_cb,
            stride_cs, qk_scale, BLOCK_SIZE, BLOCK_N, DL, DL_PAD, DR, DR_PAD, False,
            DOT_PRECISION,
        )  # fmt: skip
    for start in range(full_end, last, BLOCK_N):
        acc, l_i, m_i = mla_tile(
            acc, l_i, m_i, q_lat, q_pe, q_pos, start, seq_len, table_ptr, c_ptr, stride_cb,
            stride_cs, qk_scale, BLOCK_SIZE, BLOCK_N, DL, DL_PAD, DR, DR_PAD, True,
            DOT_PRECISION,
        )  # fmt: skip
    out = acc / l_i[:, None]
    offs_l = tl.arange(0, DL_PAD)
    o_off = (q_start + tok)[:, None] * stride_ot + head[:, None] * stride_oh + offs_l[None, :]
    tl.store(
        o_ptr + o_off,
        out.to(o_ptr.dtype.element_ty),
        mask=row_ok[:, None] & (offs_l[None, :] < DL),
    )


def mla_prefill_attention(
    q: torch.Tensor,
    cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    v_dim: int,
    out: torch.Tensor,
    tiles: MlaTiles | None = None,
) -> None:
    """Writes the latent attention output ``out [T, num_heads, v_dim]`` of every row of a
    multi-token sequence (`mla_decode.mla_decode_attention` for the shapes)."""
    T, nh, dk = q.shape
    if T == 0 or max(meta.query_lens, default=0) <= 1:
        return
    if tiles is None:
        tiles = mla_prefill_tiles(nh, q.dtype)
    grid = (T // tiles.block_q + meta.num_seqs, triton.cdiv(nh, tiles.block_h))
    _mla_prefill_kernel[grid](
        q, cache, out,
        meta.block_tables, meta.query_start_loc, meta.seq_lens,
        scale * LOG2E, meta.num_seqs, nh,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        cache.stride(0), cache.stride(1), meta.block_tables.stride(0),
        BLOCK_SIZE=cache.shape[1], BLOCK_H=tiles.block_h, BLOCK_Q=tiles.block_q,
        BLOCK_N=tiles.block_n, **mla_constexprs(v_dim, dk - v_dim, q.dtype),
        num_warps=tiles.num_warps, num_stages=tiles.num_stages,
    )  # fmt: skip
