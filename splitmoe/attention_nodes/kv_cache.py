"""The paged KV cache of one attention rank: one preallocated block pool per layer."""

from __future__ import annotations

import torch


class PagedKVCache:
    """``k[layer], v[layer]: [num_blocks, block_size, num_kv_heads, head_dim]``."""

    def __init__(
        self,
        num_layers: int,
        num_blocks: int,
        block_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device,
    ):
        shape = (num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim)
        # torch.empty: pages are committed as blocks are first written, not up front.
        self.pool = torch.empty(shape, dtype=dtype, device=device)
        self.num_blocks = num_blocks
        self.block_size = block_size

    def layer(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.pool[i, 0], self.pool[i, 1]

    @property
    def nbytes(self) -> int:
        return self.pool.numel() * self.pool.element_size()
