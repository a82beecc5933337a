"""Attention sinks and sliding windows (GPT-OSS) in the paged attention kernels: the PyTorch
reference against a dense transcription of transformers' ``eager_attention_forward`` (the sink
appended as a softmax column, the window as ``kv_idx > q_idx - window``), and the Triton
prefill and split-KV decode kernels (interpreter on CPU) against the reference."""

from __future__ import annotations

import os

import pytest
import torch

import splitmoe.kernels.paged_attention as pa
from splitmoe.kernels.attention_metadata import AttentionMetadata
from splitmoe.kernels.paged_attention import paged_attention, paged_attention_ref

# (cached tokens, new tokens) per sequence: decode rows inside and well past the window, fresh
# prompts shorter and longer than it, chunks extending a cached prefix mid-block
MIXED = [(0, 1), (9, 1), (0, 13), (5, 7), (70, 1), (16, 16), (0, 2), (37, 3)]
WINDOW = 6
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # of the Triton cases


def _batch(seqs, nh, nkv, d, block_size, seed=0, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    lens = [c + n for c, n in seqs]
    num_blocks = sum(-(-n // block_size) for n in lens) + 2
    k_cache = torch.randn(num_blocks, block_size, nkv, d, generator=g)
    v_cache = torch.randn(num_blocks, block_size, nkv, d, generator=g)
    free = torch.randperm(num_blocks, generator=g).tolist()
    tables = [[free.pop() for _ in range(-(-n // block_size))] for n in lens]
    qlens = [n for _, n in seqs]
    q = torch.randn(sum(qlens), nh, d, generator=g)
    sinks = 2.0 * torch.randn(nh, generator=g)
    meta = AttentionMetadata.from_lists(qlens, lens, tables, [0] * sum(qlens), device=device)
    q, k_cache, v_cache, sinks = (t.to(device) for t in (q, k_cache, v_cache, sinks))
    return q, k_cache, v_cache, meta, tables, sinks


def _eager(q, k_cache, v_cache, meta, tables, scale, sinks, window):
    """transformers' eager GPT-OSS attention, one sequence at a time on its dense K/V."""
    nh, nkv = q.shape[1], k_cache.shape[2]
    bs = k_cache.shape[1]
    out = torch.empty_like(q)
    start = 0
    for n, ctx, table in zip(meta.query_lens, meta.seq_lens_list, tables):
        k = k_cache[torch.tensor(table)].flatten(0, 1)[:ctx].repeat_interleave(nh // nkv, 1)
        v = v_cache[torch.tensor(table)].flatten(0, 1)[:ctx].repeat_interleave(nh // nkv, 1)
        assert k.shape[0] == ctx and bs
        w = torch.einsum("qhd,khd->hqk", q[start : start + n], k) * scale  # [nh, n, ctx]
        qi = torch.arange(ctx - n, ctx)[:, None]
        ki = torch.arange(ctx)[None, :]
        allowed = ki <= qi
        if window is not None:
            allowed &= ki > qi - window
        w = w.masked_fill(~allowed, float("-inf"))
        if sinks is not None:
            w = torch.cat([w, sinks.view(nh, 1, 1).expand(nh, n, 1)], -1)
        w = w - w.max(-1, keepdim=True).values
        p = w.softmax(-1)
        if sinks is not None:
            p = p[..., :-1]
        out[start : start + n] = torch.einsum("hqk,khd->qhd", p, v)
        start += n
    return out


@pytest.mark.parametrize("sinks_on,window", [(True, None), (False, WINDOW), (True, WINDOW)])
@pytest.mark.parametrize("batched", [False, True])
@pytest.mark.parametrize("block_size", [1, 4])
def test_reference_matches_eager(sinks_on, window, batched, block_size, monkeypatch):
    """Prompt chunks one at a time or padded into one batch; decode rows whose windows start
    mid-block (each row's gathered blocks begin at its window)."""
    monkeypatch.setattr(pa, "PREFILL_MAX_PADDING", 1e9 if batched else 0.0)
    q, k_cache, v_cache, meta, tables, sinks = _batch(MIXED, 4, 2, 16, block_size)
    sinks = sinks if sinks_on else None
    got = paged_attention(q, k_cache, v_cache, meta, 0.25, sinks=sinks, window=window)
    want = _eager(q, k_cache, v_cache, meta, tables, 0.25, sinks, window)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_reference_decode_in_chunks_with_sinks(monkeypatch):
    """Decode rows gathered a few at a time (`DECODE_GATHER_BYTES`) take the sinks too."""
    monkeypatch.setattr(pa, "DECODE_GATHER_BYTES", 1)
    seqs = [(0, 1), (9, 1), (70, 1), (33, 1)]
    q, k_cache, v_cache, meta, tables, sinks = _batch(seqs, 4, 2, 16, 4, seed=1)
    got = paged_attention(q, k_cache, v_cache, meta, 0.25, sinks=sinks, window=WINDOW)
    want = _eager(q, k_cache, v_cache, meta, tables, 0.25, sinks, WINDOW)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_window_never_uses_blocks_before_it():
    """Blocks wholly before every window (freed: reused by other requests) hold garbage: the
    reference (which reads them, masked) gives the same output; the Triton kernels never read
    them at all (NaN there stays out)."""
    seqs = [(40, 1), (33, 5)]
    q, k_cache, v_cache, meta, tables, sinks = _batch(seqs, 4, 2, 16, 4, seed=3, device=DEVICE)
    want = paged_attention(q, k_cache, v_cache, meta, 0.25, sinks=sinks, window=WINDOW)

    def poison(k_value: float, v_value: float) -> None:
        for (cached, _), table in zip(seqs, tables):
            first = cached + 1 - WINDOW  # the earliest key any of its queries sees
            for b in table[: first // 4]:
                k_cache[b] = k_value
                v_cache[b] = v_value
        meta.derived.clear()

    poison(1e4, -1e4)
    got = paged_attention(q, k_cache, v_cache, meta, 0.25, sinks=sinks, window=WINDOW)
    torch.testing.assert_close(got, want)
    if os.environ.get("TRITON_INTERPRET") == "1" or DEVICE == "cuda":
        poison(float("nan"), float("nan"))
        got = paged_attention(
            q, k_cache, v_cache, meta, 0.25, backend="triton", sinks=sinks, window=WINDOW
        )
        torch.testing.assert_close(got, want, rtol=2e-5, atol=2e-5)


triton_only = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1" and not torch.cuda.is_available(),
    reason="Triton kernels run only under TRITON_INTERPRET=1 on CPU",
)


@triton_only
@pytest.mark.parametrize("sinks_on,window", [(True, None), (True, WINDOW), (False, 17)])
def test_triton_matches_reference(sinks_on, window):
    """A mixed step through `paged_attention_triton` (prefill and decode kernels), with small
    tiles so that windows start mid-tile and some tiles hide whole rows."""
    from splitmoe.kernels.decode_attention import DecodeTiles, launch_decode
    from splitmoe.kernels.prefill_attention import PrefillTiles, launch_prefill

    q, k_cache, v_cache, meta, tables, sinks = _batch(MIXED, 4, 2, 16, 4, seed=2, device=DEVICE)
    sinks = sinks if sinks_on else None
    want = paged_attention_ref(q, k_cache, v_cache, meta, 0.25, sinks, window)
    out = torch.empty_like(q)
    launch_prefill(q, k_cache, v_cache, meta, 0.25, out, PrefillTiles(16, 16, 4, 1), sinks, window)
    launch_decode(q, k_cache, v_cache, meta, 0.25, out, DecodeTiles(16, 1, 4, 1), sinks, window)
    torch.testing.assert_close(out, want, rtol=2e-5, atol=2e-5)


@triton_only
@pytest.mark.parametrize("splits", [2, 4])
def test_triton_decode_splits_with_sinks_and_window(splits):
    """Split-KV decode: the segments cover only the window's tiles, the reduction adds the
    sink once."""
    from splitmoe.kernels.decode_attention import DecodeTiles, decode_attention

    seqs = [(0, 1), (16, 1), (94, 1), (40, 1)]
    q, k_cache, v_cache, meta, tables, sinks = _batch(seqs, 8, 2, 16, 4, seed=4, device=DEVICE)
    for window in (None, 37):
        want = paged_attention_ref(q, k_cache, v_cache, meta, 0.25, sinks, window)
        tiles = DecodeTiles(block_n=16, num_splits=splits, num_warps=4, num_stages=1)
        out = decode_attention(q, k_cache, v_cache, meta, 0.25, None, tiles, sinks, window)
        torch.testing.assert_close(out, want, rtol=2e-5, atol=2e-5)
