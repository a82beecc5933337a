"""The fused-MoE Triton kernels, the expert sort behind them, and the torch._grouped_mm path,
against the reference. Without a GPU the kernels run in Triton's interpreter (tiny shapes)."""

from __future__ import annotations

import os
import sys

import pytest
import torch

from splitmoe.kernels.expert_sort import sort_by_expert
from splitmoe.kernels.fused_moe import fused_moe, fused_moe_grouped_mm, fused_moe_ref

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TOL = {torch.float32: 2e-5, torch.float16: 2e-3}


def _triton_ready():
    """Skip marker for tests that launch Triton kernels."""
    try:
        import triton  # noqa: F401
    except ImportError:
        return pytest.mark.skip(reason="triton is not installed")
    return pytest.mark.skipif(
        DEVICE == "cpu" and os.environ.get("TRITON_INTERPRET") != "1",
        reason="without CUDA, Triton kernels run only under TRITON_INTERPRET=1 (conftest.py)",
    )


def _problem(n, k, E, H, I, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, H, generator=g)
    w13 = torch.randn(E, 2 * I, H, generator=g) / H**0.5
    w2 = torch.randn(E, H, I, generator=g) / I**0.5
    # Experts 0..E-2 only, so expert E-1 gets no token; -1 marks slots served by another rank.
    ids = torch.randint(-1, E - 1, (n, k), generator=g)
    if n > 2:
        ids[1] = -1  # a token with no expert here at all
    w = torch.rand(n, k, generator=g)  # float32, as the transport delivers them
    x, w13, w2 = (t.to(DEVICE, dtype) for t in (x, w13, w2))
    return x, w13, w2, ids.to(DEVICE), w.to(DEVICE)


def _check(out, x, w13, w2, ids, w):
    ref = fused_moe_ref(x.float(), w13.float(), w2.float(), ids, w)
    tol = TOL[x.dtype]
    torch.testing.assert_close(out.float(), ref, rtol=tol, atol=tol)


@_triton_ready()
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("n,k", [(1, 1), (9, 2), (17, 4)])
def test_triton_matches_reference(n, k, dtype):
    x, w13, w2, ids, w = _problem(n, k, E=6, H=64, I=32, dtype=dtype, seed=n)
    _check(fused_moe(x, w13, w2, ids, w, backend="triton"), x, w13, w2, ids, w)


@_triton_ready()
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
def test_triton_small_tiles_ragged_shapes(dtype):
    """16x16x16 tiles on H=48, I=40: K loops of several steps, ragged column tiles, experts
    spanning several row blocks, grouped tile ordering, int64 expert ids."""
    from splitmoe.kernels.moe_gemm import MoeTiles, fused_moe_triton

    x, w13, w2, ids, w = _problem(23, 3, E=5, H=48, I=40, dtype=dtype, seed=3)
    tiles = MoeTiles(block_m=16, block_n=16, block_k=16, group_m=2, num_warps=4, num_stages=1)
    _check(fused_moe_triton(x, w13, w2, ids.long(), w, tiles), x, w13, w2, ids, w)


@_triton_ready()
def test_triton_no_tokens_and_no_local_experts():
    x, w13, w2, ids, w = _problem(0, 2, E=4, H=64, I=32, dtype=torch.float32)
    assert fused_moe(x, w13, w2, ids, w, backend="triton").shape == (0, 64)
    x, w13, w2, ids, w = _problem(3, 2, E=4, H=64, I=32, dtype=torch.float32)
    ids = torch.full_like(ids, -1)  # every slot served elsewhere
    assert not fused_moe(x, w13, w2, ids, w, backend="triton").any()


def test_sort_by_expert_pads_each_expert_to_the_tile():
    ids = torch.tensor([[0, 2], [2, -1], [0, 0]])  # pairs 0..5; expert 1 and 3 unused
    s = sort_by_expert(ids, num_experts=4, block_m=4)
    pad = 6
    assert s.sorted_ids.tolist()[:8] == [0, 4, 5, pad, 1, 2, pad, pad]
    assert (s.sorted_ids[8:] == pad).all()
    assert s.block_expert.tolist()[:2] == [0, 2]
    assert (s.block_expert[2:] == -1).all()


@pytest.mark.skipif(not hasattr(torch, "_grouped_mm"), reason="torch._grouped_mm not in torch")
def test_grouped_mm_path_matches_reference():
    x, w13, w2, ids, w = _problem(17, 4, E=6, H=64, I=32, dtype=torch.float32, seed=5)
    if DEVICE == "cuda":  # the CUDA kernel is bfloat16-only
        x, w13, w2 = x.bfloat16(), w13.bfloat16(), w2.bfloat16()
    out = fused_moe_grouped_mm(x, w13, w2, ids, w)
    ref = fused_moe_ref(x.float(), w13.float(), w2.float(), ids, w)
    tol = 2e-5 if x.dtype == torch.float32 else 5e-2
    torch.testing.assert_close(out.float(), ref, rtol=tol, atol=tol)


def test_rejects_what_the_kernels_cannot_read():
    x, w13, w2, ids, w = _problem(3, 2, E=4, H=64, I=32, dtype=torch.float32)
    with pytest.raises(ValueError, match="must share one of"):
        fused_moe(x, w13.half(), w2, ids, w, backend="triton")
    with pytest.raises(ValueError, match="integers"):
        fused_moe(x, w13, w2, ids.float(), w, backend="triton")
    with pytest.raises(ValueError, match="contiguous"):
        fused_moe(x, w13.transpose(1, 2).contiguous().transpose(1, 2), w2, ids, w, "triton")
    with pytest.raises(ValueError, match="not available"):
        fused_moe(x, w13, w2, ids, w, backend="cutlass")


def test_missing_triton_names_the_fix(monkeypatch):
    x, w13, w2, ids, w = _problem(3, 2, E=4, H=64, I=32, dtype=torch.float32)
    monkeypatch.setitem(sys.modules, "triton", None)  # `import triton` raises ImportError
    with pytest.raises(RuntimeError, match="pip install triton"):
        fused_moe(x, w13, w2, ids, w, backend="triton")
