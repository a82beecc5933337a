"""Dense projections: ``F.linear``, on CPU through oneDNN's inner product, MKL's GEMM or (at a
decode step's rows) the native kernel `linear_cpu`, whichever measured faster on this machine
for the shape.

``F.linear`` reaches MKL's sgemm on CPU; oneDNN's inner product (the op Inductor's CPU freezing
emits) is a second kernel for the same math. Which one is faster depends on the CPU (its
vector width and matrix units, which code path each library takes on it), the weight's size
(oneDNN's fixed cost per call is higher) and the rows: `CPU_LINEAR` times both over the first
calls of each (rows rounded up to a power of two, weight shape, bias, dtype, threads) and keeps
the faster (`splitmoe.kernels.cpu_choice`). oneDNN builds a kernel for each new row count
(then cached), which a decode batch meets once.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from splitmoe.kernels import linear_cpu
from splitmoe.kernels.cpu_choice import KernelChoice, pow2_bucket
from splitmoe.kernels.quant import QuantizedWeight, dequantize_reused


def _onednn_linear_op():
    if not torch.backends.mkldnn.is_available():
        return None
    try:
        return torch.ops.mkldnn._linear_pointwise.default
    except (AttributeError, RuntimeError):  # a build without oneDNN
        return None


_ONEDNN_LINEAR = _onednn_linear_op()
# bfloat16 needs AVX512 (oneDNN has no bfloat16 inner product on an AVX2-only CPU), float16
# AVX512-FP16, which oneDNN does not find on most CPUs
_ONEDNN_DTYPES = (torch.float32,) + (
    (torch.bfloat16,)
    if _ONEDNN_LINEAR is not None and torch.ops.mkldnn._is_mkldnn_bf16_supported()
    else ()
)

# oneDNN, MKL or the native kernel per shape class, chosen by timing them (the first is the
# reference)
CPU_LINEAR = KernelChoice("linear")
# The native kernel is written for a decode step's rows (4 rows of x per pass over a block of
# weight rows): past them the libraries' blocked GEMMs win by construction, and a trial there
# would only time a loser on prefill-sized calls.
NATIVE_MAX_ROWS = 128


def onednn_takes(x: torch.Tensor) -> bool:
    """Whether `linear` may run ``x`` on oneDNN: a contiguous CPU matrix in float32 (or
    bfloat16, where this CPU's oneDNN multiplies it)."""
    return (
        _ONEDNN_LINEAR is not None
        and x.device.type == "cpu"
        and x.dtype in _ONEDNN_DTYPES
        and x.dim() == 2
        and x.is_contiguous()
    )


def linear(
    x: torch.Tensor, w: torch.Tensor | QuantizedWeight, b: torch.Tensor | None = None
) -> torch.Tensor:
    """``F.linear(x [T, K], w [N, K], b [N])`` -> ``[T, N]``. Where `onednn_takes` ``x`` (and
    the weight is contiguous, in x's dtype), oneDNN's inner product (used as it is: no
    prepacked copy), ``F.linear`` or, up to `NATIVE_MAX_ROWS` rows, the native kernel
    (`linear_cpu`), as `CPU_LINEAR` measured for the shape; else, or inside a graph that
    ``torch.compile`` traces, ``F.linear``. A
    `QuantizedWeight` (FP8 blocks, MXFP4) runs on CUDA in the Triton kernel that reads it
    (`quant_linear.linear_quant_triton`); elsewhere it is dequantized (float32, then x's
    dtype) into a buffer reused for its shape, then the same GEMM."""
    if isinstance(w, QuantizedWeight):
        if x.device.type == "cuda":
            from splitmoe.kernels.quant_linear import linear_quant_triton

            return linear_quant_triton(x, w, b)
        w = dequantize_reused(w, x.dtype)
    if torch.compiler.is_compiling() or not (
        onednn_takes(x) and w.dtype == x.dtype and w.is_contiguous()
    ):  # (in a compiled graph Inductor picks the GEMM: it lowers no oneDNN call of ours)
        return F.linear(x, w, b)
    shape = (pow2_bucket(x.shape[0]), *w.shape, b is not None)
    path = CPU_LINEAR.kept(shape, x.dtype)  # (decided: a dict lookup)
    if path == "onednn":
        return _ONEDNN_LINEAR(x, w, b, "none", [], "")
    if path == "mkl":
        return F.linear(x, w, b)
    if path == "native":
        return linear_cpu.linear(x, w, b)
    calls = {
        "mkl": lambda: F.linear(x, w, b),
        "onednn": lambda: _ONEDNN_LINEAR(x, w, b, "none", [], ""),
    }
    if x.shape[0] <= NATIVE_MAX_ROWS and linear_cpu.fits(x, w):
        calls["native"] = lambda: linear_cpu.linear(x, w, b)
    return CPU_LINEAR.run(shape, x.dtype, calls)
