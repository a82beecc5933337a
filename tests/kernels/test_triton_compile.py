"""Every Triton kernel, with the tiles a GPU run would pick, compiles for H100 (sm_90) without
register spills and within its shared memory. Needs no GPU: Triton's own ptxas compiles ahead of
time (`scripts/bench_kernels.py --compile-only`). The interpreter used by the other kernel tests
never compiles, so this is what catches a kernel that interprets but does not build."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

triton = pytest.importorskip("triton")
SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "bench_kernels.py"


def _have_ptxas() -> bool:
    try:
        return bool(triton.knobs.nvidia.ptxas.path)
    except Exception:  # no NVIDIA backend / toolchain in this triton build
        return False


@pytest.mark.skipif(not _have_ptxas(), reason="triton's NVIDIA ptxas is not available")
def test_kernels_compile_for_sm90_without_spills():
    """bfloat16 (what a GPU runs) and float32 (tiles of their own), compiled side by side:
    ptxas runs on one core each."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")  # Triton's default; set to silence its warning
    runs = {
        dtype: subprocess.Popen(
            [sys.executable, str(SCRIPT), "--compile-only", "--arch", "90", "--dtype", dtype],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for dtype in ("bfloat16", "float32")
    }
    for dtype, proc in runs.items():
        out, err = proc.communicate(timeout=600)
        assert proc.returncode == 0, f"{dtype}:\n{out[-4000:]}{err[-4000:]}"
        assert " 0 spilling" in out, f"{dtype}:\n{out[-4000:]}"
