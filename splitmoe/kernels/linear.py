"""Dense projections: ``F.linear``, on CPU through oneDNN's inner product, MKL's GEMM or (at a
decode step's rows) the native kernel `linear_cpu`, whichever measured faster on this machine
for the shape.

``F.linear`` reaches MKL's sgemm on CPU; oneDNN's inner product (the op Inductor's CPU freezing
emits) is a second kernel for the same math. Which one is faster depends on the CPU (its
vector width and matrix units, which code path each library takes on it), the weight's size
(oneDNN's fixed cost per call is higher) and the rows: `CPU_LINEAR` keeps, per (rows rounded up
to a power of two, weight shape, bias, dtype, threads), the faster as measured before serving
(`linear_trials`, settled by `splitmoe.kernels.settle`; `splitmoe.kernels.cpu_choice`); a class
not measured runs MKL's. oneDNN builds a kernel for each new row count (then cached), which a
decode batch meets once.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.nn.functional as F

from splitmoe.kernels import linear_cpu
from splitmoe.kernels.cpu_choice import (
    Candidates,
    Decision,
    KernelChoice,
    Trial,
    class_middles,
    pow2_bucket,
)
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

# MKL, oneDNN or the native kernel per shape class, chosen by timing them (the first, MKL's
# ``F.linear``, is the reference and the default)
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
    if (
        torch.compiler.is_compiling()
        or not (onednn_takes(x) and w.dtype == x.dtype and w.is_contiguous())
        or not x.shape[0]
    ):  # (in a compiled graph Inductor picks the GEMM: it lowers no oneDNN call of ours; an
        # empty micro-batch computes nothing)
        return F.linear(x, w, b)
    shape = _shape_class(x, w, b)
    path = CPU_LINEAR.kept(shape, x.dtype)  # (decided: a dict lookup)
    if path == "onednn":
        return _ONEDNN_LINEAR(x, w, b, "none", [], "")
    if path == "mkl":
        return F.linear(x, w, b)
    if path == "native":
        return linear_cpu.linear(x, w, b)
    return CPU_LINEAR.run(shape, x.dtype, _candidates(x, w, b))


def _shape_class(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> tuple:
    return (pow2_bucket(x.shape[0]), *w.shape, b is not None)


def _candidates(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> Candidates:
    """The kernels `linear` may run ``x`` on (`onednn_takes` it), the reference first."""
    calls = {
        "mkl": lambda: F.linear(x, w, b),
        "onednn": lambda: _ONEDNN_LINEAR(x, w, b, "none", [], ""),
    }
    if x.shape[0] <= NATIVE_MAX_ROWS and linear_cpu.fits(x, w):
        calls["native"] = lambda: linear_cpu.linear(x, w, b)
    return calls


def linear_decision(
    x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None
) -> Decision | None:
    """The kernel `linear` keeps for these inputs' shape class and the timings that decided it,
    or None where none was measured (`scripts/bench_cpu_kernels.py` prints it)."""
    return CPU_LINEAR.decision(_shape_class(x, w, b), x.dtype)


def linear_trials(
    weights: Iterable[tuple[torch.Tensor | QuantizedWeight, torch.Tensor | None]],
    rows: Iterable[int],
    dtype: torch.dtype,
) -> list[Trial]:
    """The shape classes `linear` meets computing ``x [n, K]`` (in ``dtype``, n of ``rows``)
    against each of ``weights`` (``(w [N, K], bias or None)``), to settle before serving
    (`splitmoe.kernels.cpu_choice.settle`): one per weight shape, bias or not, and row class,
    timed at the middle of the class's row counts, on made-up rows, each timed call on the next
    weight of that shape (a model step reads other layers' weights in between). A
    `QuantizedWeight` is timed dequantized (as `linear` runs it: into a buffer it just wrote,
    one variant). Weights `linear` runs through ``F.linear`` alone (another dtype, not
    contiguous) give no class."""
    if not onednn_takes(torch.empty(1, 1, dtype=dtype)):
        return []  # (this dtype runs F.linear alone: nothing to choose)
    groups: dict[tuple, list] = {}
    for w, b in weights:
        if w is None:
            continue
        quantized = isinstance(w, QuantizedWeight)
        if not quantized and (w.device.type != "cpu" or w.dtype != dtype or not w.is_contiguous()):
            continue
        if b is not None and b.dtype != dtype:
            continue
        groups.setdefault((tuple(w.shape), b is not None), []).append((w, b))
    middles = class_middles(rows)
    trials = []
    for (wshape, has_bias), group in groups.items():
        N, K = wshape
        for top, n in middles.items():
            probe = torch.empty(n, K, dtype=dtype)  # (not filled: for `_candidates`' checks)
            w0 = group[0][0]
            dense = torch.empty(wshape, dtype=dtype) if isinstance(w0, QuantizedWeight) else w0
            names = tuple(_candidates(probe, dense, group[0][1]))

            def build(group=group, n=n, K=K) -> list[Candidates]:
                gen = torch.Generator().manual_seed(n)
                x = torch.randn(n, K, generator=gen).to(dtype)
                if isinstance(group[0][0], QuantizedWeight):
                    w, b = group[0]
                    return [_candidates(x, w.dequantize(dtype), b)]
                return [_candidates(x, w, b) for w, b in group]

            trials.append(Trial(CPU_LINEAR, (top, N, K, has_bias), dtype, names, build, top))
    return trials
