"""Grouped expert FFN: the PyTorch reference of the fused MoE kernel.

Given tokens ``x [N, H]``, the experts each token uses *here* (``expert_ids [N, k]``, local ids,
-1 for a slot served elsewhere) and their router weights, computes for every token
``sum_j w_j * down_e(silu(gate_e(x)) * up_e(x))`` over its local experts ``e = expert_ids[:, j]``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


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


def fused_moe(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    expert_ids: torch.Tensor,
    weights: torch.Tensor,
    backend: str = "torch",
) -> torch.Tensor:
    """Public entry: checks shapes, then runs the chosen backend (``"torch"`` for now)."""
    N, H = x.shape
    E, two_i, H2 = w13.shape
    if H2 != H or w2.shape != (E, H, two_i // 2) or expert_ids.shape != weights.shape:
        raise ValueError(
            f"fused_moe: shapes do not fit: x {tuple(x.shape)}, w13 {tuple(w13.shape)}, "
            f"w2 {tuple(w2.shape)}, expert_ids {tuple(expert_ids.shape)}, "
            f"weights {tuple(weights.shape)}"
        )
    if expert_ids.shape[0] != N:
        raise ValueError(f"fused_moe: {expert_ids.shape[0]} routing rows for {N} tokens")
    if backend != "torch":
        raise ValueError(f"moe backend {backend!r} is not available; use 'torch'")
    return fused_moe_ref(x, w13, w2, expert_ids, weights)
