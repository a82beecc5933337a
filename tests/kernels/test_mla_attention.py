"""Paged multi-head latent attention: the PyTorch reference against a spelled-out
per-sequence computation (and the up-projected form HF computes), and the Triton kernels
(split-KV decode, prefill/extend) against the reference. Without a GPU the Triton kernels run in
Triton's interpreter (conftest sets TRITON_INTERPRET=1): tiny shapes."""

from __future__ import annotations

import os

import pytest
import torch

from splitmoe.kernels.attention_metadata import AttentionMetadata
from splitmoe.kernels.mla_attention import mla_attention, mla_attention_ref

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
INTERPRETED = DEVICE == "cpu" and os.environ.get("TRITON_INTERPRET") == "1"
needs_triton = pytest.mark.skipif(
    not (DEVICE == "cuda" or INTERPRETED),
    reason="without CUDA, Triton kernels run only under TRITON_INTERPRET=1 (tests/conftest.py)",
)

# (cached tokens, new tokens) per sequence: a one-token prompt, decode rows over several blocks
# and tiles, fresh prompts, and chunks extending a prefix that ends mid-block.
MIXED = [(0, 1), (9, 1), (0, 13), (5, 7), (70, 1), (16, 16), (0, 2), (37, 3)]
TOL = {torch.float32: 2e-5, torch.float16: 3e-3}


