"""Grouped expert FFN: the public entry, its PyTorch reference, and the GPU fast paths.

Given tokens ``x [N, H]``, the experts each token uses *here* (``expert_ids [N, k]``, local ids,
-1 for a slot served elsewhere) and their router weights, computes for every token
``sum_j w_j * down_e(silu(gate_e(x)) * up_e(x))`` over its local experts ``e = expert_ids[:, j]``.

Backends: ``"torch"`` runs `fused_moe_cpu` on CPU (grouped MKL GEMMs at decode sizes, oneDNN
GEMMs per expert above) and `fused_moe_ref` elsewhere. ``"triton"`` runs the fused Triton
grouped GEMMs (`splitmoe.kernels.moe_gemm`); on CUDA it also measures ``torch._grouped_mm``
(CUTLASS grouped GEMM, where this torch build and GPU have it) once per (device, dtype, shapes,
batch-size bucket) and keeps whichever is faster, provided both agree with each other.
"""

from __future__ import annotations

import logging

import numpy as np
import torch
import torch.nn.functional as F

from splitmoe.kernels.expert_sort import check_moe_inputs, check_moe_shapes, count_keys
from splitmoe.kernels.linear import linear

log = logging.getLogger(__name__)


def swiglu(
    h: torch.Tensor, inter: int, swiglu_limit: float | None = None, swiglu_alpha: float = 1.702
) -> torch.Tensor:
    """``h [n, 2I]`` (gate columns, then up) -> ``[n, I]``: ``silu(gate) * up``, or with
    ``swiglu_limit`` GPT-OSS's clamped form (transformers' ``GptOssExperts._apply_gate``): gate
    clamped above and up on both sides at the limit, ``(up + 1) * gate * sigmoid(alpha gate)``."""
    gate, up = h[:, :inter], h[:, inter:]
    if swiglu_limit is None:
        return F.silu(gate) * up
    gate = gate.clamp(max=swiglu_limit)
    up = up.clamp(min=-swiglu_limit, max=swiglu_limit)
    return (up + 1) * (gate * torch.sigmoid(gate * swiglu_alpha))


def fused_moe_ref(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    expert_ids: torch.Tensor,
    weights: torch.Tensor,
    b13: torch.Tensor | None = None,
    b2: torch.Tensor | None = None,
    swiglu_limit: float | None = None,
    swiglu_alpha: float = 1.702,
) -> torch.Tensor:
    """x ``[N, H]``; w13 ``[E, 2I, H]`` (gate rows, then up rows); w2 ``[E, H, I]``;
    expert_ids ``[N, k]`` int (-1 = skip); weights ``[N, k]``. Returns ``[N, H]`` in x's dtype.
    Optional (GPT-OSS): expert biases ``b13 [E, 2I]``, ``b2 [E, H]`` (added before the router
    weight) and the clamped SwiGLU (`swiglu`)."""
    N, k = expert_ids.shape
    out = torch.zeros_like(x)
    if N == 0:
        return out
    flat = expert_ids.reshape(-1)  # [N*k]
    keep = flat >= 0
    experts = flat[keep]
    tokens = torch.arange(N, device=x.device).repeat_interleave(k)[keep]
    w = weights.reshape(-1)[keep].to(x.dtype)
    order = torch.argsort(experts, stable=True)
    experts, tokens, w = experts[order], tokens[order], w[order]
    counts = torch.bincount(experts, minlength=w13.shape[0]).tolist()
    inter = w2.shape[2]
    start = 0
    for e, n in enumerate(counts):
        if n == 0:
            continue
        tok = tokens[start : start + n]
        h = F.linear(x[tok], w13[e], None if b13 is None else b13[e])  # [n, 2I]
        h = swiglu(h, inter, swiglu_limit, swiglu_alpha)
        y = F.linear(h, w2[e], None if b2 is None else b2[e]) * w[start : start + n, None]
        out.index_add_(0, tok, y)
        start += n
    return out


