"""Grouped expert FFN: the public entry, its PyTorch reference, and the GPU fast paths.

Given tokens ``x [N, H]``, the experts each token uses *here* (``expert_ids [N, k]``, local ids,
-1 for a slot served elsewhere) and their router weights, computes for every token
``sum_j w_j * down_e(silu(gate_e(x)) * up_e(x))`` over its local experts ``e = expert_ids[:, j]``.

Backends: ``"torch"`` runs `fused_moe_cpu` on CPU (grouped MKL GEMMs or one oneDNN GEMM per
expert, whichever layout measured fastest on this machine for the shape before serving:
`moe_trials`) and `fused_moe_ref` elsewhere. ``"triton"`` runs the fused Triton grouped GEMMs
(`splitmoe.kernels.moe_gemm`); on CUDA it also measures ``torch._grouped_mm`` (CUTLASS grouped
GEMM, where this torch build and GPU have it) once per (device, dtype, shapes, batch-size
bucket) and keeps whichever is faster, provided both agree with each other.

``w13`` and ``w2`` may be `QuantizedWeight` (FP8 blocks or MXFP4, as released): the CPU paths
then run one expert at a time, dequantizing its w13 and then its w2 (float32, then the run
dtype) into buffers reused across calls (`quant.dequantize_reused`) before the same GEMMs, so
memory stays at the released size; the Triton kernels read the quantized layout themselves.
"""

from __future__ import annotations

import functools
import logging
import math
from collections.abc import Iterable, Sequence
from typing import NamedTuple

import numpy as np
import torch
import torch.nn.functional as F

from splitmoe.kernels import moe_cpu
from splitmoe.kernels.cpu_choice import (
    Candidates,
    Decision,
    KernelChoice,
    Trial,
    class_middles,
    half_octave_bucket,
)
from splitmoe.kernels.expert_sort import check_moe_inputs, check_moe_shapes, count_keys
from splitmoe.kernels.linear import linear, linear_trials
from splitmoe.kernels.quant import QuantizedWeight, dequantize_reused

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


Weight = torch.Tensor | QuantizedWeight


def expert_weight(w: Weight, e: int, dtype: torch.dtype) -> torch.Tensor:
    """Expert ``e``'s dense weight: a view of a dense stack, or a quantized one's dequantized
    (on CPU into a reused buffer, valid until the next expert of the same shape)."""
    if not isinstance(w, QuantizedWeight):
        return w[e]
    if w.device.type == "cpu":
        return dequantize_reused(w.expert(e), dtype)
    return w.expert(e).dequantize(dtype)


