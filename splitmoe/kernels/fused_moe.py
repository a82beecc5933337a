"""Grouped expert FFN: the public entry, its PyTorch reference, and the GPU fast paths.

Given tokens ``x [N, H]``, the experts each token uses *here* (``expert_ids [N, k]``, local ids,
-1 for a slot served elsewhere) and their router weights, computes for every token
``sum_j w_j * down_e(silu(gate_e(x)) * up_e(x))`` over its local experts ``e = expert_ids[:, j]``.

Backends: ``"torch"`` runs `fused_moe_ref`. ``"triton"`` runs the fused Triton grouped GEMMs
(`splitmoe.kernels.moe_gemm`); on CUDA it also measures ``torch._grouped_mm`` (CUTLASS grouped
GEMM, where this torch build and GPU have it) once per (device, dtype, shapes, batch-size bucket)
and keeps whichever is faster, provided both agree with each other.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

log = logging.getLogger(__name__)


def fused_moe_ref(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    expert_ids: torch.Tensor,
    weights: torch.Tensor,
) -> torch.Tensor:
    """x ``[N, H]``; w13 ``[E, 2I, H]`` (gate rows, then up rows); w2 ``[E, H, I]``;
    expert_ids ``[N, k]`` int (-1 = skip); weights ``[N, k]``. Returns ``[N, H]`` in x's dtype."""
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
        h = F.linear(x[tok], w13[e])  # [n, 2I]
        h = F.silu(h[:, :inter]) * h[:, inter:]
        y = F.linear(h, w2[e]) * w[start : start + n, None]  # [n, H]
        out.index_add_(0, tok, y)
        start += n
    return out


@dataclass(frozen=True)
class ExpertSort:
    """(token, expert) pairs grouped by expert, each expert's run padded to ``block_m`` rows.

    sorted_ids: ``[num_blocks * block_m]`` int32, the flat pair index ``token * k + j`` of each
        row; padding rows hold ``N * k``.
    block_expert: ``[num_blocks]`` int32, the expert of each ``block_m`` rows; -1 for blocks past
        the padded total (``num_blocks`` is an upper bound, so nothing waits on the GPU).
    """

    sorted_ids: torch.Tensor
    block_expert: torch.Tensor


def count_keys(key: torch.Tensor, n: int) -> torch.Tensor:
    """``[n]`` int64: how often each of ``0 .. n-1`` occurs in the int64 ``key`` (any shape).
    ``index_add_`` rather than ``bincount``: on a GPU, ``bincount`` reads the largest key back
    to the host to size its output, a synchronisation per call that also breaks CUDA graphs."""
    key = key.reshape(-1)
    return torch.zeros(n, dtype=torch.int64, device=key.device).index_add_(
        0, key, torch.ones_like(key)
    )


