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


@pytest.mark.parametrize("n,k", [(0, 2), (1, 1), (9, 2), (17, 4), (5, 8)])
@pytest.mark.parametrize("H,I", [(12, 10), (32, 16)])
def test_matches_naive_loop(n, k, H, I):
    g = torch.Generator().manual_seed(n)
    E = 6
    x = torch.randn(n, H, generator=g)
    # fan-in scaled: outputs O(1), not O(sqrt(H)), where float32 sums in another order differ
    # by more than the 1e-5 tolerance
    w13 = torch.randn(E, 2 * I, H, generator=g) * H**-0.5
    w2 = torch.randn(E, H, I, generator=g) * I**-0.5
    # experts 0..E-1 chosen so that expert 5 gets no token; -1 marks slots served elsewhere
    ids = torch.randint(-1, E - 1, (n, k), generator=g)
    w = torch.rand(n, k, generator=g)
    want = _naive(x, w13, w2, ids, w)
    torch.testing.assert_close(fused_moe_ref(x, w13, w2, ids, w), want)
    # the public torch entry (on CPU `fused_moe_cpu`, whichever GEMMs it picks)
    torch.testing.assert_close(fused_moe(x, w13, w2, ids, w, "torch"), want)


def test_rejects_bad_shapes():
    with pytest.raises(ValueError, match="shapes do not fit"):
        fused_moe(
            torch.zeros(2, 8),
            torch.zeros(3, 10, 7),
            torch.zeros(3, 8, 5),
            torch.zeros(2, 1, dtype=torch.long),
            torch.zeros(2, 1),
        )


def test_rejects_unknown_backend():
    with pytest.raises(ValueError, match="'torch' or 'triton'"):
        fused_moe(
            torch.zeros(2, 8),
            torch.zeros(3, 10, 8),
            torch.zeros(3, 8, 5),
            torch.zeros(2, 1, dtype=torch.long),
            torch.zeros(2, 1),
            "cpu",
        )