def fused_moe_ref(
    x: torch.Tensor,
    w13: Weight,
    w2: Weight,
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
    weight) and the clamped SwiGLU (`swiglu`). The weights may be `QuantizedWeight`
    (`expert_weight`)."""
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
        h = F.linear(x[tok], expert_weight(w13, e, x.dtype), None if b13 is None else b13[e])
        h = swiglu(h, inter, swiglu_limit, swiglu_alpha)  # [n, I]
        h = F.linear(h, expert_weight(w2, e, x.dtype), None if b2 is None else b2[e])
        y = h * w[start : start + n, None]
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


# `fused_moe_cpu`'s GEMM layouts, chosen per shape class by timing them before serving
# (`moe_trials`, `cpu_choice`); the first of `TORCH_MOE_PATHS` is the default.
CPU_MOE_GEMMS = KernelChoice("moe_gemm")


def fused_moe_cpu(
    x: torch.Tensor,
    w13: Weight,
    w2: Weight,
    expert_ids: torch.Tensor,
    weights: torch.Tensor,
    path: str | None = None,
    **ffn,
) -> torch.Tensor:
    """The torch path on CPU: pairs sorted by expert on the host (numpy's radix argsort of
    16-bit keys; slots served elsewhere are cut off), rows gathered with ``index_select``, the
    expert FFN of each expert's rows by one of three GEMM layouts, weighted, and added into
    their tokens with ``index_add_``:

    * ``"per_expert"``: one oneDNN (or MKL, `linear`) GEMM per expert and projection;
    * ``"wleft"``: one ``torch._grouped_mm`` per projection, weights on the left
      (`_grouped_ffn_wleft`: each weight row read once for a group's few columns);
    * ``"xleft"``: one ``torch._grouped_mm`` per projection, tokens on the left (`_grouped_ffn`,
      the GPU's form).

    ``path`` None: the layout `CPU_MOE_GEMMS` measured fastest on this machine for the shape
    class (expert shape, pairs rounded up to half an octave, `half_octave_bucket`, GPT-OSS
    options, dtype, threads);
    the grouped layouts only where ``torch._grouped_mm`` takes the sizes. A name forces one
    (tests, benchmarks). GPT-OSS's expert biases and clamped SwiGLU (``ffn``: ``b13``, ``b2``,
    ``swiglu_limit``, ``swiglu_alpha``) ride along: each row's biases are gathered by its
    expert, the down bias added before the router weight. With `QuantizedWeight` experts only
    ``"per_expert"`` runs (the grouped layouts need dense stacks), nothing timed."""
    b13, b2 = ffn.pop("b13", None), ffn.pop("b2", None)
    act = {k: v for k, v in ffn.items() if v is not None}
    rows = _sort_pairs(expert_ids, w13.shape[0])
    pairs = len(rows.order)
    if pairs == 0:
        return torch.zeros_like(x)
    if isinstance(w13, QuantizedWeight) or isinstance(w2, QuantizedWeight):
        if path not in (None, "per_expert"):
            raise ValueError(f"fused_moe_cpu: path {path!r} needs dense expert weights")
        return _moe_per_expert(x, w13, w2, weights, rows, b13, b2, act)
    paths = _moe_paths(x, w13, w2, b13, act)
    shape = _moe_shape_class(w13, pairs, b13, act)
    if path is None:
        path = CPU_MOE_GEMMS.kept(shape, x.dtype)  # decided: build only that call
    elif path not in CPU_MOE_PATHS:
        raise ValueError(f"fused_moe_cpu: path {path!r} is not one of {CPU_MOE_PATHS}")
    paths = (path,) if path in paths else paths
    calls = _moe_calls(paths, x, w13, w2, weights, rows, b13, b2, act)
    return CPU_MOE_GEMMS.run(shape, x.dtype, calls)


def _sort_pairs(expert_ids: torch.Tensor, E: int) -> _SortedPairs:
    """The (token, expert) pairs of ``expert_ids [N, k]`` (local ids, -1: elsewhere) sorted by
    expert on the host: numpy's radix argsort of 16-bit keys."""
    k = expert_ids.shape[1]
    flat = expert_ids.reshape(-1).cpu().numpy()
    key = np.where(flat >= 0, flat, E).astype(np.uint16 if E < 1 << 16 else np.int64)
    counts = np.bincount(key, minlength=E + 1)[:E]  # [E] pairs per expert
    pairs = int(counts.sum())
    order = np.argsort(key, kind="stable")[:pairs]  # [P] pair index, grouped by expert
    return _SortedPairs(k, key, order, counts)


def _moe_paths(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, b13, act: dict) -> tuple:
    """The layouts that take these dense experts, the default (``"per_expert"``) first."""
    paths = TORCH_MOE_PATHS if _grouped_mm_fits(x, w13, w2) else ("per_expert",)
    if moe_cpu.fits(x, w13, w2, b13, act):
        paths += ("native",)
    return paths


def _moe_calls(paths, x, w13, w2, weights, rows, b13, b2, act) -> Candidates:
    return {
        name: functools.partial(_MOE_LAYOUTS[name], x, w13, w2, weights, rows, b13, b2, act)
        for name in paths
    }


# the first is the reference the others must agree with (`KernelChoice.measure`) and the
# default of a class not measured (`KernelChoice.run`)
TORCH_MOE_PATHS = ("per_expert", "wleft", "xleft")
CPU_MOE_PATHS = (*TORCH_MOE_PATHS, "native")  # (native: where `moe_cpu.fits`)


class _SortedPairs(NamedTuple):
    """The (token, expert) pairs of a call, sorted by expert: ``key [N*k]`` each pair's expert
    (E: served elsewhere), ``order [P]`` the kept pairs' indices grouped by expert, ``counts
    [E]`` pairs per expert; ``k`` the slots per token."""

    k: int
    key: np.ndarray
    order: np.ndarray
    counts: np.ndarray


def _moe_shape_class(w13: torch.Tensor, pairs: int, b13, act: dict) -> tuple:
    return (*w13.shape, half_octave_bucket(pairs), b13 is not None, "swiglu_limit" in act)


def cpu_moe_decision(
    x: torch.Tensor, w13: torch.Tensor, expert_ids: torch.Tensor, **ffn
) -> Decision | None:
    """The layout `fused_moe_cpu` keeps for these inputs' shape class and the timings that
    decided it, or None before its first call (`scripts/bench_cpu_kernels.py` prints it)."""
    act = {k: v for k, v in ffn.items() if v is not None and k not in ("b13", "b2")}
    pairs = int((expert_ids >= 0).sum())
    return CPU_MOE_GEMMS.decision(_moe_shape_class(w13, pairs, ffn.get("b13"), act), x.dtype)


def moe_trials(
    layers: Sequence[tuple[Weight, ...]],
    act: dict,
    pairs: Iterable[int],
    slots_per_token: int,
    top_k: int,
    dtype: torch.dtype,
) -> list[Trial]:
    """The shape classes `fused_moe_cpu` meets for these experts, to settle before serving
    (`splitmoe.kernels.cpu_choice.settle`). ``layers``: each MoE layer's ``(w13, w2)`` or
    ``(w13, w2, b13, b2)`` as `LocalExperts` holds them; ``act``: GPT-OSS's clamped SwiGLU
    (``swiglu_limit``, ``swiglu_alpha``); ``pairs``: the counts of (token, local expert) pairs
    a call can have; ``slots_per_token``: the local experts of a token (at most ``top_k``, its
    slots). One class per expert shape and class of pairs, timed at the middle of the class's
    counts on made-up tokens, each routed to ``slots_per_token`` distinct random experts, each
    timed call on the next layer's weights. Quantized experts give none (one layout runs
    them)."""
    groups: dict[tuple, list] = {}
    for w13, w2, *bias in layers:
        if isinstance(w13, QuantizedWeight) or isinstance(w2, QuantizedWeight):
            continue
        b13, b2 = bias or (None, None)
        groups.setdefault((tuple(w13.shape), b13 is not None), []).append((w13, w2, b13, b2))
    middles = class_middles(pairs, half_octave_bucket)
    trials = []
    for group in groups.values():
        w13, w2, b13, _ = group[0]
        E, H = w13.shape[0], w13.shape[2]
        here = max(1, min(slots_per_token, top_k, E))
        names = _moe_paths(torch.empty(1, H, dtype=dtype), w13, w2, b13, act)
        for P in middles.values():
            tokens = math.ceil(P / here)

            def build(group=group, P=P, tokens=tokens, here=here, E=E, H=H, names=names):
                gen = torch.Generator().manual_seed(P)
                ids = torch.full((tokens, top_k), -1, dtype=torch.int32)
                picks = torch.rand(tokens, E, generator=gen).argsort(dim=1)[:, :here]
                ids[:, :here] = picks.to(torch.int32)
                filled = (torch.arange(tokens * top_k) % top_k < here).nonzero().flatten()
                ids.view(-1)[filled[P:]] = -1  # (exactly P pairs)
                w = torch.rand(tokens, top_k, generator=gen).to(dtype)
                x = torch.randn(tokens, H, generator=gen).to(dtype)
                rows = _sort_pairs(ids, E)
                return [
                    _moe_calls(names, x, w13, w2, w, rows, b13, b2, act)
                    for w13, w2, b13, b2 in group
                ]

            shape = _moe_shape_class(w13, P, b13, act)
            trials.append(Trial(CPU_MOE_GEMMS, shape, dtype, names, build, tokens))
    return trials


def per_expert_linear_trials(
    layers: Sequence[tuple[Weight, ...]], max_tokens: int, dtype: torch.dtype
) -> list[Trial]:
    """The classes of `linear` that the ``"per_expert"`` layout (the default) meets: each
    expert's gate/up GEMM (with its bias, GPT-OSS) and down GEMM at its rows rounded up to
    `ROW_ALIGN`, up to ``max_tokens`` rows (a token reaches an expert once)."""
    weights = []
    for w13, w2, *bias in layers:
        b13 = bias[0] if bias else None
        for e in range(w13.shape[0]):
            w13e = w13.expert(e) if isinstance(w13, QuantizedWeight) else w13[e]
            w2e = w2.expert(e) if isinstance(w2, QuantizedWeight) else w2[e]
            weights += [(w13e, None if b13 is None else b13[e]), (w2e, None)]
    top = -(-max(1, max_tokens) // ROW_ALIGN) * ROW_ALIGN
    return linear_trials(weights, range(ROW_ALIGN, top + 1, ROW_ALIGN), dtype)


def _moe_per_expert(x, w13, w2, weights, rows: _SortedPairs, b13, b2, act) -> torch.Tensor:
    order = rows.order
    tokens = torch.from_numpy(order // rows.k)  # [P]
    ws = weights.reshape(-1).index_select(0, torch.from_numpy(order)).to(x.dtype)  # [P]
    spare = tokens[:1].expand(ROW_ALIGN - 1)  # any real row: finite, and never kept
    xs = x.index_select(0, torch.cat([tokens, spare]))  # [P + ROW_ALIGN - 1, H]
    ws = torch.cat([ws, ws[:1].expand(ROW_ALIGN - 1)])
    y = _per_expert_ffn(xs, ws, w13, w2, rows.counts, b13, b2, **act)[: len(tokens)]
    return torch.zeros_like(x).index_add_(0, tokens, y)


def _moe_grouped(x, w13, w2, weights, rows: _SortedPairs, b13, b2, act, wleft: bool):
    order, counts, pairs = rows.order, rows.counts, len(rows.order)
    if wleft:
        # An expert's single row goes twice (the copy weighted 0): MKL runs a one-column GEMM
        # as a GEMV, at about half the speed of two columns.
        rep = np.where(counts[rows.key[order]] == 1, 2, 1)  # [P]
        order = np.repeat(order, rep)  # [P'], each single row doubled
        ws = weights.reshape(-1).index_select(0, torch.from_numpy(order))  # [P']
        if len(order) > pairs:
            ws[torch.from_numpy(np.cumsum(rep)[rep == 2] - 1)] = 0
        counts = counts + (counts == 1)
    else:
        ws = weights.reshape(-1).index_select(0, torch.from_numpy(order))  # [P]
    tokens = torch.from_numpy(order // rows.k)  # [P]
    xs = x.index_select(0, tokens)  # [P, H] grouped by expert
    ends = torch.from_numpy(counts.cumsum().astype(np.int32))  # [E]
    bias = None
    if b13 is not None:
        experts = torch.from_numpy(rows.key[order].astype(np.int64))  # [P] each row's expert
        bias = (b13.index_select(0, experts), b2.index_select(0, experts))
    ffn = _grouped_ffn_wleft if wleft else _grouped_ffn
    y = ffn(xs, w13, w2, ends, bias, **act).mul_(ws.to(x.dtype)[:, None])  # [P, H]
    return torch.zeros_like(x).index_add_(0, tokens, y)


def _moe_native(x, w13, w2, weights, rows: _SortedPairs, b13, b2, act) -> torch.Tensor:
    return moe_cpu.moe(x, w13, w2, rows.order, rows.counts, rows.k, weights).to(x.dtype)


_MOE_LAYOUTS = {
    "per_expert": _moe_per_expert,
    "wleft": functools.partial(_moe_grouped, wleft=True),
    "xleft": functools.partial(_moe_grouped, wleft=False),
    "native": _moe_native,
}


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
    columns, which can beat ``x W^T`` (`_grouped_ffn`, the GPU's form) at a few rows per
    expert whose weights stream from memory; `CPU_MOE_GEMMS` measures which."""
    I = w2.shape[2]
    h = torch._grouped_mm(w13, xs.t(), offs=ends)  # [2I, P]
    if bias is not None:  # (`_grouped_ffn`'s arguments)
        h = h.t() + bias[0]  # [P, 2I]
        a = swiglu(h, I, **act).contiguous()  # [P, I]
    else:
        # a [P, I] row-major, passed transposed: a column-major [I, P] operand slices its
        # groups into strided column blocks, which MKL reads several times slower
        a = (F.silu(h[:I]) * h[I:]).t().contiguous()  # [P, I]
    y = torch._grouped_mm(w2, a.t(), offs=ends)  # [H, P]
    y = y.t().contiguous()  # [P, H]
    return y if bias is None else y.add_(bias[1])


# `_per_expert_ffn` runs each expert's GEMMs on a multiple of this many rows: oneDNN builds a
# kernel for each new GEMM shape (a fraction of a ms, then cached), and `linear` measures each
# new row bucket, so the shapes must come from a small set.
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
    per expert and projection through `linear` (oneDNN's or MKL's GEMM, whichever it measured
    faster for the shape; `QuantizedWeight` experts dequantized one at a time by
    `expert_weight`). Each expert computes its rows rounded up to `ROW_ALIGN` (the next
    expert's, read before they are written, or the spare ones) and keeps its own: ``xs[:P]``
    becomes the result."""
    I = w2.shape[2]
    start = 0
    for e in np.flatnonzero(counts).tolist():
        n = int(counts[e])
        m = -(-n // ROW_ALIGN) * ROW_ALIGN
        w = ws[start : start + m, None]
        if b13 is None and not act:
            h = linear(xs[start : start + m], expert_weight(w13, e, xs.dtype))  # [m, 2I]
            # the router weight scales the [m, I] activations, not the [m, H] outputs
            a = F.silu(h[:, :I]).mul_(h[:, I:]).mul_(w)
            xs[start : start + n] = linear(a, expert_weight(w2, e, xs.dtype))[:n]  # [n, H]
        else:  # GPT-OSS: w (a W2 + b2) = (w a) W2 + w b2
            w13e = expert_weight(w13, e, xs.dtype)
            h = linear(xs[start : start + m], w13e, None if b13 is None else b13[e])
            y = linear(swiglu(h, I, **act).mul_(w), expert_weight(w2, e, xs.dtype))[:n]
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


def _capturable(fn) -> bool:
    """Whether ``fn()`` captures in a CUDA graph: no host synchronisation or pageable copy
    inside. ``torch._grouped_mm`` copies between host and device in some dtypes and on some
    GPUs (float32 on an H200 with torch 2.11), so it is kept out where it does not capture.
    Ranks replaying their experts from graphs (`splitmoe.expert_nodes.graphs`) run the kernels
    an eager call picks, so a path that cannot be captured is not picked at all."""
    if torch.cuda.is_current_stream_capturing():
        return False
    graph = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.graph(graph, capture_error_mode="thread_local"):
            fn()
    except RuntimeError:
        return False
    return True


def _faster_path(x, w13, w2, expert_ids, weights) -> str:
    """Times the Triton kernels and ``torch._grouped_mm`` once per shape class on this GPU;
    ``torch._grouped_mm`` only where it can be captured in a CUDA graph (`_capturable`)."""
    from splitmoe.kernels.moe_gemm import launch_fused_moe

    bucket = 1 << max(0, x.shape[0] - 1).bit_length()
    key = (str(x.device), x.dtype, tuple(w13.shape), expert_ids.shape[1], bucket)
    path = _FASTER_PATH.get(key)
    if path is not None:
        return path
    if torch.cuda.is_current_stream_capturing():  # (nothing can be timed; graphs warm up first)
        return "triton"
    path = "triton"
    if hasattr(torch, "_grouped_mm"):
        try:
            want = launch_fused_moe(x, w13, w2, expert_ids, weights)
            got = fused_moe_grouped_mm(x, w13, w2, expert_ids, weights)
            # Relative to the output's scale: in 16 bits, an element-wise rtol trips on outputs
            # near zero (the two paths round their float32 sums at different points).
            tol = 1e-4 if x.dtype == torch.float32 else 5e-2
            scale = want.float().abs().max().clamp(min=1.0)
            if not _capturable(lambda: fused_moe_grouped_mm(x, w13, w2, expert_ids, weights)):
                log.info("fused_moe %s: torch._grouped_mm cannot be captured; not used", key)
            elif (got.float() - want.float()).abs().max() <= tol * scale:
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
    fuse). `QuantizedWeight` experts go to the Triton kernels alone."""
    from splitmoe.kernels.moe_gemm import launch_fused_moe

    check_moe_inputs(x, w13, w2, expert_ids, weights)
    if isinstance(w13, QuantizedWeight):  # only the Triton kernels read the quantized layout
        return launch_fused_moe(x, w13, w2, expert_ids, weights, **ffn)
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
