"""Pure-PyTorch reference of one layer's dispatch + expert FFN + combine (the comm oracle).

Python loops over ranks and tokens, written for clarity; it fixes the data layout every transport
must reproduce bit for bit: an expert rank receives, by source attention rank ascending, then by
token ascending, every token with at least one top-k expert on it (once), with its local expert
ids (-1 for slots served elsewhere) and float32 weights; an attention rank adds the returned
partial sums of a token in expert-rank order, starting from zero.
"""

from __future__ import annotations

from collections.abc import Callable

import torch


def reference_layer(
    inputs: dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor]],
    expert_owner: tuple[int, ...],
    num_expert_ranks: int,
    expert_fn: Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor],
) -> tuple[dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor]], dict[int, torch.Tensor]]:
    """``inputs[a] = (x [T, H], topk_ids [T, k], topk_weights [T, k])`` per attention rank;
    ``expert_fn(j, x, local_ids, weights) -> y`` runs expert rank ``j``'s experts.

    Returns what each expert rank ``j`` (0-based) receives and each attention rank's output.
    """
    local = {}
    for j in range(num_expert_ranks):
        mine = [e for e, o in enumerate(expert_owner) if o == j]
        local.update({e: i for i, e in enumerate(mine)})
    received, sources = {}, {}
    for j in range(num_expert_ranks):
        xs, ids, ws, src = [], [], [], []
        for a in sorted(inputs):
            x, topk, w = inputs[a]
            for t in range(x.shape[0]):
                experts = topk[t].tolist()
                if not any(expert_owner[e] == j for e in experts):
                    continue
                xs.append(x[t])
                ids.append([local[e] if expert_owner[e] == j else -1 for e in experts])
                ws.append(w[t].to(torch.float32))
                src.append((a, t))
        H = next(iter(inputs.values()))[0].shape[1]
        k = next(iter(inputs.values()))[1].shape[1]
        dtype = next(iter(inputs.values()))[0].dtype
        received[j] = (
            torch.stack(xs) if xs else torch.empty(0, H, dtype=dtype),
            torch.tensor(ids, dtype=torch.int32).view(-1, k),
            torch.stack(ws) if ws else torch.empty(0, k, dtype=torch.float32),
        )
        sources[j] = src
    outputs = {a: torch.zeros_like(x) for a, (x, _, _) in inputs.items()}
    for j in range(num_expert_ranks):
        y = expert_fn(j, *received[j])
        for row, (a, t) in enumerate(sources[j]):
            outputs[a][t] += y[row]
    return received, outputs
