"""The per-step replica choice of one attention rank: which replica serves each (token, expert).

`Balancer.choose(layer, topk_ids [T, k]) -> slots [T, k]` runs before every dispatch, once per
(layer, micro-batch), on every attention rank; the policies (``static``, ``local``, ``global``)
and their math are `splitmoe.eplb.policy`'s. Which code computes the choice is the rank's
`BalancerBackend` (`splitmoe.kernels.backends`), bound once at construction beside the
attention and MoE backends: the native C kernel on CPU ranks (one C call per layer, two for
``global``, whose count all-gather sits between them), the Triton kernels on CUDA ranks (one
launch per layer, two for ``global``; no host synchronisation, graph-capturable), or the
PyTorch reference itself. All three make the same choices bit for bit.

Nothing is decided per call: the constructor binds ``choose`` to the one method for its policy
and backend, and each layer's kernel tables are built when the placement changes
(`set_placement`). Speed budget and measurements: docs/balancer.md, `scripts/bench_balancer.py`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from splitmoe.eplb.load import LoadStats
from splitmoe.eplb.placement import Placement
from splitmoe.eplb.policy import POLICIES, ExpertCost, ReplicaTable, assign, expert_counts
from splitmoe.kernels.backends import balancer_backend

if TYPE_CHECKING:
    from splitmoe.comm.distributed import Collective


class Balancer:
    """Per-step replica choice of one attention rank (see the module doc).

    ``group``: the attention ranks only (the ``global`` policy's count all-gather; None with one
    attention rank). ``kernel``: the backend, one of
    `splitmoe.kernels.backends.BALANCER_KERNELS` (``"auto"``: the fastest the device has).
    `choose` is called in (layer, micro-batch) order on every attention rank.
    """

    choose: Callable[[int, torch.Tensor], torch.Tensor]
    """``(layer, topk_ids [T, k]) -> slots [T, k]`` int64 (a collective for ``global``): the
    method of this balancer's policy and backend, bound in ``__init__``."""

    def __init__(
        self,
        policy: str,
        placement: Placement,
        attention_rank: int,
        num_attention: int,
        cost: ExpertCost,
        device: torch.device,
        group: Collective | None = None,
        comm_device: torch.device | None = None,
        kernel: str = "auto",
    ):
        if policy not in POLICIES:
            raise ValueError(f"balancer={policy!r} must be one of {POLICIES}")
        self.policy = policy
        self.attention_rank = attention_rank
        self.num_attention = num_attention
        self.cost = cost
        self.device = torch.device(device)
        self.group = group
        self.comm_device = comm_device or torch.device("cpu")
        self.backend = balancer_backend(kernel, self.device)
        self.kernel = self.backend.name
        self.load = LoadStats(placement.layers, placement.num_experts, self.device)
        E = placement.num_experts
        # this rank's pairs per expert and the count all-gather's buffer, reused every call
        # (each consumed before the next call)
        self._counts = torch.zeros(E, dtype=torch.int64, device=self.device)
        self._gathered = torch.zeros(num_attention * E, dtype=torch.int64, device=self.comm_device)
        self._gathered_rows = self._gathered.view(num_attention, E)  # [A, E]
        self._same_device = self.comm_device == self.device
        self.tables: dict[int, ReplicaTable] = {}
        self._static: dict[int, torch.Tensor | None] = {}  # reference ``static``'s lookups
        self._layers: dict[int, object] = {}  # the backend's per-layer kernels
        self.set_placement(placement)
        family = "torch" if self.backend.layer is None else "kernel"
        self.choose = getattr(self, f"_{policy}_{family}")

    def set_placement(self, placement: Placement, layers: tuple[int, ...] | None = None) -> None:
        """Switches to a new placement (between steps, on every rank at the same step);
        ``layers``: only these layers' rows changed (a rebalance switches layer by layer)."""
        self.placement = placement
        if layers is None:
            layers = placement.layers
        # this rank's slot of each expert under ``static`` ([E] int64), fixed per placement
        experts = torch.arange(placement.num_experts, device=self.device)
        for layer in layers:
            table = self.tables[layer] = ReplicaTable.build(placement, layer, self.device)
            mine = assign("static", table, experts[:, None], self.attention_rank, self.cost, None)
            mine = mine[:, 0]
            # None where that slot is the expert id itself (one replica each, in expert order)
            self._static[layer] = None if torch.equal(mine, experts) else mine
            if self.backend.layer is not None:
                self._layers[layer] = self.backend.layer(
                    table, mine, placement.row(layer), placement.slot_rank, self.load.row(layer)
                )

    def gather_counts(self, counts: torch.Tensor) -> torch.Tensor:
        """``counts [E]`` of this rank -> ``[A, E]`` of every attention rank (rank order)."""
        if self.group is None:
            return counts[None, :]
        self.group.all_gather_single(self._gathered, counts.to(self.comm_device))
        return self._gathered_rows if self._same_device else self._gathered_rows.to(self.device)

    # -- the PyTorch reference (`splitmoe.eplb.policy`) ---------------------------------------

    def _static_torch(self, layer: int, topk_ids: torch.Tensor) -> torch.Tensor:
        # a fixed lookup (the same as `assign`'s); the counts only kept
        self.load.count(layer, topk_ids)
        mine = self._static[layer]
        return topk_ids.long() if mine is None else mine.take(topk_ids.long())

    def _local_torch(self, layer: int, topk_ids: torch.Tensor) -> torch.Tensor:
        counts = expert_counts(topk_ids, self.placement.num_experts)  # [E]
        self.load.add(layer, counts)
        table = self.tables[layer]
        return assign("local", table, topk_ids, self.attention_rank, self.cost, counts)

    def _global_torch(self, layer: int, topk_ids: torch.Tensor) -> torch.Tensor:
        counts = expert_counts(topk_ids, self.placement.num_experts)  # [E]
        self.load.add(layer, counts)
        all_counts = self.gather_counts(counts)  # [A, E]
        table = self.tables[layer]
        return assign("global", table, topk_ids, self.attention_rank, self.cost, counts, all_counts)

    # -- the backend's kernels (`balance_cpu.Layer`, `balance_triton.Layer`) -------------------

    def _static_kernel(self, layer: int, topk_ids: torch.Tensor) -> torch.Tensor:
        return self._layers[layer].static(topk_ids)

    def _local_kernel(self, layer: int, topk_ids: torch.Tensor) -> torch.Tensor:
        return self._layers[layer].local(topk_ids, self.attention_rank, self._counts)

    def _global_kernel(self, layer: int, topk_ids: torch.Tensor) -> torch.Tensor:
        kernel = self._layers[layer]
        kernel.count(topk_ids, self._counts)
        gathered = self.gather_counts(self._counts)  # [A, E]
        return kernel.global_(
            topk_ids, self.attention_rank, gathered, self._counts, self.cost.activate
        )
