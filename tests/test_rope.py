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
    model = SimpleNamespace(inv_freq=inv_freq, _rope_table=None, rope_scale=scale)
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