def _batch(seqs, nh, dl, dr, block_size, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    lens = [c + n for c, n in seqs]
    num_blocks = sum(-(-n // block_size) for n in lens) + 2
    cache = torch.randn(num_blocks, block_size, 1, dl + dr, generator=g)
    free = torch.randperm(num_blocks, generator=g).tolist()
    tables = [[free.pop() for _ in range(-(-n // block_size))] for n in lens]
    qlens = [n for _, n in seqs]
    q = torch.randn(sum(qlens), nh, dl + dr, generator=g)
    meta = AttentionMetadata.from_lists(qlens, lens, tables, [0] * sum(qlens), device=DEVICE)
    return q.to(DEVICE, dtype), cache.to(DEVICE, dtype), meta


def _spelled_out(q, cache, meta, scale, dl):
    """Per sequence and query token: softmax over its cached rows 0..pos of q . row, times the
    rows' latent parts."""
    out = torch.empty(q.shape[0], q.shape[1], dl, dtype=torch.float64)
    bs = cache.shape[1]
    start = 0
    for i, n in enumerate(meta.query_lens):
        ctx = meta.seq_lens_list[i]
        table = meta.block_tables[i, : -(-ctx // bs)].long().cpu()
        rows = cache.cpu()[table].flatten(0, 1)[:ctx, 0].double()  # [ctx, Dk]
        for t in range(n):
            pos = ctx - n + t
            s = q[start + t].cpu().double() @ rows[: pos + 1].T * scale  # [nh, pos + 1]
            out[start + t] = s.softmax(-1) @ rows[: pos + 1, :dl]
        start += n
    return out


def test_reference_is_latent_attention():
    q, cache, meta = _batch(MIXED, 4, 32, 8, 4, torch.float32)
    got = mla_attention(q, cache, meta, 0.2, 32)
    want = _spelled_out(q, cache, meta, 0.2, 32)
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)


def test_absorbed_form_equals_up_projected_attention():
    """What MLA computes: per-head keys [W_UK c, k_pe] and values W_UV c, attended normally,
    equal the absorbed queries' latent attention up-projected after."""
    nh, dl, dr, nope, v = 3, 16, 8, 12, 10
    g = torch.Generator().manual_seed(3)
    q, cache, meta = _batch([(6, 3)], nh, dl, dr, 4, torch.float64)
    w_uk = torch.randn(nh, nope, dl, generator=g, dtype=torch.float64)
    w_uv = torch.randn(nh, v, dl, generator=g, dtype=torch.float64)
    q_nope, q_pe = torch.randn(3, nh, nope, generator=g, dtype=torch.float64), q[:, :, dl:].cpu()
    absorbed = torch.cat([torch.einsum("thn,hnl->thl", q_nope, w_uk), q_pe], -1)
    o = mla_attention_ref(absorbed, cache.double(), meta, 0.3, dl)
    got = torch.einsum("thl,hvl->thv", o, w_uv)
    rows = cache.double()[meta.block_tables[0].long()].flatten(0, 1)[:9, 0]  # [9, Dk]
    k = torch.cat([torch.einsum("hnl,sl->hsn", w_uk, rows[:, :dl]),
                   rows[None, :, dl:].expand(nh, 9, dr)], -1)  # fmt: skip
    val = torch.einsum("hvl,sl->hsv", w_uv, rows[:, :dl])
    qf = torch.cat([q_nope, q_pe], -1).transpose(0, 1)  # [nh, 3, nope + dr]
    s = qf @ k.transpose(1, 2) * 0.3
    s = s.masked_fill(torch.arange(9)[None, :] > torch.arange(6, 9)[:, None], float("-inf"))
    want = (s.softmax(-1) @ val).transpose(0, 1)
    torch.testing.assert_close(got, want)


@needs_triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize(
    "nh,dl,dr,block_size", [(4, 32, 8, 4), (20, 64, 16, 16)], ids=["h4-bs4", "h20-bs16"]
)
def test_triton_mixed_batch_matches_reference(nh, dl, dr, block_size, dtype):
    """Decode rows to the split-KV kernel, longer rows to prefill/extend; head counts that do
    not fill a 16-head block, latent and rotary parts padded separately (dr=8 -> 16)."""
    q, cache, meta = _batch(MIXED, nh, dl, dr, block_size, dtype)
    out = mla_attention(q, cache, meta, 0.2, dl, backend="triton")
    ref = mla_attention_ref(q.float(), cache.float(), meta, 0.2, dl)
    torch.testing.assert_close(out.float(), ref, rtol=TOL[dtype], atol=TOL[dtype])


@needs_triton
@pytest.mark.parametrize("splits", [2, 8])
def test_triton_decode_split_kv(splits):
    """Forced splits: whole-tile segments, empty ones (a one-token context split 8 ways), and
    the log-sum-exp reduction."""
    from splitmoe.kernels.mla_decode import MlaTiles, mla_decode_attention

    q, cache, meta = _batch([(0, 1), (16, 1), (94, 1), (40, 1)], 4, 32, 8, 4, torch.float32, 2)
    out = torch.zeros(q.shape[0], 4, 32, device=DEVICE)
    tiles = MlaTiles(
        block_h=16, block_n=16, block_q=1, num_splits=splits, num_warps=4, num_stages=1
    )
    mla_decode_attention(q, cache, meta, 0.2, 32, out, tiles)
    ref = mla_attention_ref(q, cache, meta, 0.2, 32)
    torch.testing.assert_close(out, ref, rtol=2e-5, atol=2e-5)


@needs_triton
def test_triton_prefill_across_tiles():
    """Several tokens per program and several programs per chunk, unmasked prefix tiles and
    diagonal ones; the decode row is left to the decode kernel."""
    from splitmoe.kernels.mla_decode import MlaTiles
    from splitmoe.kernels.mla_prefill import mla_prefill_attention

    q, cache, meta = _batch([(0, 23), (37, 21), (3, 2), (0, 1)], 4, 32, 8, 4, torch.float32, 1)
    out = torch.zeros(q.shape[0], 4, 32, device=DEVICE)
    tiles = MlaTiles(block_h=16, block_n=16, block_q=4, num_splits=1, num_warps=4, num_stages=1)
    mla_prefill_attention(q, cache, meta, 0.2, 32, out, tiles)
    ref = mla_attention_ref(q, cache, meta, 0.2, 32)
    torch.testing.assert_close(out[:-1], ref[:-1], rtol=2e-5, atol=2e-5)
    assert not out[-1].any()


def test_rejects_bad_shapes():
    q, cache, meta = _batch([(3, 2)], 2, 32, 8, 4, torch.float32)
    with pytest.raises(ValueError, match="must be"):
        mla_attention(q[:, :, :16], cache, meta, 1.0, 32)
    with pytest.raises(ValueError, match="v_dim=64"):
        mla_attention(q, cache, meta, 1.0, 64)
