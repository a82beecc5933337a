"""A set of routed experts held by one rank, for every MoE layer."""

from __future__ import annotations

import torch

from splitmoe.config import ModelConfig
from splitmoe.kernels.fused_moe import fused_moe
from splitmoe.models.loader import load_expert_weights


class LocalExperts:
    """The experts of every MoE layer held by one rank, indexed by local slot id.

    ``expert_ids``: global expert ids in local-slot order, one list for every layer or one per
    layer (expert ranks with replicas: `Placement.experts_on`). Loads only their tensors. Used by
    expert ranks, and by attention ranks in colocated mode (all experts, so local ids equal
    global ids).
    """

    def __init__(
        self,
        cfg: ModelConfig,
        expert_ids: list[int] | dict[int, list[int]],
        dtype: torch.dtype,
        device: torch.device,
        backend: str = "torch",
    ):
        self.cfg = cfg
        self.dtype = dtype
        self.device = device
        if not isinstance(expert_ids, dict):
            expert_ids = {layer: list(expert_ids) for layer in cfg.moe_layers}
        self.layer_experts = {layer: list(ids) for layer, ids in expert_ids.items()}
        self.weights = load_expert_weights(cfg, self.layer_experts, dtype, str(device))
        self.backend = backend
        self.weights_reloaded = 0  # (layer, slot) weights replaced by rebalances

    @property
    def expert_ids(self) -> list[int]:
        """Distinct experts held in any layer."""
        return sorted({e for ids in self.layer_experts.values() for e in ids})

    def update(self, expert_ids: dict[int, list[int]]) -> int:
        """Rebalance: makes each layer's local slots hold ``expert_ids[layer]`` (same slot count),
        reading only the (layer, slot) weights that change, from the checkpoint; returns how many
        changed."""
        changed = {
            layer: [s for s, (a, b) in enumerate(zip(self.layer_experts[layer], ids)) if a != b]
            for layer, ids in expert_ids.items()
        }
        changed = {layer: slots for layer, slots in changed.items() if slots}
        fresh = load_expert_weights(
            self.cfg,
            {layer: [expert_ids[layer][s] for s in slots] for layer, slots in changed.items()},
            self.dtype,
            str(self.device),
        )
        n = 0
        for layer, slots in changed.items():
            w13, w2 = self.weights[layer]
            idx = torch.tensor(slots, device=w13.device)
            w13[idx] = fresh[layer][0]
            w2[idx] = fresh[layer][1]
            self.layer_experts[layer] = list(expert_ids[layer])
            n += len(slots)
        self.weights_reloaded += n
        return n

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
