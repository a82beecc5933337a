"""The paged-attention reference against dense causal attention on contiguous K/V."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import splitmoe.kernels.paged_attention as pa
from splitmoe.kernels.attention_metadata import AttentionMetadata
from splitmoe.kernels.paged_attention import paged_attention, store_kv


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


# (cached tokens, new tokens) per sequence
MIXED = [(0, 1), (9, 1), (0, 13), (5, 7), (33, 1), (16, 16)]  # decode, prompts, prefix chunks
DECODE = [(0, 1), (9, 1), (33, 1), (15, 1), (16, 1)]  # a pure decode step
PROMPTS = [(0, 13), (0, 16), (0, 2), (0, 31)]  # fresh prompts of ragged lengths


def _step(seqs, nh, nkv, d, block_size, seed=0):
    """A step's packed queries and paged cache (the cached prefixes and this step's K/V stored
    in scattered blocks), its metadata, and the dense K/V of each sequence."""
    g = torch.Generator().manual_seed(seed)
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
    new_k = torch.cat([k[c:] for k, (c, _) in zip(full_k, seqs)])
    new_v = torch.cat([v[c:] for v, (c, _) in zip(full_v, seqs)])
    slot_mapping = torch.cat(slots)
    store_kv(new_k, new_v, k_cache, v_cache, slot_mapping)
    meta = AttentionMetadata.from_lists(
        [n for _, n in seqs], [c + n for c, n in seqs], tables, slot_mapping
    )
    return qs, k_cache, v_cache, meta, full_k, full_v


@pytest.mark.parametrize("seqs", [MIXED, DECODE, PROMPTS], ids=["mixed", "decode", "prompts"])
@pytest.mark.parametrize("nh,nkv,d", [(4, 4, 16), (4, 2, 16), (8, 1, 32), (8, 2, 64)])
@pytest.mark.parametrize("block_size", [1, 4, 16])
@pytest.mark.parametrize("batched", [False, True])
@pytest.mark.parametrize("chunked", [False, True])
def test_step_matches_dense(seqs, nh, nkv, d, block_size, batched, chunked, monkeypatch):
    """A step of decode tokens, fresh prompts and chunks extending a cached prefix (or only one
    kind); the prompt chunks attended one sequence at a time, or padded into one batch; the
    decode rows all at once, or a few at a time."""
    monkeypatch.setattr(pa, "PREFILL_MAX_PADDING", 1e9 if batched else 0.0)
    if chunked:  # two rows of the longest context at a time
        monkeypatch.setattr(pa, "DECODE_GATHER_BYTES", 2 * 48 * nkv * d * 4)
    qs, k_cache, v_cache, meta, full_k, full_v = _step(seqs, nh, nkv, d, block_size)
    q = torch.cat(qs)
    scale = d**-0.5
    out = paged_attention(q, k_cache, v_cache, meta, scale)
    chunks = [n for _, n in seqs if n > 1]
    assert (meta.derived.get(("prefill", block_size, q.dtype, None)) is not None) == (
        batched and bool(chunks)
    )
    ref = torch.cat([_dense(qi, k, v, scale) for qi, k, v in zip(qs, full_k, full_v)])
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


def test_no_tokens():
    q = torch.zeros(0, 4, 8)
    cache = torch.zeros(4, 4, 2, 8)
    meta = AttentionMetadata.from_lists([], [], [], [])
    assert paged_attention(q, cache, cache, meta, 1.0).shape == (0, 4, 8)


def test_rejects_unknown_backend():
    qs, k_cache, v_cache, meta, _, _ = _step(DECODE, 4, 2, 8, 4)
    with pytest.raises(ValueError, match="'torch' or 'triton'"):
        paged_attention(torch.cat(qs), k_cache, v_cache, meta, 1.0, "cpu")


def test_rejects_mismatched_heads():
    q = torch.zeros(2, 3, 8)
    cache = torch.zeros(4, 4, 2, 8)
    meta = AttentionMetadata.from_lists([2], [2], [[0]], [0, 1])
    with pytest.raises(ValueError, match="query heads"):
        paged_attention(q, cache, cache, meta, 1.0)
