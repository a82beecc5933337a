"""The kernels a rank computes with, as backend objects chosen once at start-up.

The model's forward and the expert worker call one `AttentionBackend` and one `MoeBackend`; which
kernels sit behind them is decided here, from ``attention_backend`` / ``moe_backend`` and the
device, before the first step (as mini-sglang's ``BaseAttnBackend`` / ``BaseMoeBackend``):

* ``"torch"``: the PyTorch paths (`paged_attention_ref`, `fused_moe_torch`: on CPU the grouped
  GEMMs of `fused_moe_cpu`), on any device; the default on CPU.
* ``"triton"``: the Triton kernels (`paged_attention_triton`, `fused_moe_gpu`); the default on
  CUDA, and on CPU only through the Triton interpreter (tests).

A backend binds the kernel functions of its name (`ATTENTION_KERNELS`, `MOE_KERNELS`): no layer
loop, no communication, no request state, and no choice left for the hot path to make.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from splitmoe.kernels.fused_moe import MOE_KERNELS
from splitmoe.kernels.mla_attention import MLA_KERNELS, store_latent
from splitmoe.kernels.paged_attention import ATTENTION_KERNELS, store_kv
from splitmoe.kernels.triton_utils import require_triton


@dataclass(frozen=True)
class AttentionBackend:
    """Paged attention of one rank.

    attend: ``(q [T, num_heads, head_dim], k_cache, v_cache [blocks, block_size, num_kv_heads,
        head_dim], meta, scale) -> [T, num_heads, head_dim]``, causal over the cache;
    store_kv: ``(k, v [T, num_kv_heads, head_dim], k_cache, v_cache, slots [T])``, writes the
        new keys and values into their flat cache slots.
    attend_mla: multi-head latent attention (`splitmoe.kernels.mla_attention`): ``(q [T,
        num_heads, Dk] absorbed queries, cache [blocks, block_size, 1, Dk], meta, scale, v_dim)
        -> [T, num_heads, v_dim]``, causal over the latent cache;
    store_latent: ``(latent [T, Dk], cache, slots [T])``.
    """

    name: str
    attend: Callable[..., torch.Tensor]
    store_kv: Callable[..., None] = store_kv
    attend_mla: Callable[..., torch.Tensor] | None = None
    store_latent: Callable[..., None] = store_latent


@dataclass(frozen=True)
class MoeBackend:
    """The grouped expert FFN of one rank.

    experts: ``(x [N, H], w13 [E, 2I, H], w2 [E, H, I], expert_ids [N, k] local ids (-1: not
        here), weights [N, k]) -> [N, H]``, the weighted expert sums.
    """

    name: str
    experts: Callable[..., torch.Tensor]


def resolve_backend(name: str, device_type: str) -> str:
    """``"auto"``: Triton on CUDA, PyTorch elsewhere (the fastest on each, docs/kernels.md)."""
    if name == "auto":
        return "triton" if device_type == "cuda" else "torch"
    return name


def attention_backend(name: str, device: torch.device) -> AttentionBackend:
    """The attention backend ``name`` (``"auto"`` resolved) on ``device``."""
    name = resolve_backend(name, device.type)
    if name == "triton":
        require_triton("attention_backend", device)
    return AttentionBackend(name, ATTENTION_KERNELS[name], attend_mla=MLA_KERNELS[name])


def moe_backend(name: str, device: torch.device) -> MoeBackend:
    """The MoE backend ``name`` (``"auto"`` resolved) on ``device``."""
    name = resolve_backend(name, device.type)
    if name == "triton":
        require_triton("moe_backend", device)
    return MoeBackend(name, MOE_KERNELS[name])
