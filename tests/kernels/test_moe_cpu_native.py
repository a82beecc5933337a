"""The native CPU MoE kernel (`splitmoe.kernels.moe_cpu`): built on first use, one of
`fused_moe_cpu`'s measured layouts (its agreement with the reference is in
test_fused_moe_cpu.py, with every layout), and simply not offered where it cannot be built."""

from __future__ import annotations

import logging

import pytest
import torch

import splitmoe.kernels.fused_moe as fm
from splitmoe.kernels import linear_cpu, moe_cpu
from splitmoe.kernels.fused_moe import fused_moe_ref


def _case(tokens: int, E: int, H: int, I: int, k: int, seed: int, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    w13 = (torch.randn(E, 2 * I, H, generator=g) * H**-0.5).to(dtype)
    w2 = (torch.randn(E, H, I, generator=g) * I**-0.5).to(dtype)
    x = torch.randn(tokens, H, generator=g).to(dtype)
    ids = torch.randn(tokens, E, generator=g).topk(k, dim=1).indices.to(torch.int32)
    ids[torch.rand(tokens, k, generator=g) < 0.2] = -1  # slots served by another rank
    return x, w13, w2, ids, torch.rand(tokens, k, generator=g)


@pytest.mark.parametrize("tokens", [1, 3, 4, 5, 9, 40])  # rows per expert around its block of 4
def test_native_layout_matches_the_reference(tokens):
    assert moe_cpu.library() is not None  # (the suite's machines have a C compiler)
    x, w13, w2, ids, w = _case(tokens, 8, 48, 24, 4, seed=tokens)
    got = fm.fused_moe_cpu(x, w13, w2, ids, w, path="native")
    torch.testing.assert_close(got, fused_moe_ref(x, w13, w2, ids, w), rtol=1e-5, atol=1e-5)


def test_native_layout_reads_bfloat16_weights():
    x, w13, w2, ids, w = _case(12, 8, 64, 32, 2, seed=4, dtype=torch.bfloat16)
    assert moe_cpu.fits(x, w13, w2, None, {})
    got = fm.fused_moe_cpu(x, w13, w2, ids, w, path="native")
    want = fused_moe_ref(x.float(), w13.float(), w2.float(), ids, w)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), want, rtol=2e-2, atol=2e-2)


def test_experts_it_does_not_take():
    x, w13, w2, ids, w = _case(4, 4, 16, 8, 2, seed=0)
    assert moe_cpu.fits(x, w13, w2, None, {})
    assert not moe_cpu.fits(x, w13, w2, torch.zeros(4, 16), {})  # GPT-OSS's biases
    assert not moe_cpu.fits(x, w13, w2, None, {"swiglu_limit": 7.0})
    assert not moe_cpu.fits(x, w13.half(), w2.half(), None, {})
    assert not moe_cpu.fits(x, w13.transpose(1, 2), w2, None, {})  # not contiguous


def test_without_a_compiler_the_layout_is_not_offered(tmp_path, monkeypatch, caplog):
    monkeypatch.setattr(moe_cpu.library, "_lib", None)
    # the other layouts run `linear`, whose kernel then fails to build too: its state is put
    # back afterwards, so that later tests in this process do not inherit "no compiler"
    monkeypatch.setattr(linear_cpu.library, "_lib", None)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))  # (no library built before)
    monkeypatch.setenv("CC", "no-such-compiler")
    monkeypatch.setenv("PATH", str(tmp_path))
    x, w13, w2, ids, w = _case(6, 4, 16, 8, 2, seed=1)
    with caplog.at_level(logging.WARNING, logger="splitmoe.kernels.moe_cpu"):
        assert not moe_cpu.fits(x, w13, w2, None, {})
        assert not moe_cpu.fits(x, w13, w2, None, {})
        got = fm.fused_moe_cpu(x, w13, w2, ids, w)  # the other layouts
    # warned once (the layouts beside it may build the linear kernel, which warns for itself)
    mine = [r for r in caplog.records if r.name == moe_cpu.log.name]
    assert len(mine) == 1 and "needs a C compiler" in mine[0].getMessage()
    torch.testing.assert_close(got, fused_moe_ref(x, w13, w2, ids, w), rtol=1e-5, atol=1e-5)


def test_a_changed_header_builds_a_new_library(tmp_path):
    """The build is named by the source and the headers beside it: a kernel never loads a
    library built from another version of a header it includes."""
    from splitmoe.kernels import native

    (tmp_path / "k.h").write_text("#define K 1\n")
    src = tmp_path / "k.c"
    src.write_text('#include "k.h"\nint k(void) { return K; }\n')
    flags = ["-O1", "-shared", "-fPIC"]
    first = native.build(src, flags, "k", cache=tmp_path / "cache")
    assert native.build(src, flags, "k", cache=tmp_path / "cache") == first
    (tmp_path / "k.h").write_text("#define K 2\n")
    second = native.build(src, flags, "k", cache=tmp_path / "cache")
    assert second != first and second.exists()
