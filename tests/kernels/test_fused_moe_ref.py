"""The grouped-FFN reference against a per-token, per-expert loop."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from splitmoe.kernels.fused_moe import fused_moe, fused_moe_ref


def _naive(x, w13, w2, ids, w):
    inter = w2.shape[2]
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for j in range(ids.shape[1]):
            e = int(ids[t, j])
            if e < 0:
                continue
            h = w13[e] @ x[t]
            out[t] += w[t, j] * (w2[e] @ (F.silu(h[:inter]) * h[inter:]))
    return out


@pytest.mark.parametrize("n,k", [(0, 2), (1, 1), (9, 2), (17, 4)])
def test_matches_naive_loop(n, k):
    g = torch.Generator().manual_seed(n)
    E, H, I = 6, 12, 10
    x = torch.randn(n, H, generator=g)
    w13 = torch.randn(E, 2 * I, H, generator=g)
    w2 = torch.randn(E, H, I, generator=g)
    # experts 0..E-1 chosen so that expert 5 gets no token; -1 marks slots served elsewhere
    ids = torch.randint(-1, E - 1, (n, k), generator=g)
    w = torch.rand(n, k, generator=g)
    torch.testing.assert_close(fused_moe_ref(x, w13, w2, ids, w), _naive(x, w13, w2, ids, w))


def test_rejects_bad_shapes():
    with pytest.raises(ValueError, match="shapes do not fit"):
        fused_moe(
            torch.zeros(2, 8),
            torch.zeros(3, 10, 7),
            torch.zeros(3, 8, 5),
            torch.zeros(2, 1, dtype=torch.long),
            torch.zeros(2, 1),
        )
