"""The CPU torch path of the grouped expert FFN (each of its GEMM paths) agrees with the
per-expert reference."""

from __future__ import annotations

import functools

import pytest
import torch

import splitmoe.kernels.fused_moe as fm
from splitmoe.kernels.cpu_choice import settle
from splitmoe.kernels.fused_moe import fused_moe, fused_moe_grouped_mm, fused_moe_ref

PATHS = ("wleft", "xleft", "per_expert", "native")


def _case(tokens: int, E: int, H: int, I: int, k: int, skew: float, skip: float, seed: int):
    g = torch.Generator().manual_seed(seed)
    w13 = torch.randn(E, 2 * I, H, generator=g) * H**-0.5
    w2 = torch.randn(E, H, I, generator=g) * I**-0.5
    x = torch.randn(tokens, H, generator=g)
    logits = torch.randn(tokens, E, generator=g) + skew * torch.linspace(0, 3, E)
    ids = logits.topk(k, dim=1).indices.to(torch.int32)
    ids[torch.rand(tokens, k, generator=g) < skip] = -1  # slots served by another rank
    w = torch.rand(tokens, k, generator=g)
    return x, w13, w2, ids, w


@pytest.fixture(params=PATHS)
def path(request, monkeypatch):
    """Forces `fused_moe_cpu` onto one of its GEMM paths."""
    forced = functools.partial(fm.fused_moe_cpu, path=request.param)
    monkeypatch.setitem(fm.MOE_KERNELS, "torch", forced)
    return request.param


@pytest.mark.parametrize("tokens", [0, 1, 2, 5, 32, 77])
@pytest.mark.parametrize("k", [1, 2, 4, 8])
@pytest.mark.parametrize("skip", [0.0, 0.4])
def test_each_path_matches_the_reference(path, tokens, k, skip):
    x, w13, w2, ids, w = _case(tokens, 8, 32, 16, k, skew=1.0, skip=skip, seed=tokens + 10 * k)
    want = fused_moe_ref(x, w13, w2, ids, w)
    torch.testing.assert_close(fused_moe(x, w13, w2, ids, w, "torch"), want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("tokens", [1, 3, 16])
def test_single_row_experts(path, tokens):
    """Experts with one row each (the W-left path sends those rows twice, the copy weighted 0),
    next to experts with many."""
    x, w13, w2, ids, w = _case(tokens, 16, 32, 16, 2, skew=0.0, skip=0.0, seed=7)
    ids[:, 0] = 0  # every token on expert 0; the second slot mostly alone on its expert
    ids[:, 1] = torch.arange(1, tokens + 1, dtype=torch.int32) % 16
    want = fused_moe_ref(x, w13, w2, ids, w)
    torch.testing.assert_close(fused_moe(x, w13, w2, ids, w, "torch"), want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_16_bit(path, dtype):
    """bfloat16 runs every path; float16 has no grouped GEMM or oneDNN kernel here, so it
    takes the per-expert path on ``F.linear``."""
    x, w13, w2, ids, w = _case(24, 8, 32, 16, 2, skew=0.0, skip=0.2, seed=3)
    want = fused_moe_ref(x, w13, w2, ids, w)
    got = fused_moe(x.to(dtype), w13.to(dtype), w2.to(dtype), ids, w, "torch")
    assert got.dtype == dtype
    torch.testing.assert_close(got.float(), want, rtol=3e-2, atol=3e-2)


def test_sizes_the_grouped_mm_cannot_take(path):
    """H and I not multiples of 4 floats: every path falls back to one GEMM per expert."""
    x, w13, w2, ids, w = _case(9, 6, 12, 10, 2, skew=0.0, skip=0.3, seed=5)
    want = fused_moe_ref(x, w13, w2, ids, w)
    torch.testing.assert_close(fused_moe(x, w13, w2, ids, w, "torch"), want, rtol=1e-5, atol=1e-5)


def test_no_local_expert_gives_zeros(path):
    x, w13, w2, ids, w = _case(6, 8, 32, 16, 3, skew=0.0, skip=0.0, seed=0)
    ids.fill_(-1)
    assert torch.equal(fused_moe(x, w13, w2, ids, w, "torch"), torch.zeros_like(x))


def test_grouped_mm_path_matches_the_reference():
    """`fused_moe_grouped_mm` (the GPU's x-left form, here on CPU)."""
    x, w13, w2, ids, w = _case(40, 8, 32, 16, 4, skew=2.0, skip=0.4, seed=1)
    want = fused_moe_ref(x, w13, w2, ids, w)
    got = fused_moe_grouped_mm(x, w13, w2, ids, w)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_measured_choice_matches_the_reference():
    """Unforced, a shape class runs its default layout until it is settled (`moe_trials`,
    measured on made-up tokens before serving), then the kept one alone: every output matches
    the reference, and once decided they repeat bit for bit."""
    x, w13, w2, ids, w = _case(32, 8, 32, 16, 4, skew=1.0, skip=0.2, seed=11)
    want = fused_moe_ref(x, w13, w2, ids, w)
    torch.testing.assert_close(fused_moe(x, w13, w2, ids, w, "torch"), want, rtol=1e-5, atol=1e-5)
    pairs = int((ids >= 0).sum())
    settle(fm.moe_trials([(w13, w2)], {}, [pairs], 4, 4, x.dtype))
    decision = fm.cpu_moe_decision(x, w13, ids)
    assert decision is not None and decision.choice in fm.CPU_MOE_PATHS
    kept = fused_moe(x, w13, w2, ids, w, "torch")
    torch.testing.assert_close(kept, want, rtol=1e-5, atol=1e-5)
    assert torch.equal(fused_moe(x, w13, w2, ids, w, "torch"), kept)
    forced = fm.fused_moe_cpu(x, w13, w2, ids, w, path=decision.choice)
    assert torch.equal(kept, forced)
