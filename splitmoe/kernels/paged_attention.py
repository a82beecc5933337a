"""Attention over a paged KV cache: the public entry, its metadata, and the PyTorch reference.

Layout: the KV pool of one layer is ``k_cache, v_cache: [num_blocks, block_size, num_kv_heads,
head_dim]``; sequence ``i`` owns the blocks ``block_tables[i, :ceil(seq_lens[i] / block_size)]``.
A step's queries are packed: sequence ``i`` contributes ``query_lens[i]`` consecutive tokens, the
last ``query_lens[i]`` of its ``seq_lens[i]`` tokens (a prefill chunk, an extension of a cached
prefix, or one decode token), and each attends causally to every earlier token of its sequence.

Backends: ``"torch"`` runs `paged_attention_ref` (on CPU the fast path too: the decode rows by
the native kernel reading the cache in place, `attention_cpu`, or by SDPA on their K/V gathered
by whole blocks, whichever measured faster; one SDPA call for the prompt chunks);
``"triton"`` sends one-token rows to the split-KV decode kernel (`decode_attention`) and longer
rows to the FlashAttention prefill/extend kernel (`prefill_attention`), both of which read K/V
through the block table.

Two GPT-OSS options, in every backend: ``window`` (a sliding window: a query at position p sees
only keys p - window < k <= p, transformers' ``sliding_window_overlay``; blocks wholly before it
are never read, so they may have been freed and their table entries point anywhere) and
``sinks [num_heads]`` (a learned logit per head in the softmax's denominator: the weights are
``exp(s_j) / (exp(sink) + sum_i exp(s_i))``, the sink's own share dropped). The reference runs
the sink as one more key whose score is the sink and whose value is zero (a zero key, the sink in
the additive mask), so SDPA still does the work.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from splitmoe.kernels import attention_cpu
from splitmoe.kernels.attention_metadata import AttentionMetadata, check_paged_inputs
from splitmoe.kernels.cpu_choice import Candidates, KernelChoice, Trial, class_middles, pow2_bucket


@dataclass(frozen=True)
class DecodePlan:
    """How the reference reads the cache for the one-token rows of a step (the same in every
    layer): ``rows [Bd]`` their query rows (None when they are all of ``q``, in order),
    ``blocks [Bd * nblk]`` the cache blocks of each row in order, ``L`` keys per row (whole
    blocks), ``mask [Bd, 1, 1, L]`` 0 for a key of the sequence, -inf past its end (and, with a
    window, before it: each row's blocks then start at its window's first block); ``spans [Bd,
    2]`` the same as each row's first and end key of those ``L``."""

    rows: torch.Tensor | None
    blocks: torch.Tensor
    length: int
    mask: torch.Tensor
    spans: torch.Tensor


