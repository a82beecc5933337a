"""The native CPU decode attention kernel (`splitmoe.kernels.attention_cpu`): the decode rows of
a step read through the block table, against transformers' eager attention (sinks and sliding
windows included), one of `paged_attention_ref`'s measured candidates, and simply not offered
where it cannot be built."""

from __future__ import annotations

import logging

import pytest
import torch
from test_attention_sinks_window import MIXED, WINDOW, _batch, _eager

import splitmoe.kernels.paged_attention as pa
from splitmoe.kernels import attention_cpu
from splitmoe.kernels.paged_attention import paged_attention


def _decode_rows(q, k_cache, v_cache, meta, sinks, window, nkv):
    """The step's decode rows as the reference hands them to a kernel: ``[Bd, nkv, g, d]``."""
    plan = pa.decode_plan(meta, k_cache.shape[1], q.dtype, window)
    qd = q[plan.rows].view(len(plan.rows), nkv, -1, q.shape[-1])
    return plan, qd


@pytest.mark.parametrize("sinks_on,window", [(False, None), (True, None), (True, WINDOW)])
@pytest.mark.parametrize("block_size", [1, 4, 16])
@pytest.mark.parametrize("nh,nkv", [(4, 2), (8, 8)])  # GQA groups of 2 and of 1
def test_native_decode_matches_eager(sinks_on, window, block_size, nh, nkv):
    assert attention_cpu.library() is not None  # (the suite's machines have a C compiler)
    q, k_cache, v_cache, meta, tables, sinks = _batch(MIXED, nh, nkv, 16, block_size)
    sinks = sinks if sinks_on else None
    plan, qd = _decode_rows(q, k_cache, v_cache, meta, sinks, window, nkv)
    got = attention_cpu.decode(qd, k_cache, v_cache, plan.blocks, plan.spans, 0.25, sinks)
    want = _eager(q, k_cache, v_cache, meta, tables, 0.25, sinks, window)[plan.rows]
    torch.testing.assert_close(got.reshape(want.shape), want, rtol=1e-5, atol=1e-5)


def test_native_decode_reads_bfloat16_caches():
    q, k_cache, v_cache, meta, tables, sinks = _batch(MIXED, 4, 2, 32, 4, seed=3)
    q, k_cache, v_cache = (t.bfloat16() for t in (q, k_cache, v_cache))
    assert attention_cpu.fits(q, k_cache, v_cache)
    plan, qd = _decode_rows(q, k_cache, v_cache, meta, sinks, WINDOW, 2)
    got = attention_cpu.decode(qd, k_cache, v_cache, plan.blocks, plan.spans, 0.25, sinks)
    want = _eager(q.float(), k_cache.float(), v_cache.float(), meta, tables, 0.25, sinks, WINDOW)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float().reshape(-1, 4, 32), want[plan.rows], rtol=2e-2,
                               atol=2e-2)  # fmt: skip


def test_a_step_with_the_native_kernel_kept(monkeypatch):
    """`paged_attention` with the native kernel kept for the decode rows (prompt chunks in the
    same step run the reference's prefill): transformers' eager attention."""
    monkeypatch.setattr(pa.CPU_DECODE_KERNELS, "kept", lambda shape, dtype: "native")
    ran = []
    real = attention_cpu.decode
    monkeypatch.setattr(attention_cpu, "decode", lambda *a: ran.append(1) or real(*a))
    q, k_cache, v_cache, meta, tables, sinks = _batch(MIXED, 4, 2, 16, 4, seed=5)
    got = paged_attention(q, k_cache, v_cache, meta, 0.25, sinks=sinks, window=WINDOW)
    want = _eager(q, k_cache, v_cache, meta, tables, 0.25, sinks, WINDOW)
    assert ran == [1]
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_what_it_does_not_take():
    q, k_cache, v_cache, *_ = _batch(MIXED, 4, 2, 16, 4)
    assert attention_cpu.fits(q, k_cache, v_cache)
    assert not attention_cpu.fits(q, k_cache.half(), v_cache.half())
    assert not attention_cpu.fits(q[..., :8], k_cache[..., :8], v_cache[..., :8])  # d % 16
    assert not attention_cpu.fits(q, k_cache.transpose(0, 1), v_cache)  # not contiguous


def test_without_a_compiler_decode_runs_sdpa(tmp_path, monkeypatch, caplog):
    monkeypatch.setattr(attention_cpu.library, "_lib", None)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))  # (no library built before)
    monkeypatch.setenv("CC", "no-such-compiler")
    monkeypatch.setenv("PATH", str(tmp_path))
    q, k_cache, v_cache, meta, tables, sinks = _batch(MIXED, 4, 2, 16, 4, seed=1)
    with caplog.at_level(logging.WARNING, logger="splitmoe.kernels.attention_cpu"):
        assert not attention_cpu.fits(q, k_cache, v_cache)
        got = paged_attention(q, k_cache, v_cache, meta, 0.25)
    assert [r.message for r in caplog.records if "needs a C compiler" in r.message] != []
    assert len(caplog.records) == 1  # warned once
    want = _eager(q, k_cache, v_cache, meta, tables, 0.25, None, None)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
