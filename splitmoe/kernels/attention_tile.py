"""The inner step shared by the prefill and decode attention kernels: one K/V tile, read through
the block table, folded into an online softmax (FlashAttention-2 style, base-2 exponentials).

Imported only when a Triton backend runs (it imports triton).
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def attend_tile(
    acc,  # [M, D] float32: unnormalised output rows
    l_i,  # [M] float32: softmax denominators
    m_i,  # [M] float32: running row maxima (base-2 logits)
    q,  # [M, D]: query rows, in the cache dtype
    q_pos,  # [M]: position of each query row; it sees keys k_pos <= q_pos
    win_lo,  # [M]: with WINDOW, each row sees only keys k_pos >= win_lo
    start,  # first key position of this tile
    kv_lo,  # keys at k_pos < kv_lo are never read (before every row's window: maybe freed)
    kv_end,  # keys at k_pos >= kv_end are never read
    table_ptr,  # this sequence's row of the block table (int32 block ids)
    k_ptr,
    v_ptr,
    kv_head_off,  # int64 offset of this KV head inside a cache slot
    stride_kb,
    stride_ks,
    qk_scale,  # softmax scale * log2(e)
    BLOCK_SIZE: tl.constexpr,  # tokens per KV cache block
    BLOCK_N: tl.constexpr,  # keys per tile
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    MASK: tl.constexpr,  # False for tiles every row sees entirely
    DOT_PRECISION: tl.constexpr,
    WINDOW: tl.constexpr = False,  # a sliding window (win_lo): a tile may hide a whole row
):
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    k_pos = start + offs_n  # [N]
    in_seq = (k_pos < kv_end) & (k_pos >= kv_lo)
    # Block ids are int32 in the table; offsets into a pool of >2^31 elements need int64.
    block = tl.load(table_ptr + k_pos // BLOCK_SIZE, mask=in_seq, other=0).to(tl.int64)
    slot = block * stride_kb + (k_pos % BLOCK_SIZE) * stride_ks + kv_head_off  # [N] int64
    kv_mask = in_seq[:, None] & (offs_d[None, :] < HEAD_DIM)
    k = tl.load(k_ptr + slot[:, None] + offs_d[None, :], mask=kv_mask, other=0.0)  # [N, D]
    v = tl.load(v_ptr + slot[:, None] + offs_d[None, :], mask=kv_mask, other=0.0)  # [N, D]
    s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale  # [M, N]
    if MASK:
        seen = k_pos[None, :] <= q_pos[:, None]
        if WINDOW:
            seen = seen & (k_pos[None, :] >= win_lo[:, None])
        s = tl.where(seen, s, float("-inf"))
    # Without a window every row has seen at least one key by the time a tile can mask a whole
    # row, so m_new is finite and no NaN appears (callers order their tiles to guarantee it).
    # A window's first tile may hide a row that has seen nothing yet: its max stays -inf, and
    # the exponentials use 0 in its place (p and alpha 0, acc and l_i stay 0).
    m_new = tl.maximum(m_i, tl.max(s, 1))
    m_use = m_new
    if WINDOW:
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
    p = tl.math.exp2(s - m_use[:, None])
    alpha = tl.math.exp2(m_i - m_use)
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
    return acc, l_i, m_new
