"""Load statistics: how many (token, expert) pairs each MoE layer routed to each expert.

The balancer counts every step's routing here (on its device, no host copy per step); a
rebalance plans the next `Placement` from the window since the last one (`ExpertBalance`), and
``llm.expert_load()`` / ``llm.stats()`` report both the window and the running total.
"""

from __future__ import annotations

import numpy as np
import torch

from splitmoe.eplb.policy import expert_counts


class LoadStats:
    """Pairs routed to each expert of each MoE layer, as seen by this attention rank:
    ``window [L, E]`` since the last rebalance and ``total [L, E]`` since start (int64, CPU).

    `add` accumulates on the balancer's device (no host copy per step); reading ``window`` or
    ``total`` folds those counts in (and ``window.zero_()`` restarts the window)."""

    def __init__(self, layers: tuple[int, ...], num_experts: int, device: torch.device | str):
        self.layers = tuple(layers)
        self.num_experts = num_experts
        self._pending = torch.zeros(len(layers), num_experts, dtype=torch.int64, device=device)
        self._rows = {layer: self._pending[i] for i, layer in enumerate(self.layers)}
        # on the CPU, `count` adds numpy's bincount into these views of the same memory
        cpu = self._pending.device.type == "cpu"
        self._rows_np = {k: v.numpy() for k, v in self._rows.items()} if cpu else None
        if cpu:
            self.count = self._count_numpy
        self._window = torch.zeros(len(layers), num_experts, dtype=torch.int64)
        self._total = torch.zeros_like(self._window)

    def row(self, layer: int) -> torch.Tensor:
        """``layer``'s pending counts ``[E]`` int64 on the balancer's device (kernels add in)."""
        return self._rows[layer]

    def add(self, layer: int, counts: torch.Tensor) -> None:
        self._rows[layer].add_(counts)

    def count(self, layer: int, topk_ids: torch.Tensor) -> None:
        """Adds the pairs of ``topk_ids [T, k]`` (expert ids) to ``layer``'s counts. On the CPU
        one numpy ``bincount`` (a third of `expert_counts` and ``add_``'s eager calls: the
        static reference pays only this per layer and micro-batch); bound per device in
        ``__init__``."""
        self.add(layer, expert_counts(topk_ids, self.num_experts))

    def _count_numpy(self, layer: int, topk_ids: torch.Tensor) -> None:
        flat = topk_ids.numpy().reshape(-1)
        self._rows_np[layer] += np.bincount(flat, minlength=self.num_experts)

    def _fold(self) -> None:
        pending = self._pending.cpu()
        self._window += pending
        self._total += pending
        self._pending.zero_()

    @property
    def window(self) -> torch.Tensor:
        self._fold()
        return self._window

    @property
    def total(self) -> torch.Tensor:
        self._fold()
        return self._total

    def snapshot(self) -> dict:
        return {
            "layers": list(self.layers),
            "window": self.window.tolist(),
            "total": self.total.tolist(),
        }
