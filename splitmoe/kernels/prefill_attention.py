"""Prefill/extend attention over the paged KV cache: a FlashAttention-2 Triton kernel.

Every sequence with more than one query token (a fresh prompt, a prefill chunk, or new tokens
extending a cached prefix) attends causally to all its earlier tokens, read through its block
table. Its reference is `paged_attention_ref`; decode rows go to `decode_attention`.

Grid ``(q tiles, num_kv_heads)``. A program owns ``BLOCK_Q`` query tokens of one sequence times
all ``GROUP`` query heads of one KV head, folded into ``BLOCK_M = BLOCK_Q * GROUP_PAD`` rows of
one tile, so each K/V tile is loaded once for the whole GQA group. Programs find their sequence
by binary search over ``query_start_loc`` (vLLM's unified-attention numbering: tile ``i`` of
sequence ``s`` is program ``query_start_loc[s] // BLOCK_Q + s + i``), so the launch needs no
host-side tile list: ``T // BLOCK_Q + B`` programs cover any batch; the spare ones exit.

The key loop runs in two parts: tiles entirely before the program's first query token, with no
mask, then the diagonal tiles with the causal mask. Within a sequence the programs run from the
last query tile (the most keys) to the first, so the long ones do not form the tail of the grid.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from splitmoe.kernels.attention_metadata import AttentionMetadata, check_paged_inputs
from splitmoe.kernels.attention_tile import attend_tile
from splitmoe.kernels.decode_attention import LOG2E
from splitmoe.kernels.triton_utils import dot_precision, next_pow2, require_triton


@dataclass(frozen=True)
class PrefillTiles:
    block_m: int  # query rows per program (tokens x padded GQA group)
    block_n: int  # keys per tile
    num_warps: int
    num_stages: int


def prefill_tiles(
    head_dim: int, group: int, max_query_len: int, dtype: torch.dtype
) -> PrefillTiles:
    """H100 starting points (FlashAttention-2's Triton settings): 128 x 64 tiles and 8 warps for
    16-bit head_dim <= 128; 64-row tiles when chunks are short or heads are wide. float32 runs
    exact ("ieee") dots on CUDA cores: smaller tiles, or the accumulators spill (ptxas, sm_90)."""
    rows = next_pow2(group) * next_pow2(max_query_len)
    if dtype == torch.float32:
        return PrefillTiles(block_m=32, block_n=16, num_warps=4, num_stages=2)
    if head_dim > 128:
        return PrefillTiles(block_m=32, block_n=16, num_warps=4, num_stages=2)
    if rows <= 64:
        return PrefillTiles(block_m=64, block_n=64, num_warps=4, num_stages=3)
    return PrefillTiles(block_m=128, block_n=64, num_warps=8, num_stages=3)


@triton.jit
def _find_seq(query_start_ptr, pid, num_seqs, BLOCK_Q: tl.constexpr):
    """Largest ``s`` with ``query_start[s] // BLOCK_Q + s <= pid``."""
    lo = 0
    hi = num_seqs
    while lo < hi:
        mid = (lo + hi) // 2
        if tl.load(query_start_ptr + mid) // BLOCK_Q + mid <= pid:
            lo = mid + 1
        else:
            hi = mid
    return lo - 1


@triton.jit
def query_tile(query_start_ptr, seq_lens_ptr, pid, num_seqs, BLOCK_Q: tl.constexpr):
    """Program ``pid``'s share of the grid (shared with `splitmoe.kernels.mla_prefill`): its
    sequence, where that sequence's query tokens start and how many there are, which
    ``BLOCK_Q`` tile of them is the program's (a sequence's last, longest tiles start first),
    the sequence's length and the tokens cached before this step, and whether the program has
    work (one-token rows belong to the decode kernel; spare programs past the last tile exit)."""
    seq = _find_seq(query_start_ptr, pid, num_seqs, BLOCK_Q)
    q_start = tl.load(query_start_ptr + seq).to(tl.int64)
    q_len = tl.load(query_start_ptr + seq + 1).to(tl.int64) - q_start
    num_tiles = tl.cdiv(q_len, BLOCK_Q)
    local = pid - (q_start // BLOCK_Q + seq)
    active = (q_len > 1) & (local < num_tiles)
    seq_len = tl.load(seq_lens_ptr + seq).to(tl.int64)
    return seq, q_start, q_len, num_tiles - 1 - local, seq_len, seq_len - q_len, active


# Per-step integers are not specialised (see moe_gemm.py): one compiled variant per tile choice.
@triton.jit(do_not_specialize=["num_seqs", "stride_table"])
def _prefill_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    o_ptr,
    tables_ptr,
    query_start_ptr,
    seq_lens_ptr,
    sinks_ptr,  # [num_heads] float32 (read only with SINKS)
    qk_scale,
    window,  # keys a query sees (0: all)
    num_seqs,
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
    GROUP_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_N: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    SINKS: tl.constexpr = False,
    WINDOW: tl.constexpr = False,
):
    BLOCK_M: tl.constexpr = BLOCK_Q * GROUP_PAD
    pid = tl.program_id(0)
    kv_head = tl.program_id(1)
    seq, q_start, q_len, q_tile, seq_len, prefix, active = query_tile(
        query_start_ptr, seq_lens_ptr, pid, num_seqs, BLOCK_Q
    )
    if not active:
        return

    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    tok = q_tile * BLOCK_Q + offs_m // GROUP_PAD  # [M] token index within the chunk
    head = kv_head * GROUP + offs_m % GROUP_PAD  # [M] query head
    row_ok = (tok < q_len) & (offs_m % GROUP_PAD < GROUP)
    q_off = (q_start + tok)[:, None] * stride_qt + head[:, None] * stride_qh + offs_d[None, :]
    d_ok = offs_d[None, :] < HEAD_DIM
    q = tl.load(q_ptr + q_off, mask=row_ok[:, None] & d_ok, other=0.0)  # [M, D]
    q_pos = prefix + tok  # [M]

    table_ptr = tables_ptr + seq.to(tl.int64) * stride_table
    kv_head_off = kv_head.to(tl.int64) * stride_kh
    acc = tl.zeros([BLOCK_M, HEAD_DIM_PAD], dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)

    first = prefix + q_tile * BLOCK_Q  # position of the program's first query token
    last = tl.minimum(first + BLOCK_Q, seq_len)  # one past its last
    win_lo = q_pos - window + 1  # (WINDOW) each row's first visible key
    kv_lo = first * 0
    if WINDOW:
        kv_lo = first - window + 1  # no row sees a key before it
    if WINDOW:  # the tiles from the first row's window on, all masked
        lo = (tl.maximum(first - window + 1, 0) // BLOCK_N) * BLOCK_N
        for start in range(lo, last, BLOCK_N):
            acc, l_i, m_i = attend_tile(
                acc, l_i, m_i, q, q_pos, win_lo, start, kv_lo, seq_len, table_ptr, k_ptr, v_ptr,
                kv_head_off, stride_kb, stride_ks, qk_scale, BLOCK_SIZE, BLOCK_N, HEAD_DIM,
                HEAD_DIM_PAD, True, DOT_PRECISION, True,
            )  # fmt: skip
    else:
        full_end = (first // BLOCK_N) * BLOCK_N  # keys before here are visible to every row
        for start in range(0, full_end, BLOCK_N):
            acc, l_i, m_i = attend_tile(
                acc, l_i, m_i, q, q_pos, win_lo, start, kv_lo, seq_len, table_ptr, k_ptr, v_ptr,
                kv_head_off, stride_kb, stride_ks, qk_scale, BLOCK_SIZE, BLOCK_N, HEAD_DIM,
                HEAD_DIM_PAD, False, DOT_PRECISION,
            )  # fmt: skip
        for start in range(full_end, last, BLOCK_N):
            acc, l_i, m_i = attend_tile(
                acc, l_i, m_i, q, q_pos, win_lo, start, kv_lo, seq_len, table_ptr, k_ptr, v_ptr,
                kv_head_off, stride_kb, stride_ks, qk_scale, BLOCK_SIZE, BLOCK_N, HEAD_DIM,
                HEAD_DIM_PAD, True, DOT_PRECISION,
            )  # fmt: skip

    if SINKS:  # exp(sink) joins the denominator (base 2, relative to the row max)
        sink = tl.load(sinks_ptr + head, mask=row_ok, other=0.0).to(tl.float32)
        l_i += tl.math.exp2(sink * 1.4426950408889634 - m_i)
    out = acc / l_i[:, None]
    o_off = (q_start + tok)[:, None] * stride_ot + head[:, None] * stride_oh + offs_d[None, :]
    tl.store(o_ptr + o_off, out.to(o_ptr.dtype.element_ty), mask=row_ok[:, None] & d_ok)


def prefill_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    out: torch.Tensor | None = None,
    tiles: PrefillTiles | None = None,
    sinks: torch.Tensor | None = None,
    window: int | None = None,
) -> torch.Tensor:
    """Writes the attention output of every sequence with ``query_lens[i] > 1`` into ``out``.

    q ``[T, num_heads, head_dim]``; caches ``[num_blocks, block_size, num_kv_heads, head_dim]``;
    out like q (allocated when None; rows of one-token sequences are left untouched).
    ``tiles`` overrides the tile choice (tests use it to cross many tiles on tiny shapes).
    ``sinks [num_heads]`` / ``window``: see `paged_attention`.
    """
    require_triton("attention_backend", q.device)
    check_paged_inputs(q, k_cache, v_cache, meta, out)
    if out is None:
        out = torch.empty_like(q)
    launch_prefill(q, k_cache, v_cache, meta, scale, out, tiles, sinks, window)
    return out


def launch_prefill(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    out: torch.Tensor,
    tiles: PrefillTiles | None = None,
    sinks: torch.Tensor | None = None,
    window: int | None = None,
) -> None:
    """`prefill_attention` for callers that have run `check_paged_inputs` already."""
    T, nh, d = q.shape
    _, block_size, nkv, _ = k_cache.shape
    group = nh // nkv
    if T == 0 or max(meta.query_lens, default=0) <= 1:
        return
    if tiles is None:
        tiles = prefill_tiles(d, group, max(meta.query_lens), q.dtype)
    consts = prefill_constexprs(block_size, group, d, q.dtype, tiles)
    grid = (T // consts["BLOCK_Q"] + meta.num_seqs, nkv)
    _prefill_kernel[grid](
        q, k_cache, v_cache, out,
        meta.block_tables, meta.query_start_loc, meta.seq_lens,
        meta.seq_lens if sinks is None else sinks.float().contiguous(),  # (not read)
        scale * LOG2E, window or 0, meta.num_seqs,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), meta.block_tables.stride(0),
        num_warps=tiles.num_warps, num_stages=tiles.num_stages, **consts,
        SINKS=sinks is not None, WINDOW=window is not None,
    )  # fmt: skip


def prefill_constexprs(
    block_size: int, group: int, head_dim: int, dtype: torch.dtype, tiles: PrefillTiles
) -> dict:
    """The kernel's compile-time parameters (also used by `scripts/bench_kernels.py`)."""
    group_pad = next_pow2(group)
    return dict(
        BLOCK_SIZE=block_size, GROUP=group, GROUP_PAD=group_pad,
        HEAD_DIM=head_dim, HEAD_DIM_PAD=max(16, next_pow2(head_dim)),
        BLOCK_Q=max(1, tiles.block_m // group_pad), BLOCK_N=tiles.block_n,
        DOT_PRECISION=dot_precision(dtype),
    )  # fmt: skip
