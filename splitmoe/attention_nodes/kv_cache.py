"""The paged KV cache of one attention rank: one preallocated block pool per layer."""

from __future__ import annotations

import torch

from splitmoe.config import EngineConfig
from splitmoe.scheduler.window_blocks import SlidingWindowBlocks


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
        device: torch.device | str,
        latent: bool = False,
    ):
        """``latent``: one pool per layer of ``head_dim`` values per token (multi-head latent
        attention's compressed KV and rotary key, ``num_kv_heads`` 1): `layer` returns it as
        both the keys and the values."""
        shape = (num_layers, 1 if latent else 2, num_blocks, block_size, num_kv_heads, head_dim)
        # Zeroed, not torch.empty: attention reads whole blocks and masks the unwritten slots
        # with probability 0, and 0 * NaN (garbage memory) would still poison the output.
        self.pool = torch.zeros(shape, dtype=dtype, device=device)
        self.num_blocks = num_blocks
        self.block_size = block_size
        # each layer's views, made once rather than indexed again per layer and step
        self._layers = [(self.pool[i, 0], self.pool[i, -1]) for i in range(num_layers)]

    def layer(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``(k, v)`` of layer ``i``: views of the pool."""
        return self._layers[i]

    @property
    def bytes_per_token(self) -> int:
        """Cache bytes one token takes, over all layers."""
        return self.nbytes // (self.num_blocks * self.block_size)

    @property
    def nbytes(self) -> int:
        return self.pool.numel() * self.pool.element_size()


class GroupedKVCache:
    """Two `PagedKVCache` pools, one for the full-attention layers and one for the
    sliding-window layers, whose block ids are their own (`SlidingWindowBlocks`); `layer` maps
    a model layer to its pool's views."""

    def __init__(self, full: PagedKVCache, window: PagedKVCache, sliding_layers: tuple[int, ...]):
        self.full, self.window = full, window
        self.num_blocks, self.block_size = full.num_blocks, full.block_size
        full_views, window_views = iter(full._layers), iter(window._layers)
        num_layers = len(full._layers) + len(window._layers)
        self._layers = [
            next(window_views) if i in sliding_layers else next(full_views)
            for i in range(num_layers)
        ]

    def layer(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self._layers[i]

    @property
    def bytes_per_token(self) -> int:
        """Cache bytes a token inside every window takes, over all layers (older tokens keep
        only the full layers' ``full.bytes_per_token``)."""
        return self.full.bytes_per_token + self.window.bytes_per_token

    @property
    def nbytes(self) -> int:
        return self.full.nbytes + self.window.nbytes


def kv_pools(cfg: EngineConfig, device: torch.device):
    """The rank's paged KV cache (MHA or MLA latent), with the sliding-window layers' own
    group when the model has them (`window_blocks`), and its full pool's block count."""
    m, dtype, sched = cfg.model, cfg.torch_dtype, cfg.scheduler
    block_size = cfg.cache.block_size
    num_blocks = cfg.cache.resolve_num_blocks(
        m, dtype, sched.max_num_seqs, cfg.max_model_len, sched.max_num_batched_tokens
    )
    n_sliding = len(m.sliding_layers)
    kv_cache = PagedKVCache(
        m.num_layers - n_sliding,
        num_blocks,
        block_size,
        m.num_kv_heads,
        m.kv_values_per_token if m.is_mla else m.head_dim,
        dtype,
        device,
        latent=m.is_mla,
    )
    if not n_sliding:
        return kv_cache, None, num_blocks
    w_blocks = cfg.cache.window_pool_blocks(m, sched.max_num_seqs, sched.max_num_batched_tokens)
    window_cache = PagedKVCache(
        n_sliding, w_blocks, block_size, m.num_kv_heads, m.head_dim, dtype, device
    )
    grouped = GroupedKVCache(kv_cache, window_cache, m.sliding_layers)
    return grouped, SlidingWindowBlocks(w_blocks, block_size, m.sliding_window), num_blocks
