"""`linear_quant_triton` (a linear reading a QuantizedWeight in its released layout) against
dequantize-then-``F.linear``, and its in-register decoders against every FP8 and FP4 code.
Without a GPU the kernel runs in Triton's interpreter (tiny shapes)."""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

from splitmoe.kernels.quant import QuantizedWeight

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
pytestmark = pytest.mark.skipif(
    DEVICE == "cpu" and os.environ.get("TRITON_INTERPRET") != "1",
    reason="without CUDA, Triton kernels run only under TRITON_INTERPRET=1 (conftest.py)",
)


def _linear(*args, **kw):
    from splitmoe.kernels.quant_linear import linear_quant_triton

    return linear_quant_triton(*args, **kw)


@pytest.mark.parametrize("decode", ["native", "bits"])
def test_every_fp8_code_decodes_exactly(decode):
    """An identity x reads W^T back: all 254 finite e4m3 codes (subnormals, +-448), bit for bit."""
    codes = torch.arange(256, dtype=torch.uint8)
    codes[[0x7F, 0xFF]] = 0  # NaN
    data = codes.view(torch.float8_e4m3fn).view(16, 16).to(DEVICE)
    w = QuantizedWeight(data, torch.ones(1, 1, device=DEVICE), "fp8", (128, 128))
    y = _linear(torch.eye(16, device=DEVICE), w, fp8_bits=decode == "bits")
    assert torch.equal(y, data.float().t())


def test_every_fp4_byte_and_scale_decodes_exactly():
    data = torch.arange(256, dtype=torch.uint8).view(8, 32).to(DEVICE)  # [N 8, K 64]
    scale = torch.tensor([[127, 128], [100, 1], [150, 126], [130, 127], [0, 2], [127, 127],
                          [3, 140], [127, 127]], dtype=torch.uint8).to(DEVICE)  # fmt: skip
    w = QuantizedWeight(data, scale, "mxfp4", (1, 32))
    y = _linear(torch.eye(64, device=DEVICE), w)
    lut = torch.tensor([0, 0.5, 1, 1.5, 2, 3, 4, 6], device=DEVICE)
    lut = torch.cat([lut, -lut])
    d = data.long()
    vals = torch.stack([lut[d & 15], lut[d >> 4]], -1).flatten(-2)  # [8, 64], low nibble first
    want = vals * torch.exp2(scale.double() - 127).repeat_interleave(32, -1)  # 2^-127 in double
    assert torch.equal(y, want.float().t())


