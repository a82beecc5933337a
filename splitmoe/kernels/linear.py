"""Dense projections: ``F.linear``, through oneDNN's inner product on CPU.

On the 2-core dev host (AMD EPYC, AVX-512) MKL's sgemm, which ``F.linear`` reaches on CPU, runs
its AVX2 path at ~110 GFLOP/s per core where oneDNN's inner product (the op Inductor's CPU
freezing emits) reaches ~250. Realistic preset, 32 rows, 2 threads, per call: qkv 0.31 -> 0.13
ms, o_proj 0.19 -> 0.09, lm_head 1.66 -> 0.60; a colocated decode step 19.0 -> 16.4 ms.
oneDNN builds a kernel for each new row count (~0.3 ms, then cached), which a decode batch
meets once.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def _onednn_linear_op():
    if not torch.backends.mkldnn.is_available():
        return None
    try:
        return torch.ops.mkldnn._linear_pointwise.default
    except (AttributeError, RuntimeError):  # a build without oneDNN
        return None


_ONEDNN_LINEAR = _onednn_linear_op()
# Below this many weight elements oneDNN's fixed cost (~7 us a call against ~3 for MKL, one
# thread) outweighs its faster GEMM: a 128 x 128 weight at 16 rows took 14 us against 7.
ONEDNN_MIN_WEIGHT = 1 << 16
# float16 needs AVX512-FP16, which oneDNN does not find on most CPUs
_ONEDNN_DTYPES = (torch.float32, torch.bfloat16)


def onednn_takes(x: torch.Tensor) -> bool:
    """Whether `linear` runs ``x`` on oneDNN: a contiguous CPU matrix in float32 / bfloat16."""
    return (
        _ONEDNN_LINEAR is not None
        and x.device.type == "cpu"
        and x.dtype in _ONEDNN_DTYPES
        and x.dim() == 2
        and x.is_contiguous()
    )


def linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x [T, K], w [N, K], b [N])`` -> ``[T, N]``: oneDNN's inner product where
    `onednn_takes` ``x`` and the weight is large enough to pay for it (used as it is: no
    prepacked copy), else ``F.linear``."""
    if (
        w.numel() >= ONEDNN_MIN_WEIGHT
        and onednn_takes(x)
        and w.dtype == x.dtype
        and w.is_contiguous()
    ):
        return _ONEDNN_LINEAR(x, w, b, "none", [], "")
    return F.linear(x, w, b)
