"""The native CPU projection kernel (`splitmoe.kernels.linear_cpu`): ``x w^T + b`` against
``F.linear``, one of `linear`'s measured candidates at a decode step's rows, and simply not
offered where it cannot be built."""

from __future__ import annotations

import logging

import pytest
import torch
import torch.nn.functional as F

from splitmoe.kernels import linear as lin
from splitmoe.kernels import linear_cpu


def _case(M: int, N: int, K: int, seed: int, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(M, K, generator=g).to(dtype)
    w = (torch.randn(N, K, generator=g) * K**-0.5).to(dtype)
    return x, w, torch.randn(N, generator=g).to(dtype)


@pytest.mark.parametrize("M", [1, 3, 4, 5, 33])  # rows around its passes of 4
@pytest.mark.parametrize("K", [16, 40, 512])  # a multiple of 16, and one with a tail
@pytest.mark.parametrize("bias", [False, True])
def test_native_linear_matches_f_linear(M, K, bias):
    assert linear_cpu.library() is not None  # (the suite's machines have a C compiler)
    x, w, b = _case(M, 20, K, seed=M * K)
    b = b if bias else None
    torch.testing.assert_close(linear_cpu.linear(x, w, b), F.linear(x, w, b), rtol=1e-5,
                               atol=1e-5)  # fmt: skip


@pytest.mark.parametrize("K", [64, 48])  # bf16 dot products where the CPU has them; widened
def test_native_linear_reads_bfloat16_weights(K):
    x, w, b = _case(6, 24, K, seed=2, dtype=torch.bfloat16)
    assert linear_cpu.fits(x, w)
    got = linear_cpu.linear(x, w, b)
    assert got.dtype == torch.bfloat16
    want = F.linear(x.float(), w.float(), b.float())
    torch.testing.assert_close(got.float(), want, rtol=2e-2, atol=2e-2)


def test_linear_runs_the_native_kernel_where_kept(monkeypatch):
    monkeypatch.setattr(lin.CPU_LINEAR, "kept", lambda shape, dtype: "native")
    ran = []
    real = linear_cpu.linear
    monkeypatch.setattr(linear_cpu, "linear", lambda *a: ran.append(1) or real(*a))
    x, w, b = _case(8, 12, 32, seed=3)
    torch.testing.assert_close(lin.linear(x, w, b), F.linear(x, w, b), rtol=1e-5, atol=1e-5)
    assert ran == [1]


def test_what_it_does_not_take():
    x, w, _ = _case(4, 8, 16, seed=0)
    assert linear_cpu.fits(x, w)
    assert not linear_cpu.fits(x, w.half())
    assert not linear_cpu.fits(x, w.t())  # not contiguous
    assert not linear_cpu.fits(x[None], w)


def test_without_a_compiler_linear_runs_the_libraries(tmp_path, monkeypatch, caplog):
    monkeypatch.setattr(linear_cpu.library, "_lib", None)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))  # (no library built before)
    monkeypatch.setenv("CC", "no-such-compiler")
    monkeypatch.setenv("PATH", str(tmp_path))
    x, w, b = _case(5, 7, 24, seed=1)
    with caplog.at_level(logging.WARNING, logger="splitmoe.kernels.linear_cpu"):
        assert not linear_cpu.fits(x, w)
        got = lin.linear(x, w, b)
    assert [r.message for r in caplog.records if "needs a C compiler" in r.message] != []
    assert len(caplog.records) == 1  # warned once
    torch.testing.assert_close(got, F.linear(x, w, b), rtol=1e-5, atol=1e-5)
