"""The native CPU MoE kernel (`moe_cpu.c`): the expert FFNs of a layer in one OpenMP region.

torch runs a CPU MoE as one GEMM per expert and projection, each its own parallel region over
a few rows; the kernel gives each thread whole experts instead (`fused_moe_cpu`'s ``"native"``
layout, timed against the others by `cpu_choice` like any layout). Built on first use with
``-march=native -fopenmp`` (`native.build`, keyed by the CPU model and flags too, so a cache
shared by two machines never loads the other's instructions); where there is no compiler or the
build fails, the layout is simply not a candidate (one warning). The library links the OpenMP
runtime torch has loaded (``libgomp.so.1``), so both share one thread pool.

Float32 and bfloat16 weights (widened as they are read), float32 arithmetic; with bfloat16
activations and weights on a CPU with AVX512-BF16, bf16 dot products into float32 sums (sizes in
multiples of 32). Plain SiLU experts without biases (GPT-OSS's run the other layouts).
"""

from __future__ import annotations

import ctypes
import logging
from pathlib import Path

import numpy as np
import torch

from splitmoe.kernels import native

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("moe_cpu.c")
_FUNCS = {torch.float32: "smoe_f32", torch.bfloat16: "smoe_bf16"}
_DOT_BF16 = "smoe_bf16dp"  # bf16 activations and weights, AVX512-BF16 dot products
_P, _I64 = ctypes.c_void_p, ctypes.c_int64
_SIG = [_P, _I64, _I64, _P, _P, _P, _I64, _P, _P, _I64, _I64, _P, ctypes.c_int]
# the loaded kernel, built on first use; None where it cannot be built (warned once);
# `_DOT_BF16` only where the CPU has AVX512-BF16
library = native.Kernel(SOURCE, "the CPU MoE kernel",
                        dict.fromkeys([*_FUNCS.values(), _DOT_BF16], _SIG), log,
                        "the CPU MoE runs torch's layouts only")  # fmt: skip


def fits(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, b13, act: dict) -> bool:
    """Whether the kernel takes these experts: dense contiguous float32/bfloat16 weights of
    one dtype, plain SiLU, no biases, and a library built here."""
    return (
        b13 is None
        and not act
        and isinstance(w13, torch.Tensor)
        and w13.dtype in _FUNCS
        and w2.dtype == w13.dtype
        and x.dtype in (torch.float32, torch.bfloat16)
        and w13.is_contiguous()
        and w2.is_contiguous()
        and library() is not None
    )


def moe(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    order: np.ndarray,
    counts: np.ndarray,
    k: int,
    weights: torch.Tensor,
) -> torch.Tensor:
    """``[N, H]`` float32: each token's pairs through their experts' FFNs, weighted by the
    router and summed. ``order`` holds the computed pairs' indices (token ``i // k``, slot
    ``i % k``) grouped by expert, ``counts [E]`` pairs each. `fits` must hold."""
    E, H, I = w2.shape
    N = x.shape[0]
    lib = library()
    dot = (
        x.dtype == w13.dtype == torch.bfloat16
        and H % 32 == 0
        and I % 32 == 0
        and hasattr(lib, _DOT_BF16)
    )
    xs = x.contiguous() if dot else x.float().contiguous()
    order_t = torch.from_numpy(np.ascontiguousarray(order, dtype=np.int64))
    counts_t = torch.from_numpy(np.ascontiguousarray(counts, dtype=np.int64))
    wt = weights.reshape(-1).float().contiguous()  # [N * k], read at each pair's slot
    out = torch.empty(N, H, dtype=torch.float32)
    rc = getattr(lib, _DOT_BF16 if dot else _FUNCS[w13.dtype])(
        xs.data_ptr(), H, I, w13.data_ptr(), w2.data_ptr(), counts_t.data_ptr(), E,
        order_t.data_ptr(), wt.data_ptr(), N, k, out.data_ptr(), torch.get_num_threads(),
    )  # fmt: skip
    if rc:
        raise MemoryError("the CPU MoE kernel ran out of memory")
    return out