def fused_moe_grouped_mm(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    expert_ids: torch.Tensor,
    weights: torch.Tensor,
) -> torch.Tensor:
    """The same math on ``torch._grouped_mm``: gather rows sorted by expert, two grouped GEMMs,
    un-permute, per-token sum. Needs H and I multiples of 16 bytes of elements."""
    N, H = x.shape
    E, k = w13.shape[0], expert_ids.shape[1]
    flat = expert_ids.reshape(-1)  # [P]
    key = torch.where(flat >= 0, flat, E).long()
    sorted_key, order = torch.sort(key, stable=True)  # [P]
    ends = count_keys(key, E + 1)[:E].cumsum(0).to(torch.int32)  # [E]
    y = _grouped_ffn(x[order // k], w13, w2, ends)  # [P, H]; rows past ends[-1]: skipped slots
    w = weights.reshape(-1)[order].to(y.dtype)  # [P]
    y = torch.where((sorted_key < E)[:, None], y * w[:, None], 0)  # rows past ends: undefined
    out = torch.empty_like(y).index_copy_(0, order, y)  # [P, H] back in pair order
    return out.view(N, k, H).sum(1)


def _grouped_ffn(
    a: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    ends: torch.Tensor,
    bias: tuple[torch.Tensor, torch.Tensor] | None = None,
    **act,
):
    """The expert FFN of rows ``a [P, H]`` grouped by expert (expert ``e``'s rows end at
    ``ends[e]``, int32): gate/up GEMM, SiLU-and-multiply (`swiglu`, ``act``), down GEMM ->
    ``[P, H]``. ``bias``: each row's expert biases ``([P, 2I], [P, H])`` (GPT-OSS)."""
    I = w2.shape[2]
    h = torch._grouped_mm(a, w13.transpose(1, 2), offs=ends)  # [P, 2I]
    if bias is not None:
        h += bias[0]
    h = swiglu(h, I, **act)  # [P, I]
    y = torch._grouped_mm(h, w2.transpose(1, 2), offs=ends)
    return y if bias is None else y.add_(bias[1])


def cpu_moe_path(rows: float, expert_elems: int) -> str:
    """Which GEMMs `fused_moe_cpu` runs, from the mean ``rows`` (token, expert pairs) per expert
    in use and the elements of one expert's weights (``3 H I``):

    * ``"per_expert"``: one oneDNN GEMM per expert and projection, once a call has work enough
      (rows x elements) to pay for its ~20 us of Python and dispatch, and more so when the
      groups are wide, where MKL's grouped GEMM slows down;
    * ``"wleft"``: one ``torch._grouped_mm`` per projection, weights on the left
      (`_grouped_ffn_wleft`), for up to 8 rows per expert of weights that stream from memory;
    * ``"xleft"``: one ``torch._grouped_mm`` per projection, tokens on the left (`_grouped_ffn`),
      for experts small enough to stay in cache.

    ms on 1 / 2 threads, W-left | per expert | x-left (scripts/bench_cpu_kernels.py; the last
    two shapes timed the same way): realistic preset (32 experts top-4, H 512, I 256, 6 layers),
    32 tokens (4 rows) 17.6 / 12.8 | 32.1 / 25.6 | 29.9 / 29.6; 64 tokens 33.0 / 20.7 | 33.6 /
    26.9 | 36.6 / 34.8; 128 tokens 73.2 / 44.1 | 38.9 / 30.7 | 48.8 / 43.7; 2048 tokens 462 /
    283 | 205 / 130 | 407 / 238. Default model (16 experts top-4, H 128, I 64, 4 layers): 32
    tokens 1.04 / 1.41 | 2.56 / 3.29 | 0.71 / 1.29; 2048 tokens 25.0 / 26.4 | 11.3 / 10.9 |
    19.6 / 13.1. 64 experts top-8 of H 1024, I 384 (4 layers): 32 tokens 75 / 43 | 84 / 53 |
    105 / 94; 64 tokens 162 / 88 | 95 / 59 | 132 / 96. Qwen3-30B-A3B's experts (128 top-8,
    H 2048, I 768, 2 layers): 8 tokens 101 / 62 | 88 / 65 | 113 / 116; 64 tokens 459 / 243 |
    257 / 173 | 439 / 386."""
    work = rows * expert_elems
    if work >= 1 << 23 or (rows > 8 and work >= 1 << 21):
        return "per_expert"
    if rows <= 8 and expert_elems >= 1 << 16:
        return "wleft"
    return "xleft"


def fused_moe_cpu(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    expert_ids: torch.Tensor,
    weights: torch.Tensor,
    **ffn,
) -> torch.Tensor:
    """The torch path on CPU: pairs sorted by expert on the host (numpy's radix argsort of
    16-bit keys; slots served elsewhere are cut off), rows gathered with ``index_select``, the
    expert FFN of each expert's rows by `cpu_moe_path`'s GEMMs, weighted, and added into their
    tokens with ``index_add_``. GPT-OSS's expert biases and clamped SwiGLU (``ffn``: ``b13``,
    ``b2``, ``swiglu_limit``, ``swiglu_alpha``) ride along: each row's biases are gathered by
    its expert, the down bias added before the router weight."""
    b13, b2 = ffn.pop("b13", None), ffn.pop("b2", None)
    act = {k: v for k, v in ffn.items() if v is not None}
    E, k = w13.shape[0], expert_ids.shape[1]
    flat = expert_ids.reshape(-1).cpu().numpy()
    key = np.where(flat >= 0, flat, E).astype(np.uint16 if E < 1 << 16 else np.int64)
    counts = np.bincount(key, minlength=E + 1)[:E]  # [E] pairs per expert
    pairs = int(counts.sum())
    out = torch.zeros_like(x)
    if pairs == 0:
        return out
    order = np.argsort(key, kind="stable")[:pairs]  # [P] pair index, grouped by expert
    path = "per_expert"
    if _grouped_mm_fits(x, w13, w2):
        path = cpu_moe_path(pairs / np.count_nonzero(counts), w13[0].numel() + w2[0].numel())
    if path == "wleft":
        # An expert's single row goes twice (the copy weighted 0): MKL runs a one-column GEMM
        # as a GEMV at ~half the speed of two columns (68 vs 32 us per 512 x 512 weight, 2
        # threads).
        rep = np.where(counts[key[order]] == 1, 2, 1)  # [P]
        order = np.repeat(order, rep)  # [P'], each single row doubled
        ws = weights.reshape(-1).index_select(0, torch.from_numpy(order))  # [P']
        if len(order) > pairs:
            ws[torch.from_numpy(np.cumsum(rep)[rep == 2] - 1)] = 0
        counts = counts + (counts == 1)
    else:
        ws = weights.reshape(-1).index_select(0, torch.from_numpy(order))  # [P]
    tokens = torch.from_numpy(order // k)  # [P]
    ws = ws.to(x.dtype)
    if path == "per_expert":
        spare = tokens[:1].expand(ROW_ALIGN - 1)  # any real row: finite, and never kept
        xs = x.index_select(0, torch.cat([tokens, spare]))  # [P + ROW_ALIGN - 1, H]
        ws = torch.cat([ws, ws[:1].expand(ROW_ALIGN - 1)])
        y = _per_expert_ffn(xs, ws, w13, w2, counts, b13, b2, **act)[: len(tokens)]
    else:
        xs = x.index_select(0, tokens)  # [P, H] grouped by expert
        ends = torch.from_numpy(counts.cumsum().astype(np.int32))  # [E]
        bias = None
        if b13 is not None:
            rows = torch.from_numpy(key[order].astype(np.int64))  # [P] each row's expert
            bias = (b13.index_select(0, rows), b2.index_select(0, rows))
        ffn = _grouped_ffn_wleft if path == "wleft" else _grouped_ffn
        y = ffn(xs, w13, w2, ends, bias, **act).mul_(ws[:, None])  # [P, H]
    return out.index_add_(0, tokens, y)


def _grouped_ffn_wleft(
    xs: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    ends: torch.Tensor,
    bias: tuple[torch.Tensor, torch.Tensor] | None = None,
    **act,
) -> torch.Tensor:
    """The expert FFN of rows ``xs [P, H]`` grouped by expert (expert ``e``'s end at ``ends[e]``)
    as two ``torch._grouped_mm`` with the weights on the left: ``h^T = W13_e x^T``. On CPU each
    group is an MKL GEMM, and weight-on-the-left reads each weight row once for the group's few
    columns: at 4 rows per expert ~1.7x faster than ``x W^T`` (`_grouped_ffn`, the GPU's form),
    17.6 vs 29.9 ms for the realistic preset's 6 layers at 32 tokens on one thread."""
    I = w2.shape[2]
    h = torch._grouped_mm(w13, xs.t(), offs=ends)  # [2I, P]
    if bias is not None:  # (`_grouped_ffn`'s arguments)
        h = h.t() + bias[0]  # [P, 2I]
        a = swiglu(h, I, **act).contiguous()  # [P, I]
    else:
        # a [P, I] row-major, passed transposed: a column-major [I, P] operand slices its
        # groups into strided column blocks, which MKL reads ~4x slower
        a = (F.silu(h[:I]) * h[I:]).t().contiguous()  # [P, I]
    y = torch._grouped_mm(w2, a.t(), offs=ends)  # [H, P]
    y = y.t().contiguous()  # [P, H]
    return y if bias is None else y.add_(bias[1])


# `_per_expert_ffn` runs each expert's GEMMs on a multiple of this many rows: oneDNN builds a
# kernel for each new GEMM shape (~0.3 ms; the default model's 2048-token prefill took 60 ms
# instead of 35 with every expert's row count new), so the shapes must come from a small set.
ROW_ALIGN = 16


def _per_expert_ffn(
    xs: torch.Tensor,
    ws: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    counts: np.ndarray,
    b13: torch.Tensor | None = None,
    b2: torch.Tensor | None = None,
    **act,
) -> torch.Tensor:
    """The expert FFN of rows ``xs [P + ROW_ALIGN - 1, H]`` grouped by expert (``counts [E]``
    rows each; spare rows at the end), each row weighted by ``ws [P + ROW_ALIGN - 1]``, one GEMM
    per expert and projection: oneDNN's, where it takes the dtype, else ``F.linear`` (MKL). On
    the dev box's AMD EPYC (AVX-512), oneDNN runs a 256-row GEMM at ~250 GFLOP/s per core, MKL's
    sgemm at ~110. Each expert computes its rows rounded up to `ROW_ALIGN` (the next expert's,
    read before they are written, or the spare ones) and keeps its own: ``xs[:P]`` becomes the
    result."""
    I = w2.shape[2]
    start = 0
    for e in np.flatnonzero(counts).tolist():
        n = int(counts[e])
        m = -(-n // ROW_ALIGN) * ROW_ALIGN
        w = ws[start : start + m, None]
        if b13 is None and not act:
            h = linear(xs[start : start + m], w13[e])  # [m, 2I]
            # the router weight scales the [m, I] activations, not the [m, H] outputs
            a = F.silu(h[:, :I]).mul_(h[:, I:]).mul_(w)
            xs[start : start + n] = linear(a, w2[e])[:n]  # [n, H]
        else:  # GPT-OSS: w (a W2 + b2) = (w a) W2 + w b2
            h = linear(xs[start : start + m], w13[e], None if b13 is None else b13[e])
            y = linear(swiglu(h, I, **act).mul_(w), w2[e])[:n]  # [n, H]
            xs[start : start + n] = y if b2 is None else y.addcmul_(w[:n], b2[e])
        start += n
    return xs


def _grouped_mm_fits(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor) -> bool:
    """``torch._grouped_mm`` on CPU needs float32 / bfloat16 and row strides that are multiples
    of 16 bytes."""
    if not hasattr(torch, "_grouped_mm") or x.device.type != "cpu":
        return False
    row = 16 // x.element_size()
    return (
        x.dtype in (torch.float32, torch.bfloat16)
        and w2.shape[1] % row == 0
        and w2.shape[2] % row == 0
        and w13.stride(-1) == 1
        and w2.stride(-1) == 1
        and w13.stride(-2) % row == 0
        and w2.stride(-2) % row == 0
    )


# (device, dtype, w13 shape, k, token bucket) -> "triton" | "grouped_mm"
_FASTER_PATH: dict[tuple, str] = {}


def _cuda_ms(fn, iters: int = 5) -> float:
    fn()  # compiles / warms up
    start = torch.cuda.Event(enable_timing=True)
    end = torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / iters


def _faster_path(x, w13, w2, expert_ids, weights) -> str:
    """Times the Triton kernels and ``torch._grouped_mm`` once per shape class on this GPU."""
    from splitmoe.kernels.moe_gemm import launch_fused_moe

    bucket = 1 << max(0, x.shape[0] - 1).bit_length()
    key = (str(x.device), x.dtype, tuple(w13.shape), expert_ids.shape[1], bucket)
    path = _FASTER_PATH.get(key)
    if path is not None:
        return path
    path = "triton"
    if hasattr(torch, "_grouped_mm"):
        try:
            want = launch_fused_moe(x, w13, w2, expert_ids, weights)
            got = fused_moe_grouped_mm(x, w13, w2, expert_ids, weights)
            # Relative to the output's scale: in 16 bits, an element-wise rtol trips on outputs
            # near zero (the two paths round their float32 sums at different points).
            tol = 1e-4 if x.dtype == torch.float32 else 5e-2
            scale = want.float().abs().max().clamp(min=1.0)
            if (got.float() - want.float()).abs().max() <= tol * scale:
                t_triton = _cuda_ms(lambda: launch_fused_moe(x, w13, w2, expert_ids, weights))
                t_gmm = _cuda_ms(lambda: fused_moe_grouped_mm(x, w13, w2, expert_ids, weights))
                path = "grouped_mm" if t_gmm < t_triton else "triton"
                log.info(
                    "fused_moe %s: triton %.3f ms, torch._grouped_mm %.3f ms -> %s",
                    key, t_triton, t_gmm, path,
                )  # fmt: skip
            else:
                log.warning("fused_moe %s: torch._grouped_mm disagrees with Triton; not used", key)
        except RuntimeError as e:  # not built for this GPU / dtype / alignment
            log.info("fused_moe %s: torch._grouped_mm unavailable (%s)", key, e)
    _FASTER_PATH[key] = path
    return path


def fused_moe_torch(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    expert_ids: torch.Tensor,
    weights: torch.Tensor,
    **ffn,
) -> torch.Tensor:
    """The ``"torch"`` backend: `fused_moe_cpu` on CPU, else `fused_moe_ref` (``ffn``: expert
    biases / clamped SwiGLU, as `fused_moe_ref` takes them)."""
    if x.device.type == "cpu":
        return fused_moe_cpu(x, w13, w2, expert_ids, weights, **ffn)
    return fused_moe_ref(x, w13, w2, expert_ids, weights, **ffn)


def fused_moe_gpu(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    expert_ids: torch.Tensor,
    weights: torch.Tensor,
    **ffn,
) -> torch.Tensor:
    """The ``"triton"`` backend: the fused Triton grouped GEMMs (`moe_gemm`), or on CUDA
    ``torch._grouped_mm`` where it measured faster for this shape class (`_faster_path`; not
    with GPT-OSS's expert biases and clamped SwiGLU, ``ffn``, which only the Triton kernels
    fuse)."""
    from splitmoe.kernels.moe_gemm import launch_fused_moe

    check_moe_inputs(x, w13, w2, expert_ids, weights)
    plain = all(v is None for k, v in ffn.items() if k != "swiglu_alpha")
    if plain and x.shape[0] and x.device.type == "cuda":
        if _faster_path(x, w13, w2, expert_ids, weights) == "grouped_mm":
            return fused_moe_grouped_mm(x, w13, w2, expert_ids, weights)
    return launch_fused_moe(x, w13, w2, expert_ids, weights, **ffn)


# The MoE kernel of each backend (`splitmoe.kernels.backends` binds one per rank).
MOE_KERNELS = {"torch": fused_moe_torch, "triton": fused_moe_gpu}


def fused_moe(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    expert_ids: torch.Tensor,
    weights: torch.Tensor,
    backend: str = "torch",
    **ffn,
) -> torch.Tensor:
    """Routed-expert output ``[N, H]`` in x's dtype.

    x ``[N, H]``; w13 ``[E, 2I, H]`` (gate rows, then up rows); w2 ``[E, H, I]``; expert_ids
    ``[N, k]`` local expert ids (-1: the slot is served by another rank); weights ``[N, k]``
    router weights (float32, or x's dtype). ``backend``: ``"torch"`` (`fused_moe_torch`) or
    ``"triton"`` (`fused_moe_gpu`). ``ffn``: GPT-OSS's ``b13 [E, 2I]``, ``b2 [E, H]``,
    ``swiglu_limit``, ``swiglu_alpha`` (see `fused_moe_ref`). Checks the shapes, then runs the
    backend's kernel.
    """
    check_moe_shapes(x, w13, w2, expert_ids, weights)
    if backend not in MOE_KERNELS:
        raise ValueError(f"moe backend {backend!r} is not available; use 'torch' or 'triton'")
    if backend == "triton":
        from splitmoe.kernels.triton_utils import require_triton

        require_triton("moe_backend", x.device)
    return MOE_KERNELS[backend](x, w13, w2, expert_ids, weights, **ffn)