def sort_by_expert(expert_ids: torch.Tensor, num_experts: int, block_m: int) -> ExpertSort:
    """Groups the pairs of ``expert_ids [N, k]`` (-1: skip) by expert, on the device, no sync."""
    flat = expert_ids.reshape(-1)  # [P]
    P = flat.numel()
    dev = flat.device
    key = torch.where(flat >= 0, flat, num_experts).long()  # skipped slots sort last
    sorted_key, order = torch.sort(key, stable=True)  # [P]
    counts = count_keys(key, num_experts + 1)[:num_experts]  # [E]
    padded = (counts + block_m - 1) // block_m * block_m  # [E]
    pad_end = padded.cumsum(0)  # [E] end row of each expert's padded run
    first = counts.cumsum(0) - counts  # [E] first sorted index of each expert
    e = sorted_key.clamp(max=num_experts - 1)
    dest = pad_end[e] - padded[e] + torch.arange(P, device=dev) - first[e]  # [P] padded row
    # At most min(E, P) experts are used, each wasting < block_m rows to padding.
    num_blocks = -(-(P + (block_m - 1) * min(num_experts, P)) // block_m)
    rows = num_blocks * block_m
    dest = torch.where(sorted_key < num_experts, dest, rows)  # skipped pairs: one spare row
    sorted_ids = torch.full((rows + 1,), P, dtype=torch.int32, device=dev)
    sorted_ids.scatter_(0, dest, order.to(torch.int32))
    starts = torch.arange(num_blocks, device=dev) * block_m
    block_expert = torch.searchsorted(pad_end, starts, right=True)  # [num_blocks]
    block_expert = torch.where(block_expert < num_experts, block_expert, -1).to(torch.int32)
    return ExpertSort(sorted_ids=sorted_ids[:rows], block_expert=block_expert)


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


def _grouped_ffn(a: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, ends: torch.Tensor):
    """The expert FFN of rows ``a [P, H]`` grouped by expert (expert ``e``'s rows end at
    ``ends[e]``, int32): gate/up GEMM, SiLU-and-multiply, down GEMM -> ``[P, H]``."""
    I = w2.shape[2]
    h = torch._grouped_mm(a, w13.transpose(1, 2), offs=ends)  # [P, 2I]
    h = F.silu(h[:, :I]) * h[:, I:]  # [P, I]
    return torch._grouped_mm(h, w2.transpose(1, 2), offs=ends)


def fused_moe_padded_bmm(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    expert_ids: torch.Tensor,
    weights: torch.Tensor,
) -> torch.Tensor:
    """The same math as two batched GEMMs over ``[E, cap, H]``, each expert's tokens padded to
    the busiest expert's count ``cap``: two calls instead of 2 x experts, at the price of the
    padding rows' FLOPs."""
    N, H = x.shape
    E, I, k = w13.shape[0], w2.shape[2], expert_ids.shape[1]
    flat = expert_ids.reshape(-1)  # [P]
    key = torch.where(flat >= 0, flat, E).long()
    counts = torch.bincount(key, minlength=E + 1)  # [E+1]; bucket E: slots served elsewhere
    cap = int(counts[:E].max())
    order = torch.argsort(key, stable=True)  # [P]
    skey = key[order]
    keep = skey < E
    order, skey = order[keep], skey[keep]
    starts = torch.cumsum(counts, 0) - counts
    slot = skey * cap + torch.arange(order.numel(), device=x.device) - starts[skey]  # [P']
    xb = x.new_zeros(E * cap, H)
    xb[slot] = x[order // k]
    h = torch.bmm(xb.view(E, cap, H), w13.transpose(1, 2))  # [E, cap, 2I]
    a = F.silu(h[..., :I]) * h[..., I:]
    y = torch.bmm(a, w2.transpose(1, 2)).view(E * cap, H)[slot]  # [P', H]
    y = y * weights.reshape(-1)[order].to(y.dtype)[:, None]
    out = torch.zeros_like(x)
    out.index_add_(0, order // k, y)
    return out


def fused_moe_cpu(x, w13, w2, expert_ids, weights) -> torch.Tensor:
    """The faster torch path on CPU: `fused_moe_grouped_cpu` when the strides allow
    ``torch._grouped_mm`` (no padding rows), else padded batched GEMMs while padding costs at
    most 2x the real rows, else the per-expert loop. 16 experts top-4, H 128, I 64, 1 thread:
    the grouped path takes ~300 us at 32 tokens and ~600 us at 128 (the padded one ~450 / ~910)."""
    if _grouped_mm_fits(x, w2):
        return fused_moe_grouped_cpu(x, w13, w2, expert_ids, weights)
    valid = expert_ids[expert_ids >= 0]
    if valid.numel() == 0:
        return torch.zeros_like(x)
    cap = int(torch.bincount(valid.long(), minlength=w13.shape[0]).max())
    if cap * w13.shape[0] <= 2 * valid.numel():
        return fused_moe_padded_bmm(x, w13, w2, expert_ids, weights)
    return fused_moe_ref(x, w13, w2, expert_ids, weights)


def fused_moe_grouped_cpu(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    expert_ids: torch.Tensor,
    weights: torch.Tensor,
) -> torch.Tensor:
    """`fused_moe_ref`'s order of work (pairs sorted by expert, each expert's rows added into
    their tokens, experts in ascending order) with one ``torch._grouped_mm`` per projection
    instead of a loop over experts. On CPU the host holds every count, so slots served elsewhere
    are cut off instead of masked, the sort is numpy's radix argsort of 16-bit keys, and rows
    move with ``index_select`` / ``index_add_``: bit-identical to `fused_moe_ref`, and 1.2-1.3x
    faster than `fused_moe_grouped_mm` at 32-128 tokens of the default model on one thread."""
    E, k = w13.shape[0], expert_ids.shape[1]
    flat = expert_ids.reshape(-1).numpy()
    key = np.where(flat >= 0, flat, E).astype(np.uint16 if E < 1 << 16 else np.int64)
    counts = np.bincount(key, minlength=E + 1)[:E]
    pairs = int(counts.sum())
    if pairs == 0:
        return torch.zeros_like(x)
    order = torch.from_numpy(np.argsort(key, kind="stable")[:pairs])  # [P] pair index
    ends = torch.from_numpy(counts.cumsum().astype(np.int32))  # [E]
    tokens = order // k  # [P]
    y = _grouped_ffn(x.index_select(0, tokens), w13, w2, ends)  # [P, H]
    y.mul_(weights.reshape(-1).index_select(0, order).to(y.dtype)[:, None])
    return torch.zeros_like(x).index_add_(0, tokens, y)


def _grouped_mm_fits(x: torch.Tensor, w2: torch.Tensor) -> bool:
    """``torch._grouped_mm`` on CPU needs row strides that are multiples of 16 bytes."""
    if not hasattr(torch, "_grouped_mm") or x.device.type != "cpu" or x.shape[0] == 0:
        return False
    row = 16 // x.element_size()
    return (
        x.dtype in (torch.float32, torch.bfloat16)
        and w2.shape[1] % row == 0
        and (w2.shape[2] % row == 0)
    )


def _check_shapes(x, w13, w2, expert_ids, weights) -> None:
    N, H = x.shape
    E, two_i, H2 = w13.shape
    if H2 != H or two_i % 2 or w2.shape != (E, H, two_i // 2) or expert_ids.shape != weights.shape:
        raise ValueError(
            f"fused_moe: shapes do not fit: x {tuple(x.shape)}, w13 {tuple(w13.shape)}, "
            f"w2 {tuple(w2.shape)}, expert_ids {tuple(expert_ids.shape)}, "
            f"weights {tuple(weights.shape)}"
        )
    if expert_ids.shape[0] != N:
        raise ValueError(f"fused_moe: {expert_ids.shape[0]} routing rows for {N} tokens")


def check_moe_inputs(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    expert_ids: torch.Tensor,
    weights: torch.Tensor,
) -> None:
    """Shapes, dtypes, strides and devices the fused paths rely on."""
    _check_shapes(x, w13, w2, expert_ids, weights)
    from splitmoe.kernels.triton_utils import SUPPORTED_DTYPES

    if x.dtype not in SUPPORTED_DTYPES or w13.dtype != x.dtype or w2.dtype != x.dtype:
        raise ValueError(
            f"fused_moe: x and the weights must share one of float16/bfloat16/float32; got "
            f"x {x.dtype}, w13 {w13.dtype}, w2 {w2.dtype}"
        )
    if expert_ids.dtype.is_floating_point or expert_ids.dtype == torch.bool:
        raise ValueError(f"fused_moe: expert_ids must be integers, got {expert_ids.dtype}")
    if not weights.dtype.is_floating_point:
        raise ValueError(f"fused_moe: weights must be floating point, got {weights.dtype}")
    if x.stride(-1) != 1 or w13.stride(-1) != 1 or w2.stride(-1) != 1:
        raise ValueError(
            "fused_moe: the last dim of x, w13 and w2 must be contiguous; got strides "
            f"x {x.stride()}, w13 {w13.stride()}, w2 {w2.stride()}"
        )
    for name, t in (("w13", w13), ("w2", w2), ("expert_ids", expert_ids), ("weights", weights)):
        if t.device != x.device:
            raise ValueError(f"fused_moe: {name} is on {t.device}, x on {x.device}")


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


def weight_layout(
    w13: torch.Tensor, w2: torch.Tensor, backend: str
) -> tuple[torch.Tensor, torch.Tensor]:
    """The loader's expert weights ``w13 [E, 2I, H]``, ``w2 [E, H, I]`` in the form `fused_moe`
    takes them with ``backend``: as they are, or transposed for ``"cpu"``
    (`cpu_native.expert_layout`)."""
    if backend != "cpu":
        return w13, w2
    from splitmoe.kernels import cpu_native

    return cpu_native.expert_layout(w13, w2)


def fused_moe(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    expert_ids: torch.Tensor,
    weights: torch.Tensor,
    backend: str = "torch",
) -> torch.Tensor:
    """Routed-expert output ``[N, H]`` in x's dtype.

    x ``[N, H]``; w13 ``[E, 2I, H]`` (gate rows, then up rows); w2 ``[E, H, I]``; expert_ids
    ``[N, k]`` local expert ids (-1: the slot is served by another rank); weights ``[N, k]``
    router weights (float32, or x's dtype). ``backend``: ``"torch"``, ``"triton"`` or ``"cpu"``
    (the native kernel, float32 on CPU, which takes the weights in `weight_layout`'s form).
    """
    if backend == "cpu":
        from splitmoe.kernels import cpu_native

        return cpu_native.fused_moe(x, w13, w2, expert_ids, weights)
    if backend == "torch":
        _check_shapes(x, w13, w2, expert_ids, weights)
        if x.device.type == "cpu" and x.shape[0]:
            return fused_moe_cpu(x, w13, w2, expert_ids, weights)
        return fused_moe_ref(x, w13, w2, expert_ids, weights)
    if backend != "triton":
        raise ValueError(
            f"moe backend {backend!r} is not available; use 'torch', 'triton' or 'cpu'"
        )
    from splitmoe.kernels.triton_utils import require_triton

    require_triton("moe_backend", x.device)
    from splitmoe.kernels.moe_gemm import launch_fused_moe

    check_moe_inputs(x, w13, w2, expert_ids, weights)
    if x.shape[0] and x.device.type == "cuda":
        if _faster_path(x, w13, w2, expert_ids, weights) == "grouped_mm":
            return fused_moe_grouped_mm(x, w13, w2, expert_ids, weights)
    return launch_fused_moe(x, w13, w2, expert_ids, weights)
