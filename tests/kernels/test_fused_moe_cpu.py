"""The CPU torch paths of the grouped expert FFN agree with the per-expert reference."""

from __future__ import annotations

import pytest
import torch

from splitmoe.kernels.fused_moe import (
    fused_moe_cpu,
    fused_moe_grouped_cpu,
    fused_moe_grouped_mm,
    fused_moe_padded_bmm,
    fused_moe_ref,
)

E, H, I, K = 8, 32, 16, 3


def _case(tokens: int, skew: float, skip: float, seed: int):
    g = torch.Generator().manual_seed(seed)
    w13 = torch.randn(E, 2 * I, H, generator=g) * 0.1
    w2 = torch.randn(E, H, I, generator=g) * 0.1
    x = torch.randn(tokens, H, generator=g)
    logits = torch.randn(tokens, E, generator=g) + skew * torch.linspace(0, 3, E)
    ids = logits.topk(K, dim=1).indices.to(torch.int32)
    ids[torch.rand(tokens, K, generator=g) < skip] = -1  # slots served by another rank
    w = torch.rand(tokens, K, generator=g)
    return x, w13, w2, ids, w


@pytest.mark.parametrize("tokens", [1, 5, 32, 77])
@pytest.mark.parametrize("skew", [0.0, 2.0])
@pytest.mark.parametrize("skip", [0.0, 0.4])
def test_cpu_paths_match_the_reference(tokens, skew, skip):
    x, w13, w2, ids, w = _case(tokens, skew, skip, seed=tokens)
    want = fused_moe_ref(x, w13, w2, ids, w)
    for path in (fused_moe_cpu, fused_moe_grouped_mm, fused_moe_padded_bmm):
        torch.testing.assert_close(path(x, w13, w2, ids, w), want, rtol=1e-5, atol=1e-5)
    # The CPU grouped path adds each expert's rows in the reference's order: the same bits.
    assert torch.equal(fused_moe_grouped_cpu(x, w13, w2, ids, w), want)


def test_no_local_expert_gives_zeros():
    x, w13, w2, ids, w = _case(6, 0.0, 0.0, seed=0)
    ids.fill_(-1)
    assert torch.equal(fused_moe_cpu(x, w13, w2, ids, w), torch.zeros_like(x))
