"""The Triton paged-attention kernels (prefill/extend and split-KV decode) against the reference.

Without a GPU they run in Triton's interpreter (conftest sets TRITON_INTERPRET=1), so shapes are
tiny and each case is a handful of launches.
"""

from __future__ import annotations

import os
import sys

import pytest
import torch

from splitmoe.kernels.attention_metadata import AttentionMetadata
from splitmoe.kernels.paged_attention import paged_attention, paged_attention_ref

pytest.importorskip("triton")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
pytestmark = pytest.mark.skipif(
    DEVICE == "cpu" and os.environ.get("TRITON_INTERPRET") != "1",
    reason="without CUDA, Triton kernels run only under TRITON_INTERPRET=1 (tests/conftest.py)",
)

# (cached tokens, new tokens) per sequence: a one-token prompt, decode rows (short, and long
# enough to cross several blocks and tiles), odd-length fresh prompts, and chunks extending a
# cached prefix that starts mid-block.
MIXED = [(0, 1), (9, 1), (0, 13), (5, 7), (70, 1), (16, 16), (0, 2), (37, 3)]
TOL = {torch.float32: 2e-5, torch.float16: 2e-3}


def _batch(seqs, nh, nkv, d, block_size, dtype, seed=0):
    """Random q and a scattered paged cache holding every sequence's keys/values."""
    g = torch.Generator().manual_seed(seed)
    lens = [c + n for c, n in seqs]
    num_blocks = sum(-(-n // block_size) for n in lens) + 2
    k_cache = torch.randn(num_blocks, block_size, nkv, d, generator=g)
    v_cache = torch.randn(num_blocks, block_size, nkv, d, generator=g)
    free = torch.randperm(num_blocks, generator=g).tolist()
    tables = [[free.pop() for _ in range(-(-n // block_size))] for n in lens]
    qlens = [n for _, n in seqs]
    q = torch.randn(sum(qlens), nh, d, generator=g)
    # K/V already in place: the slots are not written
    meta = AttentionMetadata.from_lists(qlens, lens, tables, [0] * sum(qlens), device=DEVICE)
    return [t.to(DEVICE, dtype) for t in (q, k_cache, v_cache)], meta


def _check(out, q, k_cache, v_cache, meta, scale):
    ref = paged_attention_ref(q.float(), k_cache.float(), v_cache.float(), meta, scale)
    tol = TOL[q.dtype]
    torch.testing.assert_close(out.float(), ref, rtol=tol, atol=tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize(
    "nh,nkv,d,block_size",
    [(2, 2, 64, 16), (4, 2, 128, 4), (8, 1, 64, 4), (16, 2, 128, 16)],
    ids=["gqa1-d64-bs16", "gqa2-d128-bs4", "gqa8-d64-bs4", "gqa8-d128-bs16"],
)
def test_mixed_batch_matches_reference(nh, nkv, d, block_size, dtype):
    """The public entry: decode rows to the split-KV kernel, longer rows to prefill/extend."""
    (q, k_cache, v_cache), meta = _batch(MIXED, nh, nkv, d, block_size, dtype)
    out = paged_attention(q, k_cache, v_cache, meta, d**-0.5, backend="triton")
    _check(out, q, k_cache, v_cache, meta, d**-0.5)


@pytest.mark.parametrize(
    "nh,nkv,dtype",
    [(4, 2, torch.float32), (8, 1, torch.float16), (6, 2, torch.float32)],
    ids=["gqa2-fp32", "gqa8-fp16", "gqa3-fp32"],
)
def test_prefill_across_many_tiles(nh, nkv, dtype):
    """16-row, 16-key tiles: several query tiles per chunk, unmasked prefix tiles, diagonal
    tiles, a non-power-of-two group padded, block size 4 and 16-key tiles out of step."""
    from splitmoe.kernels.prefill_attention import PrefillTiles, prefill_attention

    seqs = [(0, 23), (37, 21), (3, 2), (0, 1)]
    (q, k_cache, v_cache), meta = _batch(seqs, nh, nkv, 64, 4, dtype, seed=1)
    out = torch.zeros_like(q)
    tiles = PrefillTiles(block_m=16, block_n=16, num_warps=4, num_stages=1)
    prefill_attention(q, k_cache, v_cache, meta, 0.125, out, tiles)
    rows = slice(0, sum(meta.query_lens) - 1)  # the last row is a decode row: left untouched
    ref = paged_attention_ref(q.float(), k_cache.float(), v_cache.float(), meta, 0.125)
    tol = TOL[dtype]
    torch.testing.assert_close(out[rows].float(), ref[rows], rtol=tol, atol=tol)
    assert not out[-1].any()


@pytest.mark.parametrize("nh,nkv,d,splits", [(4, 4, 64, 2), (8, 1, 128, 8), (4, 2, 64, 4)], ids=str)
def test_decode_split_kv(nh, nkv, d, splits):
    """Forced splits: segments of whole 16-key tiles, empty segments (a one-token context
    split 8 ways), and the log-sum-exp reduction."""
    from splitmoe.kernels.decode_attention import DecodeTiles, decode_attention

    seqs = [(0, 1), (16, 1), (94, 1), (40, 1)]
    (q, k_cache, v_cache), meta = _batch(seqs, nh, nkv, d, 4, torch.float32, seed=2)
    tiles = DecodeTiles(block_n=16, num_splits=splits, num_warps=4, num_stages=1)
    out = decode_attention(q, k_cache, v_cache, meta, d**-0.5, None, tiles)
    _check(out, q, k_cache, v_cache, meta, d**-0.5)


def test_empty_step():
    """Idle lockstep steps carry no sequences at all."""
    q = torch.zeros(0, 4, 64, device=DEVICE)
    cache = torch.zeros(2, 4, 2, 64, device=DEVICE)
    meta = AttentionMetadata.from_lists([], [], [], [], device=DEVICE)
    assert paged_attention(q, cache, cache, meta, 1.0, backend="triton").shape == (0, 4, 64)


def test_rejects_inputs_the_kernels_cannot_read():
    (q, k_cache, v_cache), meta = _batch([(3, 2)], 2, 2, 64, 4, torch.float32)
    with pytest.raises(ValueError, match="share one of"):
        paged_attention(q.half(), k_cache, v_cache, meta, 1.0, backend="triton")
    meta.block_tables = meta.block_tables.long()
    with pytest.raises(ValueError, match="block_tables must be int32"):
        paged_attention(q, k_cache, v_cache, meta, 1.0, backend="triton")
    with pytest.raises(ValueError, match="not available"):
        paged_attention(q, k_cache, v_cache, meta, 1.0, backend="cuda")


def test_missing_triton_names_the_fix(monkeypatch):
    (q, k_cache, v_cache), meta = _batch([(3, 2)], 2, 2, 64, 4, torch.float32)
    monkeypatch.setitem(sys.modules, "triton", None)  # `import triton` raises ImportError
    with pytest.raises(RuntimeError, match="pip install triton"):
        paged_attention(q, k_cache, v_cache, meta, 1.0, backend="triton")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU with ~10 GB free")
def test_block_ids_past_2_31_elements():
    """Blocks whose element offset exceeds int32: the kernels widen block ids to int64."""
    nh, nkv, d, bs = 8, 1, 128, 16
    num_blocks = (1 << 31) // (bs * nkv * d) + 64  # the last blocks start past 2^31 elements
    k_cache = torch.zeros(num_blocks, bs, nkv, d, dtype=torch.float16, device=DEVICE)
    v_cache = torch.zeros_like(k_cache)
    (q, k_small, v_small), meta = _batch([(40, 1), (20, 9)], nh, nkv, d, bs, torch.float16)
    used = meta.block_tables.long()
    far = used + (num_blocks - 64)  # the same blocks, moved to the end of the pool
    k_cache[far] = k_small[used]
    v_cache[far] = v_small[used]
    ref = paged_attention(q, k_small, v_small, meta, d**-0.5, backend="torch")
    meta.block_tables = far.to(torch.int32)
    out = paged_attention(q, k_cache, v_cache, meta, d**-0.5, backend="triton")
    torch.testing.assert_close(out.float(), ref.float(), rtol=2e-3, atol=2e-3)


def test_split_rule_on_h100():
    from splitmoe.kernels.decode_attention import decode_tiles

    def splits(B, ctx, sms=132):
        return decode_tiles(B, 4, ctx, 128, torch.bfloat16, sms).num_splits

    assert splits(1, 32768) == 64  # 512 keys per segment
    assert splits(1, 1024) == 8  # 128 keys per segment
    assert splits(8, 32768) == 8
    assert splits(64, 32768) == splits(256, 1024) == 1
    assert splits(1, 32768, sms=0) == 1  # CPU: never split
