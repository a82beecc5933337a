"""The native CPU decode attention kernel (`attention_cpu.c`): one-token rows over the paged cache.

The torch path gathers each decode row's cache blocks into one tensor and runs SDPA on it; the
kernel reads the keys and values in place through the block table instead, one task per (row,
KV head), the GQA group's heads together (`paged_attention_ref`'s decode rows, timed against
the gather-and-SDPA path by `cpu_choice` like any candidate). Built on first use like
`moe_cpu` (`native.build`, ``-march=native``, keyed by the CPU model and flags); without a
compiler or where the build fails it is simply not a candidate (one warning). Float32 and
bfloat16 caches (widened as they are read), float32 arithmetic; sinks and windows included.
"""

from __future__ import annotations

import ctypes
import logging
from pathlib import Path

import torch

from splitmoe.kernels import native

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("attention_cpu.c")
_FUNCS = {torch.float32: "sattn_f32", torch.bfloat16: "sattn_bf16"}
_P, _I64 = ctypes.c_void_p, ctypes.c_int64
_SIG = [_P, _P, _P, _P, _I64, _P, _I64, _I64, _I64, _I64, _I64, ctypes.c_float, _P, _P,
        ctypes.c_int]  # fmt: skip
# the loaded kernel, built on first use; None where it cannot be built (warned once)
library = native.Kernel(SOURCE, "the CPU decode attention kernel",
                        dict.fromkeys(_FUNCS.values(), _SIG), log,
                        "CPU decode attention runs torch's SDPA only")  # fmt: skip


def fits(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> bool:
    """Whether the kernel takes these: CPU tensors, float32 or bfloat16 contiguous caches of
    one dtype, a head size in multiples of 16, and a library built here."""
    return (
        q.is_cpu
        and q.shape[-1] % 16 == 0
        and k_cache.dtype in _FUNCS
        and v_cache.dtype == k_cache.dtype
        and k_cache.is_contiguous()
        and v_cache.is_contiguous()
        and library() is not None
    )


def decode(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    blocks: torch.Tensor,
    spans: torch.Tensor,
    scale: float,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """``[B, nkv, g, d]`` in q's dtype: each row of ``q [B, nkv, g, d]`` attends to its keys
    ``spans[b, 0] <= t < spans[b, 1]`` of its blocks ``blocks [B * nblk]`` (key t in block t //
    block_size). `fits` must hold."""
    B, nkv, g, d = q.shape
    bs = k_cache.shape[1]
    nblk = blocks.numel() // max(B, 1)
    qf = q.float().contiguous()
    blocks = blocks.to(torch.int64).contiguous()
    spans = spans.to(torch.int64).contiguous()
    sk = None if sinks is None else sinks.float().contiguous()
    out = torch.empty(B, nkv, g, d, dtype=torch.float32)
    rc = getattr(library(), _FUNCS[k_cache.dtype])(
        qf.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), blocks.data_ptr(), nblk,
        spans.data_ptr(), B, nkv, g, d, bs, scale, None if sk is None else sk.data_ptr(),
        out.data_ptr(), torch.get_num_threads(),
    )  # fmt: skip
    if rc:
        raise MemoryError("the CPU decode attention kernel ran out of memory")
    return out.to(q.dtype)