def _additive_mask(allowed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """0 where ``allowed``, -inf elsewhere (SDPA's additive form: faster than a boolean mask)."""
    mask = torch.zeros(allowed.shape, dtype=dtype, device=allowed.device)
    return mask.masked_fill_(~allowed, float("-inf"))


def _gather_keys(
    k_cache: torch.Tensor, v_cache: torch.Tensor, blocks: torch.Tensor, length: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V of ``blocks`` as ``[B, num_kv_heads, length, head_dim]``: one ``index_select``
    of whole blocks each on the pool (as fast as one of every token's slot, with 1/block_size
    as many indices). The copy is a large part of decode attention's time on CPU, and SDPA
    reading the pool through the block table instead would need a kernel of its own."""
    nkv, d = k_cache.shape[-2:]
    k = k_cache.index_select(0, blocks).view(-1, length, nkv, d)
    v = v_cache.index_select(0, blocks).view(-1, length, nkv, d)
    return k.transpose(1, 2), v.transpose(1, 2)


def _derived(meta: AttentionMetadata, key: tuple, build):
    """``build(meta)``, computed by the first layer that asks and kept in ``meta.derived``."""
    if key not in meta.derived:
        meta.derived[key] = build(meta)
    return meta.derived[key]


def decode_plan(
    meta: AttentionMetadata, block_size: int, dtype: torch.dtype, window: int | None = None
) -> DecodePlan | None:
    """The `DecodePlan` of ``meta`` (None without one-token rows), built once per step (and
    window)."""
    key = ("decode", block_size, dtype, window)
    return _derived(meta, key, lambda m: _decode_plan(m, block_size, dtype, window))


def _decode_plan(
    meta: AttentionMetadata, block_size: int, dtype: torch.dtype, window: int | None = None
) -> DecodePlan | None:
    decode = [i for i, n in enumerate(meta.query_lens) if n == 1]
    plan = None
    if decode:
        dev = meta.seq_lens.device
        everything = len(decode) == len(meta.query_lens)  # a pure decode step
        idx = None if everything else torch.tensor(decode, device=dev)
        rows = None if everything else meta.query_start_loc[idx]
        nblk = -(-max(meta.seq_lens_list[i] for i in decode) // block_size)
        tables = meta.block_tables[:, :nblk] if everything else meta.block_tables[idx, :nblk]
        lens = meta.seq_lens if everything else meta.seq_lens[idx]
        kpos = torch.arange(nblk * block_size, device=dev)[None, :]  # [1, L]
        start = torch.zeros_like(lens)  # [Bd] position of each row's first key in the plan
        nw = _window_blocks(nblk, block_size, window)
        if nw is not None:  # only the blocks from each row's window's first on
            first = ((lens - window).clamp(min=0) // block_size)[:, None]  # [Bd, 1]
            cols = (first + torch.arange(nw, device=dev)[None, :]).clamp(max=nblk - 1)
            tables = tables.gather(1, cols)  # [Bd, nw]
            kpos = first * block_size + torch.arange(nw * block_size, device=dev)[None, :]
            start = first[:, 0] * block_size
            nblk = nw
        L = nblk * block_size
        seen = kpos < lens[:, None]  # [Bd, L]
        if window is not None:
            seen &= kpos >= lens[:, None] - window
        mask = _additive_mask(seen, dtype)[:, None, None, :]
        blocks = tables.reshape(-1).long()  # [Bd * nblk]
        lo = (lens - window).clamp(min=0) - start if window is not None else start
        spans = torch.stack([lo, lens - start], 1).long()  # [Bd, 2]
        plan = DecodePlan(rows=rows, blocks=blocks, length=L, mask=mask, spans=spans)
    return plan


def _window_blocks(nblk: int, block_size: int, window: int | None) -> int | None:
    """Blocks per row a decode plan reads when a window is shorter than its rows (of
    ``nblk`` blocks): from each row's window's first, ``(window - 1) // bs + 2`` of them at most;
    None: all ``nblk``."""
    if window is not None and window < (nblk - 1) * block_size:
        return min(nblk, (window - 1) // block_size + 2)
    return None


def store_kv(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slots: torch.Tensor,
) -> None:
    """Writes new keys/values ``[T, num_kv_heads, head_dim]`` into their cache slots."""
    nkv, d = k_cache.shape[-2:]
    k_cache.view(-1, nkv, d).index_copy_(0, slots, k)
    v_cache.view(-1, nkv, d).index_copy_(0, slots, v)


@dataclass(frozen=True)
class PrefillPlan:
    """The rows of a step's multi-token sequences (prompt chunks) as one padded batch, built once
    per step: ``rows [Bp * Q]`` the packed query row of each (sequence, position) (padding
    repeats a real row), ``kept`` the padded positions that are real and ``out_rows`` their query
    rows, ``blocks [Bp * nblk]`` the cache blocks of each sequence, ``mask [Bp, 1, Q, L]`` 0
    where a query may attend a key (causal within its sequence), -inf elsewhere."""

    rows: torch.Tensor
    kept: torch.Tensor
    out_rows: torch.Tensor
    blocks: torch.Tensor
    queries: int
    length: int
    mask: torch.Tensor


# Padding the chunks into one batch costs memory ~ Bp x heads x Q x L scores: above this many
# elements, or when padding multiplies the work by more than PREFILL_MAX_PADDING, the reference
# loops over sequences instead.
PREFILL_BATCH_ELEMENTS = 1 << 22
PREFILL_MAX_PADDING = 2.0


def prefill_plan(
    meta: AttentionMetadata,
    block_size: int,
    dtype: torch.dtype,
    heads: int = 1,
    window: int | None = None,
) -> PrefillPlan | None:
    """The `PrefillPlan` of ``meta`` for ``heads`` query heads (None: no multi-token rows, or
    too much padding), built once per step (and window)."""
    key = ("prefill", block_size, dtype, window)  # one model per step: the heads never vary
    return _derived(meta, key, lambda m: _prefill_plan(m, block_size, dtype, heads, window))


def _prefill_plan(
    meta: AttentionMetadata,
    block_size: int,
    dtype: torch.dtype,
    heads: int,
    window: int | None = None,
) -> PrefillPlan | None:
    seqs = [i for i, n in enumerate(meta.query_lens) if n > 1]
    plan = None
    if seqs:
        qlens = [meta.query_lens[i] for i in seqs]
        ctxs = [meta.seq_lens_list[i] for i in seqs]
        Q = max(qlens)
        nblk = -(-max(ctxs) // block_size)
        L = nblk * block_size
        work = sum(n * c for n, c in zip(qlens, ctxs))
        padded = len(seqs) * Q * L
        if padded <= PREFILL_MAX_PADDING * work and padded * heads <= PREFILL_BATCH_ELEMENTS:
            dev = meta.seq_lens.device
            idx = torch.tensor(seqs, device=dev)
            starts = meta.query_start_loc[idx]  # [Bp]
            n = torch.tensor(qlens, device=dev)[:, None]  # [Bp, 1]
            c = torch.tensor(ctxs, device=dev)[:, None]
            t = torch.arange(Q, device=dev)[None, :]  # [1, Q]
            valid = t < n  # [Bp, Q]
            rows = starts[:, None] + torch.where(valid, t, 0)
            blocks = meta.block_tables[idx, :nblk].reshape(-1).long()  # [Bp * nblk]
            qpos = c - n + t  # [Bp, Q] position of each query in its sequence
            kpos = torch.arange(L, device=dev)[None, None, :]
            # padding query rows may see key 0, so that their (discarded) softmax stays finite
            allowed = kpos <= qpos[:, :, None]
            if window is not None:
                allowed &= kpos > qpos[:, :, None] - window
            allowed |= (kpos == 0) & ~valid[:, :, None]
            mask = _additive_mask(allowed, dtype)[:, None]  # [Bp, 1, Q, L]
            kept = valid.view(-1).nonzero().view(-1)
            rows = rows.view(-1)
            plan = PrefillPlan(
                rows=rows,
                kept=kept,
                out_rows=rows.index_select(0, kept),
                blocks=blocks,
                queries=Q,
                length=L,
                mask=mask,
            )
    return plan


def _batched_prefill(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    plan: PrefillPlan,
    scale: float,
    out: torch.Tensor,
    sinks: torch.Tensor | None = None,
) -> None:
    """Attention of every prompt chunk of a step in one SDPA call (see `PrefillPlan`), GQA by
    SDPA's head groups (``enable_gqa``): as fast as folding a group's heads into the query rows,
    with a mask ``g`` times smaller."""
    T, nh, d = q.shape
    Bp, Q, L = plan.mask.shape[0], plan.queries, plan.length
    k, v = _gather_keys(k_cache, v_cache, plan.blocks, L)  # [Bp, nkv, L, d]
    qp = q.index_select(0, plan.rows).view(Bp, Q, nh, d).transpose(1, 2)  # [Bp, nh, Q, d]
    mask = plan.mask
    if sinks is not None:
        k, v, mask = _with_sink(k, v, mask.expand(Bp, nh, Q, L), sinks.view(1, nh, 1, 1))
    o = F.scaled_dot_product_attention(
        qp, k, v, attn_mask=mask, scale=scale, enable_gqa=True
    )  # [Bp, nh, Q, d]
    o = o.transpose(1, 2).reshape(Bp * Q, nh, d)
    out.index_copy_(0, plan.out_rows, o.index_select(0, plan.kept))


def _with_sink(
    k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, sink: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """K and V ``[B, kv, L, d]`` with one zero key and value appended, and the additive
    ``mask [B, h, Q, L]`` with the sink (broadcast to ``[B, h, Q, 1]``) as that key's score."""
    k = F.pad(k, (0, 0, 0, 1))
    v = F.pad(v, (0, 0, 0, 1))
    col = sink.to(mask.dtype).expand(*mask.shape[:-1], 1)
    return k, v, torch.cat([mask, col], -1)


def paged_attention_ref(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    sinks: torch.Tensor | None = None,
    window: int | None = None,
) -> torch.Tensor:
    """Causal attention of packed queries ``q [T, num_heads, head_dim]`` over the paged cache.

    GQA: query head ``h`` reads KV head ``h // (num_heads // num_kv_heads)``. Softmax in float32.
    Decode rows (one query token) are batched; longer chunks are computed per sequence.
    ``sinks [num_heads]`` and ``window``: see the module doc.
    """
    T, nh, d = q.shape
    nb, bs, nkv, _ = k_cache.shape
    g = nh // nkv
    if T == 0:
        return torch.empty_like(q)
    plan = decode_plan(meta, bs, q.dtype, window)
    if plan is not None:
        qd = (q if plan.rows is None else q[plan.rows]).view(-1, nkv, g, d)  # a GQA group
        # shares its KV head
        o = _decode_rows(qd, k_cache, v_cache, plan, scale, sinks)  # [Bd, nkv, g, d]
        if plan.rows is None:
            return o.reshape(T, nh, d)
    out = torch.empty_like(q)
    if plan is not None:
        out[plan.rows] = o.reshape(-1, nh, d)
    prefill_ref(q, k_cache, v_cache, meta, scale, out, sinks, window)
    return out


# Decode rows gather at most this many bytes of K (as many of V) at a time. The whole batch at
# once gathers every context of the layer: at batch 32, context 2048 (8/2 heads of 64), 34 MB
# each, fresh memory past glibc's 32 MB mmap threshold, page-faulted on every layer, and read
# back by SDPA from DRAM; chunks of 4 MB come from glibc's heap and stay in cache between the
# gather and SDPA, several times faster at long contexts.
DECODE_GATHER_BYTES = 4 << 20


# The kernels of decode rows on CPU, chosen per shape class by timing them before serving
# (`decode_attention_trials`, `cpu_choice`); ``"sdpa"`` is the default.
CPU_DECODE_KERNELS = KernelChoice("decode_attention")


def _decode_rows(
    qd: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    plan: DecodePlan,
    scale: float,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention of one-token rows ``qd [Bd, nkv, g, d]`` (a GQA group's heads as its query
    rows) over their blocks (`DecodePlan`). On CPU, where the native kernel builds
    (`attention_cpu`), it or `_decode_sdpa`, whichever measured faster for the shape class
    (rows and keys rounded up to powers of two, heads, sinks); elsewhere `_decode_sdpa`."""
    if not attention_cpu.fits(qd, k_cache, v_cache):
        return _decode_sdpa(qd, k_cache, v_cache, plan, scale, sinks)
    shape = _decode_shape_class(qd, plan, sinks)
    calls = _decode_calls(qd, k_cache, v_cache, plan, scale, sinks)
    kept = CPU_DECODE_KERNELS.kept(shape, qd.dtype)  # (decided: a dict lookup)
    return calls[kept]() if kept else CPU_DECODE_KERNELS.run(shape, qd.dtype, calls)


def _decode_shape_class(qd: torch.Tensor, plan: DecodePlan, sinks: torch.Tensor | None) -> tuple:
    Bd, nkv, g, d = qd.shape
    return (pow2_bucket(Bd), pow2_bucket(plan.length), nkv, g, d, sinks is not None)


def _decode_calls(qd, k_cache, v_cache, plan: DecodePlan, scale: float, sinks) -> Candidates:
    return {
        "sdpa": lambda: _decode_sdpa(qd, k_cache, v_cache, plan, scale, sinks),
        "native": lambda: attention_cpu.decode(
            qd, k_cache, v_cache, plan.blocks, plan.spans, scale, sinks
        ),
    }


def decode_attention_trials(
    num_kv_heads: int,
    group: int,
    head_dim: int,
    dtype: torch.dtype,
    block_size: int,
    rows: Iterable[int],
    contexts: Iterable[int],
    pool_bytes: int,
    *,
    window: int | None = None,
    sinks: bool = False,
) -> list[Trial]:
    """The shape classes of `_decode_rows` for layers of ``num_kv_heads`` KV heads of
    ``group`` query heads each, ``head_dim`` wide (a ``window``, ``sinks``), to settle before
    serving (`splitmoe.kernels.cpu_choice.settle`): one per class of decode rows (of
    ``rows``) and of keys per row (whole blocks of ``contexts``, a window's at most), timed at
    the middle of each class's counts: made-up queries over a made-up paged cache of
    ``pool_bytes`` at most for K (as much for V; more than the CPU's caches, so that keys
    stream from memory as in a step), each row's blocks scattered in it. None where the native
    kernel does not take these (one kernel: nothing to choose)."""
    nkv, g, d = num_kv_heads, group, head_dim
    probe_q = torch.empty(1, nkv, g, d, dtype=dtype)
    probe_kv = torch.empty(1, block_size, nkv, d, dtype=dtype)
    if not attention_cpu.fits(probe_q, probe_kv, probe_kv):
        return []

    def keys(context: int) -> int:  # a row's keys in the plan
        nblk = -(-context // block_size)
        return (_window_blocks(nblk, block_size, window) or nblk) * block_size

    by_rows = class_middles(rows)
    by_keys = class_middles(contexts, lambda c: pow2_bucket(keys(c)))
    block_bytes = block_size * nkv * d * probe_kv.element_size()
    most = max(by_rows.values(), default=0) * max(map(keys, by_keys.values()), default=0)
    pool_blocks = max(1, min(most // block_size, pool_bytes // block_bytes))
    pool: list = []  # (k_cache, v_cache, scattered block order), made at the first build

    def cache():
        if not pool:
            tile = torch.randn(1, block_size, nkv, d, generator=torch.Generator().manual_seed(0))
            tile = tile.to(dtype).expand(pool_blocks, block_size, nkv, d)
            order = torch.randperm(pool_blocks, generator=torch.Generator().manual_seed(1))
            pool.extend([tile.contiguous(), tile.contiguous(), order.tolist()])
        return pool

    trials = []
    for rows_top, Bd in by_rows.items():
        for keys_top, context in by_keys.items():

            def build(Bd=Bd, context=context) -> list[Candidates]:
                k_cache, v_cache, order = cache()
                nblk = -(-context // block_size)
                tables = [
                    [order[(i * nblk + j) % pool_blocks] for j in range(nblk)] for i in range(Bd)
                ]
                meta = AttentionMetadata.from_lists([1] * Bd, [context] * Bd, tables, [0] * Bd)
                plan = decode_plan(meta, block_size, dtype, window)
                gen = torch.Generator().manual_seed(Bd * 7919 + context)
                qd = torch.randn(Bd, nkv, g, d, generator=gen).to(dtype)
                sink = torch.randn(nkv * g, generator=gen) if sinks else None
                return [_decode_calls(qd, k_cache, v_cache, plan, d**-0.5, sink)]

            shape = (rows_top, keys_top, nkv, g, d, sinks)
            trials.append(Trial(CPU_DECODE_KERNELS, shape, dtype, ("sdpa", "native"), build, Bd))
    return trials


def _decode_sdpa(
    qd: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    plan: DecodePlan,
    scale: float,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """`_decode_rows` by torch: each chunk of rows' blocks gathered into one tensor (at most
    `DECODE_GATHER_BYTES` of K), then SDPA's CPU path (softmax in float32 for float32 inputs)
    with an additive mask (`_additive_mask`: faster than a boolean one in this path)."""
    Bd, nkv, _, d = qd.shape
    L = plan.length
    nblk = L // k_cache.shape[1]
    step = max(1, DECODE_GATHER_BYTES // (L * nkv * d * k_cache.element_size()))
    g = qd.shape[2]

    def attend(s: int, e: int) -> torch.Tensor:
        k, v = _gather_keys(k_cache, v_cache, plan.blocks[s * nblk : e * nblk], L)
        mask = plan.mask[s:e]
        if sinks is None:
            return F.scaled_dot_product_attention(qd[s:e], k, v, attn_mask=mask, scale=scale)
        sink = sinks.view(1, nkv, g, 1)  # a GQA group's heads are the query rows here
        if qd.is_cpu:
            # SDPA's CPU kernel with its log-sum-exp: o * Z / (Z + e^sink) = o / (1 + e^(sink -
            # lse)), no copy of K/V (appending a zero key for the sink copies K/V, which about
            # doubles decode attention's time)
            o, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
                qd[s:e], k, v, 0.0, False, attn_mask=mask, scale=scale
            )  # [b, nkv, g, d], [b, nkv, g]
            return o / (1 + torch.exp(sink - lse[..., None].float())).to(o.dtype)
        k, v, mask = _with_sink(k, v, mask.expand(-1, nkv, g, L), sink)
        return F.scaled_dot_product_attention(qd[s:e], k, v, attn_mask=mask, scale=scale)

    if step >= Bd:
        return attend(0, Bd)
    o = torch.empty_like(qd)
    for s in range(0, Bd, step):
        o[s : min(Bd, s + step)] = attend(s, min(Bd, s + step))
    return o


def prefill_ref(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    out: torch.Tensor,
    sinks: torch.Tensor | None = None,
    window: int | None = None,
) -> None:
    """The reference for the rows of multi-token sequences (prompt chunks): writes them into
    ``out``, batched when `prefill_plan` allows, else one sequence at a time."""
    T, nh, d = q.shape
    bs, nkv = k_cache.shape[1], k_cache.shape[2]
    g = nh // nkv
    chunks = prefill_plan(meta, bs, q.dtype, nh, window)
    if chunks is not None:
        _batched_prefill(q, k_cache, v_cache, chunks, scale, out, sinks)
        return
    starts = meta.query_start_loc.tolist()
    for i, n in enumerate(meta.query_lens):
        if n == 1 or n == 0:
            continue
        ctx = meta.seq_lens_list[i]
        nblk = -(-ctx // bs)
        table = meta.block_tables[i, :nblk].long()
        k = k_cache[table].flatten(0, 1)[:ctx]  # [ctx, nkv, d]
        v = v_cache[table].flatten(0, 1)[:ctx]
        qs = q[starts[i] : starts[i] + n].view(n, nkv, g, d)
        scores = torch.einsum("qkgd,lkd->kgql", qs, k).float() * scale  # [nkv, g, n, ctx]
        qpos = torch.arange(ctx - n, ctx, device=q.device)
        kpos = torch.arange(ctx, device=q.device)
        hidden = kpos[None, :] > qpos[:, None]
        if window is not None:
            hidden |= kpos[None, :] <= qpos[:, None] - window
        scores.masked_fill_(hidden, float("-inf"))
        if sinks is not None:  # the sink as one more column, dropped after the softmax
            sink = sinks.float().view(nkv, g, 1, 1).expand(nkv, g, n, 1)
            p = torch.cat([scores, sink], -1).softmax(-1)[..., :-1].to(q.dtype)
        else:
            p = scores.softmax(-1).to(q.dtype)
        out[starts[i] : starts[i] + n] = torch.einsum("kgql,lkd->qkgd", p, v).reshape(n, nh, d)


def paged_attention_triton(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    sinks: torch.Tensor | None = None,
    window: int | None = None,
) -> torch.Tensor:
    """`paged_attention_ref`'s math on the Triton kernels: the prefill/extend kernel for rows of
    sequences with more than one token, the split-KV decode kernel for one-token rows."""
    from splitmoe.kernels.decode_attention import launch_decode
    from splitmoe.kernels.prefill_attention import launch_prefill

    q = q.contiguous()
    check_paged_inputs(q, k_cache, v_cache, meta)
    out = torch.empty_like(q)
    ext = dict(sinks=sinks, window=window)
    launch_prefill(q, k_cache, v_cache, meta, scale, out, **ext)  # rows of sequences > 1 token
    launch_decode(q, k_cache, v_cache, meta, scale, out, **ext)  # rows of one-token sequences
    return out


# The attention kernel of each backend (`splitmoe.kernels.backends` binds one per rank).
ATTENTION_KERNELS = {"torch": paged_attention_ref, "triton": paged_attention_triton}


def paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    backend: str = "torch",
    sinks: torch.Tensor | None = None,
    window: int | None = None,
) -> torch.Tensor:
    """Causal attention of the packed queries ``q [T, num_heads, head_dim]`` over the paged cache
    ``k_cache, v_cache [num_blocks, block_size, num_kv_heads, head_dim]``; returns ``[T, num_heads,
    head_dim]`` in q's dtype. ``backend``: ``"torch"`` (reference) or ``"triton"`` (see the
    module doc). Checks the shapes, then runs the backend's kernel (`ATTENTION_KERNELS`)."""
    if q.dim() != 3 or k_cache.dim() != 4 or k_cache.shape != v_cache.shape:
        raise ValueError(
            f"paged_attention: q must be [T, H, D] and caches [blocks, block_size, KVH, D]; got "
            f"q {tuple(q.shape)}, k_cache {tuple(k_cache.shape)}, v_cache {tuple(v_cache.shape)}"
        )
    if q.shape[1] % k_cache.shape[2] or q.shape[2] != k_cache.shape[3]:
        raise ValueError(
            f"paged_attention: {q.shape[1]} query heads of dim {q.shape[2]} do not fit "
            f"{k_cache.shape[2]} KV heads of dim {k_cache.shape[3]}"
        )
    if backend not in ATTENTION_KERNELS:
        raise ValueError(f"attention backend {backend!r} is not available; use 'torch' or 'triton'")
    if backend == "triton":
        from splitmoe.kernels.triton_utils import require_triton

        require_triton("attention_backend", q.device)
    if sinks is not None and tuple(sinks.shape) != (q.shape[1],):
        raise ValueError(f"paged_attention: sinks must be [{q.shape[1]}], got {tuple(sinks.shape)}")
    if window is not None and window < 1:
        raise ValueError(f"paged_attention: window must be >= 1 keys, got {window}")
    return ATTENTION_KERNELS[backend](q, k_cache, v_cache, meta, scale, sinks, window)
