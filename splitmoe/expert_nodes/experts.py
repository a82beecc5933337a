"""A set of routed experts held by one rank, for every MoE layer."""

from __future__ import annotations

import torch

from splitmoe.config import ModelConfig
from splitmoe.kernels.fused_moe import fused_moe
from splitmoe.models.loader import load_expert_weights


class LocalExperts:
    """Experts ``expert_ids`` (global ids, in local-id order) of every MoE layer.

    Loads only their tensors. Used by expert ranks, and by attention ranks in colocated mode
    (all experts, so local ids equal global ids).
    """

    def __init__(
        self,
        cfg: ModelConfig,
        expert_ids: list[int],
        dtype: torch.dtype,
        device: torch.device,
        backend: str = "torch",
    ):
        self.expert_ids = list(expert_ids)
        self.weights = load_expert_weights(cfg, self.expert_ids, dtype, str(device))
        self.backend = backend

    def compute(
        self, layer: int, x: torch.Tensor, local_ids: torch.Tensor, weights: torch.Tensor
    ) -> torch.Tensor:
        """``x [N, H]``, ``local_ids / weights [N, k]`` (-1: not here) -> sums ``[N, H]``."""
        w13, w2 = self.weights[layer]
        return fused_moe(x, w13, w2, local_ids, weights, self.backend)

    # Colocated mode: an ExpertExecutor whose local ids are the global ids; nothing to overlap,
    # so `start` computes and `finish` hands the result back.
    def start(
        self, layer: int, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor
    ) -> torch.Tensor:
        return self.compute(layer, x, topk_ids, topk_weights)

    def finish(self, handle: torch.Tensor) -> torch.Tensor:
        return handle
