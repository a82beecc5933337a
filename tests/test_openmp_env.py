"""`runtime.rank_openmp_env`: a rank's OpenMP workers spin between a step's parallel regions
only where the rank has cores of its own and several threads, and never against the user's own
OpenMP settings."""

from __future__ import annotations

import pytest

from splitmoe.options import engine_config
from splitmoe.runtime import RANK_OMP_SPINCOUNT, available_cores, rank_openmp_env


def test_spin_only_on_cores_of_its_own(tiny_ckpt, monkeypatch):
    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    monkeypatch.delenv("GOMP_SPINCOUNT", raising=False)
    cores = len(available_cores())
    if cores < 2:
        pytest.skip("needs 2 cores")
    ckpt = tiny_ckpt("qwen3_moe")
    two = engine_config(str(ckpt), device="cpu", threads_per_rank=2)
    assert rank_openmp_env(two, 1) == {"GOMP_SPINCOUNT": str(RANK_OMP_SPINCOUNT)}
    assert rank_openmp_env(two, cores) == {}  # (ranks x threads > cores: they share)
    one = engine_config(str(ckpt), device="cpu", threads_per_rank=1)
    assert rank_openmp_env(one, 1) == {}  # (no worker threads to keep awake)
    unpinned = engine_config(str(ckpt), device="cpu", threads_per_rank=2, pin_cores=False)
    assert rank_openmp_env(unpinned, 1) == {}
    monkeypatch.setenv("OMP_WAIT_POLICY", "PASSIVE")
    assert rank_openmp_env(two, 1) == {}
