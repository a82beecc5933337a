"""Paged multi-head latent attention (MLA) in the absorbed form: the public entry and the
PyTorch reference.

Layout: one layer's latent cache is ``cache [num_blocks, block_size, 1, Dk]`` with ``Dk =
kv_lora_rank + qk_rope_head_dim``: per token the compressed KV vector ``c`` then the rotary key
(`splitmoe.attention_nodes.mla`). The queries ``q [T, num_heads, Dk]`` are the absorbed ones
(``W_UK^T q_nope`` then ``q_pe``); every head attends to the same cached rows (multi-query), a
key is the whole row and a value its first ``Dv = kv_lora_rank`` entries. The output ``[T,
num_heads, Dv]`` is the latent context, which the model up-projects per head. Packing, causality
and the block tables are those of `splitmoe.kernels.paged_attention`.

Backends: ``"torch"`` is `mla_attention_ref`, the paged reference with K = V = the latent rows
(its output's rotary columns dropped); ``"triton"`` the split-KV decode kernel of
`splitmoe.kernels.mla_decode` for one-token rows and the prefill/extend kernel of
`splitmoe.kernels.mla_prefill` for the others.
"""

from __future__ import annotations

import torch

from splitmoe.kernels.attention_metadata import AttentionMetadata
from splitmoe.kernels.paged_attention import paged_attention_ref
from splitmoe.kernels.triton_utils import require_triton


def store_latent(latent: torch.Tensor, cache: torch.Tensor, slots: torch.Tensor) -> None:
    """Writes the new tokens' latent rows ``[T, Dk]`` into their flat cache slots."""
    cache.view(-1, cache.shape[-1]).index_copy_(0, slots, latent)


def mla_attention_ref(
    q: torch.Tensor, cache: torch.Tensor, meta: AttentionMetadata, scale: float, v_dim: int
) -> torch.Tensor:
    """Causal latent attention of packed absorbed queries ``q [T, nh, Dk]`` over the paged
    latent ``cache [blocks, block_size, 1, Dk]``: ``[T, nh, v_dim]`` in q's dtype."""
    return paged_attention_ref(q, cache, cache, meta, scale)[..., :v_dim]


def mla_attention_triton(
    q: torch.Tensor, cache: torch.Tensor, meta: AttentionMetadata, scale: float, v_dim: int
) -> torch.Tensor:
    """`mla_attention_ref`'s math on the Triton kernels: split-KV decode
    (`splitmoe.kernels.mla_decode`) for one-token rows, prefill/extend
    (`splitmoe.kernels.mla_prefill`) for the others."""
    from splitmoe.kernels.mla_decode import check_mla_inputs, mla_decode_attention
    from splitmoe.kernels.mla_prefill import mla_prefill_attention

    q = q.contiguous()
    check_mla_inputs(q, cache, meta)
    out = q.new_empty(q.shape[0], q.shape[1], v_dim)
    mla_prefill_attention(q, cache, meta, scale, v_dim, out)
    mla_decode_attention(q, cache, meta, scale, v_dim, out)
    return out


# The MLA kernel of each backend (`splitmoe.kernels.backends` binds one per rank).
MLA_KERNELS = {"torch": mla_attention_ref, "triton": mla_attention_triton}


def mla_attention(
    q: torch.Tensor,
    cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    v_dim: int,
    backend: str = "torch",
) -> torch.Tensor:
    """Checks the shapes, then runs the backend's MLA kernel (`MLA_KERNELS`)."""
    if q.dim() != 3 or cache.dim() != 4 or cache.shape[2] != 1 or q.shape[2] != cache.shape[3]:
        raise ValueError(
            f"mla_attention: q must be [T, heads, Dk] and the cache [blocks, block_size, 1, Dk]; "
            f"got q {tuple(q.shape)}, cache {tuple(cache.shape)}"
        )
    if not 0 < v_dim <= q.shape[2]:
        raise ValueError(f"mla_attention: v_dim={v_dim} must be in 1..{q.shape[2]}")
    if backend not in MLA_KERNELS:
        raise ValueError(f"attention backend {backend!r} is not available; use 'torch' or 'triton'")
    if backend == "triton":
        require_triton("attention_backend", q.device)
    return MLA_KERNELS[backend](q, cache, meta, scale, v_dim)
