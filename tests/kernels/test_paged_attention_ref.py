"""The paged-attention reference against dense causal attention on contiguous K/V."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import splitmoe.kernels.paged_attention as pa
from splitmoe.kernels.paged_attention import AttentionMetadata, paged_attention, store_kv


def _dense(q, k, v, scale):
    """q [n, nh, d] are the last n of ctx = k.shape[0] positions; GQA by repeating KV heads."""
    n, nh, _ = q.shape
    g = nh // k.shape[1]
    k = k.repeat_interleave(g, dim=1)
    v = v.repeat_interleave(g, dim=1)
    ctx = k.shape[0]
    mask = torch.arange(ctx)[None, :] <= torch.arange(ctx - n, ctx)[:, None]  # [n, ctx]
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), attn_mask=mask, scale=scale
    )
    return out.transpose(0, 1)


@pytest.mark.parametrize("nh,nkv,d", [(4, 4, 16), (4, 2, 16), (8, 1, 32)])
@pytest.mark.parametrize("block_size", [1, 4, 16])
@pytest.mark.parametrize("batched", [False, True])
def test_mixed_batch_matches_dense(nh, nkv, d, block_size, batched, monkeypatch):
    """One step mixing decode tokens, a fresh prompt, and a chunk extending a cached prefix;
    the prompt chunks attended one sequence at a time, or padded into one batch."""
    monkeypatch.setattr(pa, "PREFILL_MAX_PADDING", 1e9 if batched else 0.0)
    g = torch.Generator().manual_seed(0)
    # (cached tokens, new tokens) per sequence
    seqs = [(0, 1), (9, 1), (0, 13), (5, 7), (33, 1), (16, 16)]
    num_blocks = 128
    k_cache = torch.zeros(num_blocks, block_size, nkv, d)
    v_cache = torch.zeros_like(k_cache)
    free = list(torch.randperm(num_blocks, generator=g).tolist())  # scattered block ids
    tables, full_k, full_v, qs, slots = [], [], [], [], []
    for cached, new in seqs:
        ctx = cached + new
        nblk = -(-ctx // block_size)
        table = [free.pop() for _ in range(nblk)]
        tables.append(table)
        k = torch.randn(ctx, nkv, d, generator=g)
        v = torch.randn(ctx, nkv, d, generator=g)
        full_k.append(k)
        full_v.append(v)
        pos = torch.arange(ctx)
        slot = torch.tensor(table)[pos // block_size] * block_size + pos % block_size
        store_kv(k[:cached], v[:cached], k_cache, v_cache, slot[:cached])  # the cached prefix
        slots.append(slot[cached:])
        qs.append(torch.randn(new, nh, d, generator=g))
    q = torch.cat(qs)
    new_k = torch.cat([k[c:] for k, (c, _) in zip(full_k, seqs)])
    new_v = torch.cat([v[c:] for v, (c, _) in zip(full_v, seqs)])
    slot_mapping = torch.cat(slots)
    store_kv(new_k, new_v, k_cache, v_cache, slot_mapping)
    meta = AttentionMetadata.from_lists(
        [n for _, n in seqs], [c + n for c, n in seqs], tables, slot_mapping
    )
    scale = d**-0.5
    out = paged_attention(q, k_cache, v_cache, meta, scale)
    assert (meta.derived[("prefill", block_size, q.dtype)] is not None) == batched
    ref = torch.cat([_dense(qi, k, v, scale) for qi, k, v in zip(qs, full_k, full_v)])
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


def test_rejects_mismatched_heads():
    q = torch.zeros(2, 3, 8)
    cache = torch.zeros(4, 4, 2, 8)
    meta = AttentionMetadata.from_lists([2], [2], [[0]], [0, 1])
    with pytest.raises(ValueError, match="query heads"):
        paged_attention(q, cache, cache, meta, 1.0)
