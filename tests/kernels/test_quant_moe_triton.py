"""The fused-MoE Triton kernels reading experts kept quantized (FP8 blocks, MXFP4 nibbles) against
dequantize-then-`fused_moe_ref`. Without a GPU the kernels run in Triton's interpreter (tiny
shapes). The dequantization here is the test's own, written from the layout contract, not the
runtime's."""

from __future__ import annotations

import os

import pytest
import torch

from splitmoe.kernels.fused_moe import fused_moe_ref
from splitmoe.kernels.quant import FP4_VALUES, QuantizedWeight

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
pytestmark = pytest.mark.skipif(
    DEVICE == "cpu" and os.environ.get("TRITON_INTERPRET") != "1",
    reason="without CUDA, Triton kernels run only under TRITON_INTERPRET=1 (conftest.py)",
)
# float32: exact products and float32 sums in another order; 16 bits: one rounding of the
# dequantized weight and of the activations between the GEMMs
TOL = {torch.float32: 1e-5, torch.float16: 3e-3}


def dequant_fp8(q: QuantizedWeight) -> torch.Tensor:
    bn, bk = q.block
    N, K = q.shape[-2:]
    s = q.scale.repeat_interleave(bn, -2)[..., :N, :].repeat_interleave(bk, -1)[..., :K]
    return q.data.float() * s


def dequant_mxfp4(q: QuantizedWeight) -> torch.Tensor:
    lut = torch.tensor(FP4_VALUES, device=q.data.device)
    d = q.data.long()
    vals = torch.stack([lut[d & 15], lut[d >> 4]], -1).flatten(-2)  # [..., N, K]: low nibble 1st
    return vals * torch.exp2(q.scale.float() - 127).repeat_interleave(32, -1)


def dequant(q):
    if not isinstance(q, QuantizedWeight):
        return q.float()
    return dequant_fp8(q) if q.fmt == "fp8" else dequant_mxfp4(q)


