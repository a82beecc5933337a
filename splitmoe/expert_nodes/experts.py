"""A set of routed experts held by one rank, for every MoE layer."""

from __future__ import annotations

import time

import torch

from splitmoe.comm.transport import ExpertBatch
from splitmoe.config import ModelConfig
from splitmoe.kernels.backends import MoeBackend
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
        backend: MoeBackend,
    ):
        self.cfg = cfg
        self.dtype = dtype
        self.device = device
        if not isinstance(expert_ids, dict):
            expert_ids = {layer: list(expert_ids) for layer in cfg.moe_layers}
        self.layer_experts = {layer: list(ids) for layer, ids in expert_ids.items()}
        self.backend = backend
        # per MoE layer: w13 [n, 2I, H], w2 [n, H, I] (and with expert biases b13 [n, 2I],
        # b2 [n, H])
        self.weights = load_expert_weights(cfg, self.layer_experts, dtype, str(device))
        # the clamped SwiGLU (GPT-OSS), passed with the biases to the backend
        self.act = (
            {}
            if cfg.swiglu_limit is None
            else dict(swiglu_limit=cfg.swiglu_limit, swiglu_alpha=cfg.swiglu_alpha)
        )
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
            idx = torch.tensor(slots, device=self.weights[layer][0].device)
            for held, new in zip(self.weights[layer], fresh[layer]):  # w13, w2 (, b13, b2)
                held[idx] = new
            self.layer_experts[layer] = list(expert_ids[layer])
            n += len(slots)
        self.weights_reloaded += n
        return n

    def compute(
        self, layer: int, x: torch.Tensor, local_ids: torch.Tensor, weights: torch.Tensor
    ) -> torch.Tensor:
        """``x [N, H]``, ``local_ids / weights [N, k]`` (-1: not here) -> sums ``[N, H]``."""
        w13, w2, *bias = self.weights[layer]
        if not bias and not self.act:
            return self.backend.experts(x, w13, w2, local_ids, weights)
        b13, b2 = bias or (None, None)
        return self.backend.experts(x, w13, w2, local_ids, weights, b13=b13, b2=b2, **self.act)

    def compute_batch(self, layer: int, batch: ExpertBatch) -> torch.Tensor:
        """`compute` on a received batch."""
        return self.compute(layer, batch.x, batch.expert_ids, batch.weights)

    def measure_cost(self, pairs: int = 64, repeats: int = 15) -> tuple[float, float]:
        """Seconds this rank's expert compute costs per distinct expert it runs and per (token,
        expert) pair, measured on its own first MoE layer: ``pairs`` pairs on one expert, and one
        pair on each of ``min(pairs, experts)`` experts (fastest of ``repeats``: other work on
        the machine only ever adds time). This is the calibration behind the balancer's
        `ExpertCost`."""
        layer = next(iter(self.layer_experts))
        w13 = self.weights[layer][0]
        n_exp = min(pairs, w13.shape[0])
        H = self.cfg.hidden_size
        gen = torch.Generator().manual_seed(0)
        x = torch.randn(pairs, H, generator=gen).to(self.device, self.dtype)
        w = torch.full((pairs, 1), 1.0, device=self.device)
        one = torch.zeros(pairs, 1, dtype=torch.int32, device=self.device)
        spread = (torch.arange(pairs, device=self.device) % n_exp).to(torch.int32)[:, None]

        def timed(ids: torch.Tensor, rows: int) -> float:
            self.compute(layer, x[:rows], ids[:rows], w[:rows])  # warm-up
            times = []
            for _ in range(repeats):
                if self.device.type == "cuda":
                    torch.cuda.synchronize(self.device)
                t = time.perf_counter()
                self.compute(layer, x[:rows], ids[:rows], w[:rows])
                if self.device.type == "cuda":
                    torch.cuda.synchronize(self.device)
                times.append(time.perf_counter() - t)
            return min(times)

        t_one = timed(one, 1)  # 1 expert, 1 pair
        t_many_pairs = timed(one, pairs)  # 1 expert, `pairs` pairs
        t_many_experts = timed(spread, n_exp)  # `n_exp` experts, 1 pair each
        per_pair = max(0.0, (t_many_pairs - t_one) / max(1, pairs - 1))
        per_expert = max(0.0, (t_many_experts - t_one) / max(1, n_exp - 1) - per_pair)
        return per_expert, per_pair

    # Colocated mode: an ExpertExecutor whose local ids are the global ids; nothing to overlap,
    # so `start` computes and `finish` hands the result back.
    def start(
        self, layer: int, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor
    ) -> torch.Tensor:
        return self.compute(layer, x, topk_ids, topk_weights)

    def finish(self, handle: torch.Tensor) -> torch.Tensor:
        return handle
