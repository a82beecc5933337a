"""The kernels a rank computes with, as backend objects chosen once at start-up.

The model's forward and the expert worker call one `AttentionBackend` and one `MoeBackend`; which
kernels sit behind them is decided here, from ``attention_backend`` / ``moe_backend`` and the
device, before the first step (as mini-sglang's ``BaseAttnBackend`` / ``BaseMoeBackend``):

* ``"torch"``: the PyTorch paths (`paged_attention`'s reference, `fused_moe`'s CPU grouped GEMMs
  or the reference), on any device; the default on CPU.
* ``"triton"``: the Triton kernels (`prefill_attention` + `decode_attention`, `moe_gemm` or
  ``torch._grouped_mm`` where faster); the default on CUDA, and on CPU only through the Triton
  interpreter (tests).

A backend is a thin object over functions from tensors to tensors: it holds no layer loop, no
communication and no request state.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import ClassVar

import torch

from splitmoe.kernels.attention_metadata import AttentionMetadata
from splitmoe.kernels.fused_moe import fused_moe
from splitmoe.kernels.paged_attention import paged_attention, store_kv


class AttentionBackend(ABC):
    """Paged attention of one rank: stores new keys/values and attends over the cache."""

    name: ClassVar[str]

    def __init__(self, device: torch.device):
        self.device = device

    def store_kv(
        self,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        slots: torch.Tensor,
    ) -> None:
        """Writes ``k, v [T, num_kv_heads, head_dim]`` into the flat cache ``slots [T]``."""
        store_kv(k, v, k_cache, v_cache, slots)

    @abstractmethod
    def attend(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:
        """Causal attention of ``q [T, num_heads, head_dim]`` over ``k_cache, v_cache [blocks,
        block_size, num_kv_heads, head_dim]`` -> ``[T, num_heads, head_dim]``."""


class MoeBackend(ABC):
    """The grouped expert FFN of one rank."""

    name: ClassVar[str]

    def __init__(self, device: torch.device):
        self.device = device

    @abstractmethod
    def experts(
        self,
        x: torch.Tensor,
        w13: torch.Tensor,
        w2: torch.Tensor,
        expert_ids: torch.Tensor,
        weights: torch.Tensor,
    ) -> torch.Tensor:
        """``x [N, H]``, ``w13 [E, 2I, H]``, ``w2 [E, H, I]``, local ``expert_ids [N, k]`` (-1:
        not here) and router ``weights [N, k]`` -> the weighted expert sums ``[N, H]``."""


class TorchAttention(AttentionBackend):
    name = "torch"

    def attend(self, q, k_cache, v_cache, meta, scale):
        return paged_attention(q, k_cache, v_cache, meta, scale, "torch")


class TritonAttention(AttentionBackend):
    name = "triton"

    def __init__(self, device: torch.device):
        super().__init__(device)
        from splitmoe.kernels.triton_utils import require_triton

        require_triton("attention_backend", device)

    def attend(self, q, k_cache, v_cache, meta, scale):
        return paged_attention(q.contiguous(), k_cache, v_cache, meta, scale, "triton")


class TorchMoe(MoeBackend):
    name = "torch"

    def experts(self, x, w13, w2, expert_ids, weights):
        return fused_moe(x, w13, w2, expert_ids, weights, "torch")


class TritonMoe(MoeBackend):
    name = "triton"

    def __init__(self, device: torch.device):
        super().__init__(device)
        from splitmoe.kernels.triton_utils import require_triton

        require_triton("moe_backend", device)

    def experts(self, x, w13, w2, expert_ids, weights):
        return fused_moe(x, w13, w2, expert_ids, weights, "triton")


ATTENTION_BACKENDS: dict[str, type[AttentionBackend]] = {
    cls.name: cls for cls in (TorchAttention, TritonAttention)
}
MOE_BACKENDS: dict[str, type[MoeBackend]] = {cls.name: cls for cls in (TorchMoe, TritonMoe)}


def resolve_backend(name: str, device_type: str) -> str:
    """``"auto"``: Triton on CUDA, PyTorch elsewhere (the fastest on each, docs/kernels.md)."""
    if name == "auto":
        return "triton" if device_type == "cuda" else "torch"
    return name


def attention_backend(name: str, device: torch.device) -> AttentionBackend:
    """The attention backend ``name`` (``"auto"`` resolved) on ``device``."""
    return ATTENTION_BACKENDS[resolve_backend(name, device.type)](device)


def moe_backend(name: str, device: torch.device) -> MoeBackend:
    """The MoE backend ``name`` (``"auto"`` resolved) on ``device``."""
    return MOE_BACKENDS[resolve_backend(name, device.type)](device)