def random_fp8(shape, block, g) -> QuantizedWeight:
    *lead, N, K = shape
    data = torch.randint(0, 256, shape, generator=g, dtype=torch.uint8)
    data[(data & 0x7F) == 0x7F] = 0x38  # the NaN codes -> 1.0
    bn, bk = block
    # every code (subnormals, 448) times scales spread over 2^-14 .. 2^-7: weights ~ 1e-2
    scale = torch.exp2(-7 - 7 * torch.rand(*lead, -(-N // bn), -(-K // bk), generator=g))
    return QuantizedWeight(
        data.view(torch.float8_e4m3fn).to(DEVICE), scale.to(DEVICE), "fp8", block
    )


def random_mxfp4(shape, g) -> QuantizedWeight:
    *lead, N, K = shape
    data = torch.randint(0, 256, (*lead, N, K // 2), generator=g, dtype=torch.uint8)
    scale = torch.randint(120, 126, (*lead, N, K // 32), generator=g, dtype=torch.uint8)
    return QuantizedWeight(data.to(DEVICE), scale.to(DEVICE), "mxfp4", (1, 32))


def routing(n, k, E, g):
    # experts 0..E-2 only, so expert E-1 gets no token; -1 marks slots served elsewhere
    ids = torch.randint(-1, E - 1, (n, k), generator=g)
    if n:
        ids[0, 0] = 0  # never all -1: the output is not all zeros
    if n > 2:
        ids[1] = -1  # a token with no expert here at all
    return ids.to(DEVICE), torch.rand(n, k, generator=g).to(DEVICE)


def check(out, x, w13, w2, ids, w, **ffn):
    """Against the contract's math: dequantize to float32, cast to the run dtype, then the GEMMs
    (in float32, so the reference is not the one rounding)."""
    d13, d2 = (dequant(q).to(x.dtype).float() for q in (w13, w2))
    ref = fused_moe_ref(x.float(), d13, d2, ids, w, **ffn)
    err = (out.float() - ref).abs().max() / ref.abs().max()
    assert err <= TOL[x.dtype], f"max error {err:.2e} relative to the output scale"


def run(x, w13, w2, ids, w, **kw):
    from splitmoe.kernels.moe_gemm import fused_moe_triton

    return fused_moe_triton(x, w13, w2, ids, w, **kw)


@pytest.mark.parametrize("n,k", [(1, 1), (5, 2), (33, 2)])
@pytest.mark.parametrize(
    "block,decode",
    [((32, 32), "native"), ((16, 24), "native"), ((32, 32), "bits")],
    ids=["32x32", "16x24-gather", "32x32-bits"],
)
def test_fp8_experts(n, k, block, decode):
    """H 80 is 2.5 blocks of 32 (a partial last block); bk 24 is no multiple of 16, so each K
    tile gathers its scales per element; "bits" decodes e4m3 with integer ops (pre-sm_89)."""
    g = torch.Generator().manual_seed(n * 10 + k)
    E, H, I = 4, 80, 64
    w13, w2 = random_fp8((E, 2 * I, H), block, g), random_fp8((E, H, I), block, g)
    x = torch.randn(n, H, generator=g).to(DEVICE)
    ids, w = routing(n, k, E, g)
    out = run(x, w13, w2, ids, w, fp8_bits=decode == "bits")
    check(out, x, w13, w2, ids, w)


@pytest.mark.parametrize("n,k", [(1, 1), (5, 2), (33, 2)])
def test_mxfp4_experts_with_gpt_oss_biases_and_clamp(n, k):
    g = torch.Generator().manual_seed(n * 10 + k)
    E, H, I = 4, 96, 64  # H: one and a half K tiles of 64
    w13, w2 = random_mxfp4((E, 2 * I, H), g), random_mxfp4((E, H, I), g)
    x = torch.randn(n, H, generator=g).to(DEVICE)
    ids, w = routing(n, k, E, g)
    ffn = dict(
        b13=torch.randn(E, 2 * I, generator=g).to(DEVICE),
        b2=torch.randn(E, H, generator=g).to(DEVICE),
        swiglu_limit=0.8,
        swiglu_alpha=1.702,
    )
    check(run(x, w13, w2, ids, w, **ffn), x, w13, w2, ids, w, **ffn)


@pytest.mark.parametrize("fmt", ["fp8", "mxfp4"])
def test_small_tiles_and_float16(fmt):
    """16x16x16 tiles: K loops of several steps, experts over several row blocks, grouped tile
    ordering, int64 expert ids; activations in float16."""
    from splitmoe.kernels.moe_gemm import MoeTiles

    g = torch.Generator().manual_seed(7)
    E, H, I = 5, 64, 32
    if fmt == "fp8":
        w13, w2 = random_fp8((E, 2 * I, H), (16, 32), g), random_fp8((E, H, I), (16, 32), g)
    else:
        w13, w2 = random_mxfp4((E, 2 * I, H), g), random_mxfp4((E, H, I), g)
    x = torch.randn(23, H, generator=g).to(DEVICE)
    ids, w = routing(23, 3, E, g)
    tiles = MoeTiles(block_m=16, block_n=16, block_k=16, group_m=2, num_warps=4, num_stages=1)
    check(run(x, w13, w2, ids.long(), w, tiles=tiles), x, w13, w2, ids, w)
    x = x.half()
    check(run(x, w13, w2, ids, w), x, w13, w2, ids, w)


def test_quantized_gate_up_with_dense_down():
    g = torch.Generator().manual_seed(3)
    E, H, I = 3, 64, 32
    w13 = random_fp8((E, 2 * I, H), (32, 32), g)
    w2 = (torch.randn(E, H, I, generator=g) / I**0.5).to(DEVICE)
    x = torch.randn(6, H, generator=g).to(DEVICE)
    ids, w = routing(6, 2, E, g)
    check(run(x, w13, w2, ids, w), x, w13, w2, ids, w)


def test_test_dequantization_is_the_containers():
    """This file's dequantization agrees with `QuantizedWeight.dequantize` (the CPU path's)."""
    g = torch.Generator().manual_seed(0)
    for q in (random_fp8((2, 40, 80), (16, 24), g), random_mxfp4((2, 8, 64), g)):
        assert torch.equal(dequant(q), q.dequantize(torch.float32))


def test_no_tokens_and_no_local_experts():
    g = torch.Generator().manual_seed(0)
    w13, w2 = random_mxfp4((3, 64, 32), g), random_mxfp4((3, 32, 32), g)
    x = torch.randn(0, 32).to(DEVICE)
    ids, w = routing(0, 2, 3, g)
    assert run(x, w13, w2, ids, w).shape == (0, 32)
    x = torch.randn(4, 32).to(DEVICE)
    ids = torch.full((4, 2), -1, device=DEVICE)
    assert not run(x, w13, w2, ids, torch.rand(4, 2).to(DEVICE)).any()


def test_rejects_what_the_kernels_cannot_read():
    g = torch.Generator().manual_seed(0)
    w13, w2 = random_fp8((3, 64, 32), (16, 16), g), random_fp8((3, 32, 32), (16, 16), g)
    x = torch.randn(4, 32).to(DEVICE)
    ids, w = routing(4, 2, 3, g)
    with pytest.raises(ValueError, match="dense weight must have x's dtype"):
        run(x, w13, torch.randn(3, 32, 32, dtype=torch.float64).to(DEVICE), ids, w)
    with pytest.raises(ValueError, match="shapes do not fit"):
        run(x, w13, random_fp8((3, 32, 16), (16, 16), g), ids, w)
    with pytest.raises(ValueError, match="integers"):
        run(x, w13, w2, ids.float(), w)


def act_quant_ref(t: torch.Tensor) -> torch.Tensor:
    """``t`` through e4m3 in groups of 128 along its rows (amax -> 448), back to float32."""
    out = torch.empty_like(t, dtype=torch.float32)
    for c in range(0, t.shape[1], 128):
        g = t[:, c : c + 128].float()
        s = g.abs().amax(1, keepdim=True).clamp(min=1e-12) / 448
        out[:, c : c + 128] = (g / s).to(torch.float8_e4m3fn).float() * s
    return out


def w8a8_ref(x, w13, w2, ids, w):
    """Per (token, slot): the FFN with x and the intermediate each rounded through e4m3."""
    I = w2.shape[-1]
    d13, d2 = dequant(w13), dequant(w2)
    xq = act_quant_ref(x)
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    for t, j in (ids >= 0).nonzero().tolist():
        e = int(ids[t, j])
        h = xq[t] @ d13[e].t()  # [2I]
        h = torch.nn.functional.silu(h[:I]) * h[I:]
        out[t] += w[t, j] * (act_quant_ref(h.to(x.dtype)[None])[0] @ d2[e].t())
    return out


@pytest.mark.parametrize(
    "n,k,block", [(1, 1, (128, 128)), (5, 2, (32, 64)), (33, 2, (32, 64))], ids=str
)
def test_w8a8_fp8_activations_in_groups_of_128(n, k, block):
    """H 160: a whole activation group and a partial one; K tiles inside both one group and one
    weight block. Against the same math in PyTorch, and near the exact W8A16 result."""
    g = torch.Generator().manual_seed(n)
    E, H, I = 4, 160, 128
    w13, w2 = random_fp8((E, 2 * I, H), block, g), random_fp8((E, H, I), block, g)
    x = torch.randn(n, H, generator=g).to(DEVICE)
    ids, w = routing(n, k, E, g)
    out = run(x, w13, w2, ids, w, act_fp8=True)
    ref = w8a8_ref(x, w13, w2, ids, w)
    scale = ref.abs().max()
    # an e4m3 rounding of h may fall the other way after float32 sums in another order
    assert (out - ref).abs().max() <= 1e-2 * scale
    assert (out - ref).abs().mean() <= 1e-4 * scale
    exact = run(x, w13, w2, ids, w)
    assert (out - exact).abs().max() <= 0.1 * scale  # 3 mantissa bits on the activations


def test_w8a8_refuses_what_it_cannot_run():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(4, 64).to(DEVICE)
    ids, w = routing(4, 2, 3, g)
    w13, w2 = random_mxfp4((3, 64, 64), g), random_mxfp4((3, 64, 32), g)
    with pytest.raises(ValueError, match="float8_e4m3fn weights"):
        run(x, w13, w2, ids, w, act_fp8=True)
    w13, w2 = random_fp8((3, 64, 64), (16, 24), g), random_fp8((3, 64, 32), (16, 24), g)
    with pytest.raises(ValueError, match="no K tile"):
        run(x, w13, w2, ids, w, act_fp8=True)


def test_k_tiles_narrow_to_one_scale_per_row_where_they_can():
    """FP8 K tiles that fit inside one bk block load one scale per row, not a gathered tile."""
    from splitmoe.kernels.moe_gemm import WFMT_FP8, WFMT_FP8_BITS, weight_args

    g = torch.Generator().manual_seed(0)
    cases = [((128, 128), 64, 64, True), ((32, 96), 128, 32, True), ((16, 24), 64, 64, False)]
    for block, block_k, want_k, uniform in cases:
        wa = weight_args(random_fp8((2, 32, 96), block, g), block_k, fp8_bits=False)
        assert (wa.block_k, wa.k_uniform, wa.wfmt) == (want_k, uniform, WFMT_FP8.value)
    wa = weight_args(random_fp8((2, 32, 96), (32, 32), g), 64, fp8_bits=True)
    assert wa.wfmt == WFMT_FP8_BITS.value and wa.data.dtype == torch.uint8
    # W8A8: inside one activation group of 128 too
    assert weight_args(random_fp8((2, 32, 96), (32, 256), g), 256, act_fp8=True).block_k == 128