def _fp8(N, K, block, g):
    data = (torch.randn(N, K, generator=g) * 40).to(torch.float8_e4m3fn)
    bn, bk = block
    scale = torch.rand(-(-N // bn), -(-K // bk), generator=g) / 400 + 1e-3
    return QuantizedWeight(data.to(DEVICE), scale.to(DEVICE), "fp8", block)


def _mxfp4(N, K, g):
    data = torch.randint(0, 256, (N, K // 2), generator=g, dtype=torch.uint8)
    scale = torch.randint(121, 125, (N, K // 32), generator=g, dtype=torch.uint8)
    return QuantizedWeight(data.to(DEVICE), scale.to(DEVICE), "mxfp4", (1, 32))


@pytest.mark.parametrize("T", [1, 5, 33])
@pytest.mark.parametrize(
    "fmt,block", [("fp8", (16, 32)), ("fp8", (16, 40)), ("fp8", (128, 128)), ("mxfp4", (1, 32))]
)
def test_matches_dequantize_then_linear(T, fmt, block):
    """N 40 and K 96 split into no whole number of 16 x 40 or 128 x 128 blocks; bk 40 gathers
    each K tile's scales per element; a bias on odd T."""
    g = torch.Generator().manual_seed(T)
    N, K = 40, 96
    w = _fp8(N, K, block, g) if fmt == "fp8" else _mxfp4(N, K, g)
    x = torch.randn(T, K, generator=g).to(DEVICE)
    bias = torch.randn(N, generator=g).to(DEVICE) if T % 2 else None
    y = _linear(x, w, bias)
    dense = w.dequantize(torch.float32)
    ref = F.linear(x, dense, bias)
    assert y.shape == (T, N) and y.dtype == x.dtype
    assert (y - ref).abs().max() <= 1e-5 * ref.abs().max()
    if fmt == "fp8":  # the container's dequantization is the test's, block by block
        s = w.scale.repeat_interleave(block[0], 0)[:N].repeat_interleave(block[1], 1)[:, :K]
        assert torch.equal(dense, w.data.float() * s)


def test_float16_small_tiles_and_a_dense_weight():
    from splitmoe.kernels.quant_linear import LinearTiles, linear_quant_ref

    g = torch.Generator().manual_seed(0)
    x = torch.randn(21, 64, generator=g).to(DEVICE).half()
    w = _fp8(48, 64, (16, 16), g)
    tiles = LinearTiles(block_m=16, block_n=16, block_k=16, group_m=2, num_warps=4, num_stages=1)
    ref = F.linear(x.float(), w.dequantize(torch.float16).float())
    for y in (_linear(x, w, tiles=tiles), _linear(x, w)):
        assert y.dtype == torch.float16
        assert (y.float() - ref).abs().max() <= 2e-3 * ref.abs().max()
    dense = torch.randn(48, 64, generator=g).to(DEVICE).half()
    torch.testing.assert_close(_linear(x, dense), linear_quant_ref(x, dense), rtol=2e-3, atol=2e-3)


def test_rejects_what_it_cannot_read():
    g = torch.Generator().manual_seed(0)
    w = _fp8(32, 64, (16, 16), g)
    with pytest.raises(ValueError, match=r"must be \[..., K\] and \[N, K\]"):
        _linear(torch.randn(3, 32).to(DEVICE), w)
    with pytest.raises(ValueError, match="bias"):
        _linear(torch.randn(3, 64).to(DEVICE), w, torch.zeros(31, device=DEVICE))
    with pytest.raises(ValueError, match="float16/bfloat16/float32"):
        _linear(torch.randn(3, 64, dtype=torch.float64).to(DEVICE), w)
    assert _linear(torch.randn(0, 64).to(DEVICE), w).shape == (0, 32)


def test_leading_dims_are_tokens():
    g = torch.Generator().manual_seed(1)
    w = _mxfp4(32, 64, g)
    x = torch.randn(2, 3, 64, generator=g).to(DEVICE)
    y = _linear(x, w)
    assert y.shape == (2, 3, 32)
    assert torch.equal(y, _linear(x.reshape(6, 64), w).view(2, 3, 32))


def test_w8a8_matches_fp8_activations_times_fp8_weights():
    """x through e4m3 in groups of 128 along K (the test's own rounding), then the product with
    the dequantized weight: K 200 is a whole group and a partial one; 64 x 64 weight blocks."""
    g = torch.Generator().manual_seed(2)
    w = _fp8(48, 200, (64, 64), g)
    x = torch.randn(9, 200, generator=g).to(DEVICE)
    xq = torch.empty_like(x)
    for c in range(0, 200, 128):
        grp = x[:, c : c + 128]
        s = grp.abs().amax(1, keepdim=True) / 448
        xq[:, c : c + 128] = (grp / s).to(torch.float8_e4m3fn).float() * s
    bias = torch.randn(48, generator=g).to(DEVICE)
    y = _linear(x, w, bias, act_fp8=True)
    ref = F.linear(xq, w.dequantize(torch.float32), bias)
    assert (y - ref).abs().max() <= 1e-5 * ref.abs().max()
    exact = F.linear(x, w.dequantize(torch.float32), bias)
    assert 1e-4 < (y - exact).abs().max() / exact.abs().max() < 0.1  # it is W8A8, not W8A16
    with pytest.raises(ValueError, match="float8_e4m3fn"):
        _linear(x[:, :192], _mxfp4(48, 192, g), act_fp8=True)
