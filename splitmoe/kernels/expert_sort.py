"""(token, expert) pairs grouped by expert on the device, and the input checks of the grouped
expert FFN: shared by the MoE kernels of every backend."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from splitmoe.kernels.quant import QuantizedWeight
from splitmoe.kernels.triton_utils import SUPPORTED_DTYPES


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


def check_moe_shapes(x, w13, w2, expert_ids, weights) -> None:
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
    """Shapes, dtypes, strides and devices the fused paths rely on. The weights are dense
    tensors of x's dtype, or both `QuantizedWeight` of one format (checked by its constructor)."""
    check_moe_shapes(x, w13, w2, expert_ids, weights)
    q13, q2 = isinstance(w13, QuantizedWeight), isinstance(w2, QuantizedWeight)
    if q13 or q2:
        if not (q13 and q2) or w13.fmt != w2.fmt:
            raise ValueError(
                "fused_moe: w13 and w2 must both be dense or both QuantizedWeight of one format"
            )
        if x.dtype not in SUPPORTED_DTYPES:
            raise ValueError(f"fused_moe: x must be float16/bfloat16/float32, got {x.dtype}")
    elif x.dtype not in SUPPORTED_DTYPES or w13.dtype != x.dtype or w2.dtype != x.dtype:
        raise ValueError(
            f"fused_moe: x and the weights must share one of float16/bfloat16/float32; got "
            f"x {x.dtype}, w13 {w13.dtype}, w2 {w2.dtype}"
        )
    if expert_ids.dtype.is_floating_point or expert_ids.dtype == torch.bool:
        raise ValueError(f"fused_moe: expert_ids must be integers, got {expert_ids.dtype}")
    if not weights.dtype.is_floating_point:
        raise ValueError(f"fused_moe: weights must be floating point, got {weights.dtype}")
    d13, d2 = (w.data if isinstance(w, QuantizedWeight) else w for w in (w13, w2))
    if x.stride(-1) != 1 or d13.stride(-1) != 1 or d2.stride(-1) != 1:
        raise ValueError(
            "fused_moe: the last dim of x, w13 and w2 must be contiguous; got strides "
            f"x {x.stride()}, w13 {d13.stride()}, w2 {d2.stride()}"
        )
    for name, t in (("w13", w13), ("w2", w2), ("expert_ids", expert_ids), ("weights", weights)):
        if t.device != x.device:
            raise ValueError(f"fused_moe: {name} is on {t.device}, x on {x.device}")
