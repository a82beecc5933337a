"""The microsecond balancer: per (layer, micro-batch), which replica serves each (token, expert).

Given a token's top-k experts ``topk_ids [T, k]`` and the layer's `ReplicaTable` (from the
`Placement`), every policy returns ``slots [T, k]`` (global slot ids, each holding the pair's
expert), which the transport routes by slot. Vectorised tensor code, no loop over tokens or
experts; integer arithmetic only, so every attention rank reaches bit-identical decisions.

* ``static``: attention rank ``a`` always uses replica ``a mod replicas(e)`` of expert ``e`` (the
  baseline: load spreads only across attention ranks).
* ``local``: each attention rank deals its own pairs of ``e`` round-robin over the replicas
  (starting at replica ``a``), no coordination.
* ``global``: the attention ranks all-gather per-expert pair counts ``[A, E]`` (one small
  collective per layer and micro-batch) and all run `global_quota`: per expert, how many of its
  pairs each replica takes, minimising the busiest expert rank's cost
  ``activate x distinct experts it runs + token x pairs it computes`` (`ExpertCost`). Attention
  rank ``a``'s pairs of ``e`` are the consecutive range ``prefix[a, e] ..`` of the global order,
  cut by the quotas, so together the ranks fill every replica exactly to its quota.

`global_quota` is a water-filling, vectorised over experts: each expert spreads its pairs over its
replicas' ranks so that they end level (counting the activation cost of every replica it uses),
against the cost the other experts put on those ranks (estimated as even splits; ``passes > 1``
refines the estimate with the previous pass's result).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from splitmoe.scheduler.placement import Placement

POLICIES = ("static", "local", "global")
_BIG = 1 << 50


@dataclass(frozen=True)
class ExpertCost:
    """Cost of an expert rank for one layer, in integer units: ``activate`` per distinct expert
    it runs (reading its weights) + ``token`` per (token, expert) pair it computes.

    `from_hardware` derives the ratio from a roofline: an expert's weights read at memory
    bandwidth versus one token's FLOPs (H100, Qwen3-235B expert: ~35 us vs ~0.05 us).
    """

    activate: int = 64
    token: int = 1

    @classmethod
    def from_hardware(
        cls, hidden: int, inter: int, weight_bytes: int, mem_bytes_per_s: float, flops: float
    ) -> ExpertCost:
        read_s = 3 * hidden * inter * weight_bytes / mem_bytes_per_s
        token_s = 6 * hidden * inter / flops
        return cls(activate=max(1, round(read_s / token_s)), token=1)


@dataclass(frozen=True)
class ReplicaTable:
    """One layer's replicas: ``replica_slots [E, M]`` int64 (slot of replica ``j`` of expert
    ``e``; padded with the first replica), ``num_replicas [E]``, ``replica_rank [E, M]`` (expert
    rank of each replica) and ``num_ranks``."""

    replica_slots: torch.Tensor
    num_replicas: torch.Tensor
    replica_rank: torch.Tensor
    num_ranks: int

    @classmethod
    def build(cls, placement: Placement, layer: int, device: torch.device | str = "cpu"):
        row = placement.row(layer)  # [S]
        E = placement.num_experts
        order = torch.argsort(row, stable=True)  # slots grouped by expert, ascending slot id
        num = torch.bincount(row, minlength=E)  # [E]
        M = int(num.max())
        start = torch.cumsum(num, 0) - num
        j = torch.arange(M)
        idx = start[:, None] + torch.minimum(j[None, :], num[:, None] - 1)  # [E, M]
        slots = order[idx]
        return cls(
            replica_slots=slots.to(device),
            num_replicas=num.to(device),
            replica_rank=placement.slot_rank[slots].to(device),
            num_ranks=placement.num_ranks,
        )


def global_quota(
    table: ReplicaTable, totals: torch.Tensor, cost: ExpertCost, passes: int = 1
) -> torch.Tensor:
    """``totals [E]`` int64 pairs per expert (all attention ranks) -> ``quota [E, M]`` int64
    pairs per replica (zero on padding), summing to ``totals`` (see the module doc)."""
    a, b = cost.activate, cost.token
    E, M = table.replica_slots.shape
    dev = totals.device
    j = torch.arange(M, device=dev)
    real = j[None, :] < table.num_replicas[:, None]  # [E, M]
    rank = table.replica_rank.flatten()
    # first estimate: even split
    share = torch.where(real, totals[:, None] // table.num_replicas[:, None], 0)
    m_count = torch.arange(1, M + 1, device=dev)[None, :]
    for _ in range(passes):
        own = torch.where(share > 0, a + b * share, 0)  # [E, M] cost each replica adds
        rank_cost = torch.zeros(table.num_ranks, dtype=torch.int64, device=dev)
        rank_cost.index_add_(0, rank, own.flatten())
        c = rank_cost[table.replica_rank] - own  # [E, M] the rank's cost from everyone else
        c = torch.where(real, c + a, _BIG)
        c_sorted, order = torch.sort(c, dim=1, stable=True)
        level = (torch.cumsum(c_sorted, 1) + b * totals[:, None]) // m_count  # [E, M]
        ok = (level >= c_sorted) & (m_count <= torch.clamp(totals, min=1)[:, None]) & real
        m = torch.argmin(torch.where(ok, level, _BIG), dim=1) + 1  # [E] replicas used
        lvl = level.gather(1, (m - 1)[:, None])  # [E, 1]
        used = m_count <= m[:, None]
        x = torch.where(used, torch.clamp(lvl - c_sorted, min=0) // b, 0)  # [E, M] sorted order
        rem = totals - x.sum(1)  # >= 0: floors only lose pairs
        x = x + torch.where(used, rem[:, None] // m[:, None] + (j[None, :] < (rem % m)[:, None]), 0)
        share = torch.empty_like(x).scatter_(1, order, x)
    return share


@dataclass
class LoadStats:
    """Pairs routed to each expert of each MoE layer, as seen by this attention rank:
    ``window [L, E]`` since the last rebalance and ``total [L, E]`` since start (int64)."""

    layers: tuple[int, ...]
    num_experts: int
    window: torch.Tensor = field(init=False)
    total: torch.Tensor = field(init=False)

    def __post_init__(self) -> None:
        self.window = torch.zeros(len(self.layers), self.num_experts, dtype=torch.int64)
        self.total = torch.zeros_like(self.window)
        self._row = {layer: i for i, layer in enumerate(self.layers)}

    def add(self, layer: int, counts: torch.Tensor) -> None:
        c = counts.cpu()
        i = self._row[layer]
        self.window[i] += c
        self.total[i] += c

    def snapshot(self) -> dict:
        return {
            "layers": list(self.layers),
            "window": self.window.tolist(),
            "total": self.total.tolist(),
        }


class Balancer:
    """Per-step replica choice of one attention rank (see the module doc).

    ``group``: the attention ranks only (the ``global`` policy's count all-gather; None with one
    attention rank). `choose` is called in (layer, micro-batch) order on every attention rank.
    """

    def __init__(
        self,
        policy: str,
        placement: Placement,
        attention_rank: int,
        num_attention: int,
        cost: ExpertCost,
        device: torch.device,
        group: dist.ProcessGroup | None = None,
        comm_device: torch.device | None = None,
    ):
        if policy not in POLICIES:
            raise ValueError(f"balancer={policy!r} must be one of {POLICIES}")
        self.policy = policy
        self.attention_rank = attention_rank
        self.num_attention = num_attention
        self.cost = cost
        self.device = device
        self.group = group
        self.comm_device = comm_device or torch.device("cpu")
        self.load = LoadStats(placement.layers, placement.num_experts)
        self.set_placement(placement)

    def set_placement(self, placement: Placement) -> None:
        """Switches to a new placement (between steps, on every rank at the same step)."""
        self.placement = placement
        self.tables = {
            layer: ReplicaTable.build(placement, layer, self.device) for layer in placement.layers
        }

    def gather_counts(self, counts: torch.Tensor) -> torch.Tensor:
        """``counts [E]`` of this rank -> ``[A, E]`` of every attention rank (rank order)."""
        if self.group is None:
            return counts[None, :]
        send = counts.to(self.comm_device)
        out = torch.empty(
            self.num_attention * send.numel(), dtype=send.dtype, device=self.comm_device
        )
        dist.all_gather_single(out, send, group=self.group)
        return out.view(self.num_attention, -1).to(self.device)

    def choose(self, layer: int, topk_ids: torch.Tensor) -> torch.Tensor:
        """``topk_ids [T, k]`` -> ``slots [T, k]`` int64 (collective for ``global``)."""
        ids = topk_ids.reshape(-1).long()  # [P]
        E = self.placement.num_experts
        counts = torch.bincount(ids, minlength=E)  # [E]
        self.load.add(layer, counts)
        table = self.tables[layer]
        all_counts = self.gather_counts(counts) if self.policy == "global" else None
        return assign(self.policy, table, topk_ids, self.attention_rank, self.cost, all_counts)


def assign(
    policy: str,
    table: ReplicaTable,
    topk_ids: torch.Tensor,
    attention_rank: int,
    cost: ExpertCost,
    all_counts: torch.Tensor | None = None,
) -> torch.Tensor:
    """The slot of every pair of ``topk_ids [T, k]`` on attention rank ``attention_rank`` under
    ``policy``; ``all_counts [A, E]`` (``global`` only): pairs per expert of every attention
    rank. Returns ``[T, k]`` int64.

    ``static`` gathers one replica per expert. The others decide how many of this rank's pairs
    of each expert each replica takes (``take [E, M]``), then deal them in expert-sorted order
    with one ``repeat_interleave``: which of an expert's pairs go where does not matter, only
    how many."""
    ids = topk_ids.reshape(-1).long()  # [P]
    nrep = table.num_replicas  # [E]
    if policy == "static":
        j = attention_rank % nrep[ids]
        return table.replica_slots[ids, j].view(topk_ids.shape)
    M = table.replica_slots.shape[1]
    jj = torch.arange(M, device=ids.device)[None, :]  # [1, M]
    if policy == "local":
        mine = torch.bincount(ids, minlength=nrep.numel())[:, None]  # [E, 1]
        turn = (jj - attention_rank) % nrep[:, None]  # dealing order, starting at replica a
        take = (mine // nrep[:, None] + (turn < mine % nrep[:, None])) * (jj < nrep[:, None])
    else:
        mine = all_counts[attention_rank][:, None]  # [E, 1]
        quota = global_quota(table, all_counts.sum(0), cost)  # [E, M]
        prefix = all_counts[:attention_rank].sum(0)[:, None]  # [E, 1] pairs of lower ranks
        bound = torch.clamp(torch.cumsum(quota, 1) - prefix, min=0)  # [E, M]
        bound = torch.minimum(bound, mine)
        take = torch.diff(bound, dim=1, prepend=torch.zeros_like(mine))
    sorted_ids, order = torch.sort(ids)
    slots = torch.repeat_interleave(
        table.replica_slots.flatten(), take.flatten(), output_size=ids.numel()
    )
    out = torch.empty_like(ids)
    out[order] = slots
    return out.view(topk_ids.shape)


def rank_loads(
    table: ReplicaTable, slots: torch.Tensor, slot_rank: torch.Tensor, cost: ExpertCost
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """For ``slots`` (every attention rank's, concatenated): per expert rank, ``(cost, pairs,
    distinct slots)`` (int64 ``[R]`` each)."""
    flat = slots.reshape(-1)
    R = table.num_ranks
    S = slot_rank.numel()
    per_slot = torch.bincount(flat, minlength=S)  # [S]
    pairs = torch.zeros(R, dtype=torch.int64).index_add_(0, slot_rank, per_slot)
    active = torch.zeros(R, dtype=torch.int64).index_add_(0, slot_rank, (per_slot > 0).long())
    return cost.activate * active + cost.token * pairs, pairs, active
