"""`AttentionModel.rope`'s table of positions (CPU, `rope_table`) gives exactly the values it
computes."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from splitmoe.attention_nodes.model import AttentionModel, rope_rows


@pytest.mark.parametrize("scale", [1.0, 1.1386], ids=["plain", "yarn-factor"])
@pytest.mark.parametrize("d,theta", [(32, 10000.0), (128, 1e6), (20, 500.0)])
def test_rope_table_rows_equal_computed_values(d, theta, scale):
    inv_freq = 1.0 / (theta ** (torch.arange(0, d, 2, dtype=torch.float32) / d))
    model = SimpleNamespace(inv_freq=inv_freq, rope_factor=scale, _rope_table=None)
    model.rope_table = lambda top, dtype: AttentionModel.rope_table(model, top, dtype)
    g = torch.Generator().manual_seed(d)
    # decode-like and prefill-like positions, then past the table (it grows)
    for top in (16, 900, 3000, 70000):
        for n in (1, 7, 64):
            positions = torch.randint(0, top, (n,), generator=g)
            cos, sin = AttentionModel.rope(model, positions, torch.float32)
            want_cos, want_sin = rope_rows(inv_freq, positions, scale)
            assert cos.shape == sin.shape == (n, 1, d)
            assert torch.equal(cos[:, 0], want_cos) and torch.equal(sin[:, 0], want_sin)
        assert model._rope_table[0].shape[0] > positions.max()
    half = AttentionModel.rope(model, torch.tensor([5, 9]), torch.bfloat16)
    assert half[0].dtype == torch.bfloat16
    want = rope_rows(inv_freq, torch.tensor([5, 9]), scale)[0].bfloat16()
    assert torch.equal(half[0][:, 0], want)


@pytest.mark.parametrize("d,rotary_dim", [(16, 8), (16, 4), (128, 64), (32, 32)])
def test_partial_rotary_matches_hf(d, rotary_dim):
    """Partial rotary (GLM-4.5's ``partial_rotary_factor``, MiniMax-M2's ``rotary_dim``): the
    first ``rotary_dim`` dims of each head rotate as a half-split pair, the rest pass through,
    bit for bit as HF's ``apply_rotary_pos_emb``."""
    from transformers.models.glm4_moe.modeling_glm4_moe import apply_rotary_pos_emb

    theta = 10000.0
    inv_freq = 1.0 / (theta ** (torch.arange(0, rotary_dim, 2, dtype=torch.float32) / rotary_dim))
    g = torch.Generator().manual_seed(d + rotary_dim)
    T, heads = 7, 3
    q = torch.randn(T, heads, d, generator=g)
    k = torch.randn(T, 1, d, generator=g)
    positions = torch.tensor([0, 1, 5, 17, 100, 255, 4000])
    cos, sin = rope_rows(inv_freq, positions)
    got_q = AttentionModel.apply_rope(q, (cos[:, None], sin[:, None]))
    got_k = AttentionModel.apply_rope(k, (cos[:, None], sin[:, None]))
    freqs = positions[:, None].float() * inv_freq[None, :]
    emb = torch.cat([freqs, freqs], dim=-1)[None]  # HF's [1, T, rd]
    want_q, want_k = apply_rotary_pos_emb(
        q.transpose(0, 1)[None], k.transpose(0, 1)[None], emb.cos(), emb.sin()
    )
    assert torch.equal(got_q, want_q[0].transpose(0, 1))
    assert torch.equal(got_k, want_k[0].transpose(0, 1))
    assert torch.equal(got_q[..., rotary_dim:], q[..., rotary_dim:])
