"""The native CPU projection kernel (`linear_cpu.c`): ``x w^T + b`` at a decode step's few rows.

The libraries' GEMMs (MKL, oneDNN) pack the weight on every call when no packed copy is kept,
which at a few rows costs more than the product; the kernel reads each block of weight rows
once and serves every row of ``x`` from it (`linear`'s ``"native"`` candidate, timed against
them by `cpu_choice` like any other). Built on first use like `moe_cpu` (`native.build`,
``-march=native``, keyed by the CPU model and flags); without a compiler or where the build
fails it is simply not a candidate (one warning). Float32 and bfloat16 weights, float32 sums;
bfloat16 x on a bfloat16 weight goes through AVX512-BF16 dot products where the CPU has them
(else both are widened as they are read).
"""

from __future__ import annotations

import ctypes
import logging
from pathlib import Path

import torch

from splitmoe.kernels import native

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("linear_cpu.c")
_FUNCS = {torch.float32: "slinear_f32", torch.bfloat16: "slinear_bf16"}
_DOT_BF16 = "slinear_bf16dp"  # bf16 x and weights, AVX512-BF16 dot products
_SIG = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p, ctypes.c_int64,
        ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int]  # fmt: skip
# the loaded kernel, built on first use; None where it cannot be built (warned once);
# `_DOT_BF16` only where the CPU has AVX512-BF16
library = native.Kernel(SOURCE, "the CPU linear kernel",
                        dict.fromkeys([*_FUNCS.values(), _DOT_BF16], _SIG), log,
                        "CPU projections run the libraries' GEMMs only")  # fmt: skip


def fits(x: torch.Tensor, w: torch.Tensor) -> bool:
    """Whether the kernel takes these: a CPU matrix ``x`` and a contiguous float32 or bfloat16
    weight, and a library built here."""
    return (
        x.is_cpu
        and x.dim() == 2
        and w.dtype in _FUNCS
        and w.dim() == 2
        and w.is_contiguous()
        and library() is not None
    )


def linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
    """``x [M, K] w [N, K]^T (+ b [N])`` -> ``[M, N]`` in x's dtype. `fits` must hold. Both in
    bfloat16 (K a multiple of 32) on a CPU with AVX512-BF16: products of bf16 pairs, as the
    libraries' bf16 GEMMs compute them; else x is widened to float32."""
    M, K = x.shape
    N = w.shape[0]
    lib = library()
    dot = x.dtype == w.dtype == torch.bfloat16 and K % 32 == 0 and hasattr(lib, _DOT_BF16)
    xf = x.contiguous() if dot else x.float().contiguous()
    bf = None if b is None else b.float().contiguous()
    out = torch.empty(M, N, dtype=torch.float32)
    getattr(lib, _DOT_BF16 if dot else _FUNCS[w.dtype])(
        xf.data_ptr(), M, K, w.data_ptr(), N, None if bf is None else bf.data_ptr(),
        out.data_ptr(), torch.get_num_threads(),
    )  # fmt: skip
    return out.to(x.dtype)
