"""The replica-choice policy in PyTorch: the one written statement of the balancer's math.

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
  ``activate x distinct experts it runs + pairs it computes`` (`ExpertCost`). Attention rank
  ``a``'s pairs of ``e`` are the consecutive range ``prefix[a, e] ..`` of the global order, cut
  by the quotas, so together the ranks fill every replica exactly to its quota.

`global_quota` is a water-filling, vectorised over experts: each expert spreads its pairs over its
replicas' ranks so that they end level (counting the activation cost of every replica it uses),
against the cost the other experts put on those ranks (estimated as even splits).

The per-step code is a short fixed sequence of tensor calls (an eager torch call costs a
microsecond or two on a CPU however small its tensors): everything that depends only on the
placement is in `ReplicaTable`; only the experts with more than one replica (``E2 <= R``) are
water-filled and cut; `deal` hands out the pairs with one sort. No host synchronisation, so the
same code runs on a GPU. The native C kernel (`splitmoe.kernels.balance_cpu`) and the Triton
kernels (`splitmoe.kernels.balance_triton`) compute exactly this, bit for bit
(tests/eplb/test_balancer_kernels.py, tests/eplb/test_balancer_triton.py); `Balancer` runs
whichever its backend binds.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from splitmoe.config import BALANCER_POLICIES
from splitmoe.eplb.placement import Placement
from splitmoe.kernels.expert_sort import count_keys

POLICIES = BALANCER_POLICIES
_BIG = 1 << 50  # cost of a padding replica: never worth using


@dataclass(frozen=True)
class ExpertCost:
    """Cost of an expert rank for one layer, in units of one (token, expert) pair's compute:
    ``activate`` per distinct expert it runs (reading its weights) + 1 per pair it computes.

    `from_hardware` derives ``activate`` from a roofline: an expert's weights read at memory
    bandwidth versus one token's FLOPs (H100, Qwen3-235B expert: ~35 us vs ~0.05 us).
    """

    activate: int = 64

    @classmethod
    def from_hardware(
        cls, hidden: int, inter: int, weight_bytes: int, mem_bytes_per_s: float, flops: float
    ) -> ExpertCost:
        read_s = 3 * hidden * inter * weight_bytes / mem_bytes_per_s
        token_s = 6 * hidden * inter / flops
        return cls(activate=max(1, round(read_s / token_s)))


@dataclass(frozen=True)
class ReplicaTable:
    """One layer's replicas, with everything the per-step choice needs that does not depend on
    the step's routing (`Balancer.set_placement` builds one per layer; int64 on the device).

    * ``replica_slots [E, M]``: slot of replica ``j`` of expert ``e`` (padded with the first
      replica); ``num_replicas [E]``; ``replica_rank [E, M]``: expert rank of each replica;
      ``num_ranks``.
    * ``multi [E2, 1]``: the experts with more than one replica, the only ones with a choice
      (``E2 <= R``: 14 of 256 experts for the bench's Zipf 1.0 placement with R = 32);
      ``multi_at [E2, M]``: their rows' flat indices into ``[E, M]``; ``multi_replicas [E2, 1]``;
      ``multi_pad [E2, M]``: 0 on a replica, `_BIG` on padding.
    * ``others_at [K]``, ``others_expert [K]``: for every replica of a multi expert (flat index
      into ``[E2, M]``), each other slot on its expert rank and the expert that slot holds:
      `global_quota` sums the other experts' cost on a replica's rank with one ``put``.
    * ``col [1, M]``: replica index ``j``; ``count [1, M]``: ``j + 1``; ``first [M]``: 1 at
      ``j = 0``.
    """

    replica_slots: torch.Tensor
    num_replicas: torch.Tensor
    replica_rank: torch.Tensor
    num_ranks: int
    multi: torch.Tensor
    multi_at: torch.Tensor
    multi_replicas: torch.Tensor
    multi_pad: torch.Tensor
    others_at: torch.Tensor
    others_expert: torch.Tensor
    col: torch.Tensor
    count: torch.Tensor
    first: torch.Tensor

    @classmethod
    def build(
        cls, placement: Placement, layer: int, device: torch.device | str = "cpu"
    ) -> ReplicaTable:
        row = placement.row(layer)  # [S] expert of each slot
        E, S = placement.num_experts, row.numel()
        order = torch.argsort(row, stable=True)  # slots grouped by expert, ascending slot id
        num = torch.bincount(row, minlength=E)  # [E]
        M = int(num.max())
        start = torch.cumsum(num, 0) - num
        j = torch.arange(M)
        slots = order[start[:, None] + torch.minimum(j[None, :], num[:, None] - 1)]  # [E, M]
        rank = placement.slot_rank[slots]  # [E, M]
        multi = torch.nonzero(num > 1)  # [E2, 1]
        real = j[None, :] < num[multi]  # [E2, M]
        # (replica of a multi expert, another slot on its rank) pairs: rank of the replica's
        # slot == rank of the other slot, other != itself; padding replicas have none
        own = slots[multi[:, 0]].flatten()  # [E2 * M]
        same = placement.slot_rank[None, :] == placement.slot_rank[own][:, None]  # [E2 * M, S]
        same &= torch.arange(S)[None, :] != own[:, None]
        same &= real.flatten()[:, None]
        at, other = same.nonzero(as_tuple=True)
        tensors = {
            "replica_slots": slots,
            "num_replicas": num,
            "replica_rank": rank,
            "multi": multi,
            "multi_at": multi * M + j[None, :],
            "multi_replicas": num[multi],
            "multi_pad": torch.where(real, 0, _BIG),
            "others_at": at,
            "others_expert": row[other],
            "col": j[None, :],
            "count": j[None, :] + 1,
            "first": (j == 0).long(),
        }
        return cls(num_ranks=placement.num_ranks, **{k: v.to(device) for k, v in tensors.items()})


def global_quota(table: ReplicaTable, totals: torch.Tensor, cost: ExpertCost) -> torch.Tensor:
    """``totals [E]`` int64 pairs per expert (all attention ranks) -> ``quota [E2, M]`` int64
    pairs per replica of each multi-replica expert ``table.multi`` (zero on padding), rows
    summing to ``totals[table.multi]`` (single-replica experts take all their pairs)."""
    ends, order = _water_fill(table, totals, cost)
    ends = ends.clamp_(max=totals.take(table.multi))
    quota = torch.diff(ends, dim=1, prepend=torch.zeros_like(ends[:, :1]))
    return quota.scatter(1, order, quota)


def _water_fill(
    table: ReplicaTable, totals: torch.Tensor, cost: ExpertCost
) -> tuple[torch.Tensor, torch.Tensor]:
    """`global_quota` as ``(ends [E2, M], order [E2, M])``: multi expert ``e``'s replica
    ``order[e, i]`` takes the pairs ``ends[e, i - 1] .. ends[e, i]`` of its global order
    (``ends[e, -1] = 0``; after its last used replica ``ends >= totals[e]``: clamp).

    Per expert, its replicas sorted by ``c`` (their rank's cost from the other experts, which
    under even splits add ``activate + share`` per replica they use): using the cheapest ``m``
    levels them at ``L(m) = (c_0 + .. + c_(m-1) + pairs) // m``. ``L`` falls while the next
    replica is below it and rises after, so its first minimum gives ``m``; replica ``i < m``
    takes ``L - c_i`` pairs, +1 if ``i < rem = (c_0 + .. + c_(m-1) + pairs) % m``: the pairs
    left after replica ``i`` are ``c_0 + .. + c_i + pairs - (i + 1) L - min(i + 1, rem)``.
    (The expert's own activation is the same on each of its replicas and only shifts ``L``:
    left out.)"""
    share = totals // table.num_replicas  # [E] even split
    own = torch.add(share, share.clamp(max=1), alpha=cost.activate)  # [E] cost per replica
    c = table.multi_pad.put(table.others_at, own.take(table.others_expert), accumulate=True)
    c, order = torch.sort(c, dim=1, stable=True)  # [E2, M] cheapest replica first
    n = totals.take(table.multi)  # [E2, 1]
    t = c.cumsum(1).add_(n)  # [E2, M] c_0 + .. + c_j + pairs
    level = t // table.count  # L(j + 1)
    lvl, used = level.min(1, keepdim=True)  # [E2, 1] L and m - 1
    rem = (t % table.count).gather(1, used)
    # [E2, M] pairs left after replica j: 0 at the last used one, running minimum <= 0 after
    left = torch.addcmul(t, table.count, lvl, value=-1).sub_(torch.minimum(table.count, rem))
    return n - left.cummin(1).values, order


def expert_counts(topk_ids: torch.Tensor, num_experts: int) -> torch.Tensor:
    """``topk_ids [T, k]`` -> pairs per expert ``[E]`` int64, with no host synchronisation on a
    GPU (`count_keys`)."""
    return count_keys(topk_ids.long(), num_experts)


def assign(
    policy: str,
    table: ReplicaTable,
    topk_ids: torch.Tensor,
    attention_rank: int,
    cost: ExpertCost,
    counts: torch.Tensor,
    all_counts: torch.Tensor | None = None,
) -> torch.Tensor:
    """The slot of every pair of ``topk_ids [T, k]`` (a token's experts distinct) on attention
    rank ``attention_rank`` under ``policy``; ``counts [E]``: this rank's pairs per expert
    (`expert_counts`); ``all_counts [A, E]`` (``global`` only): every attention rank's, in rank
    order. Returns ``[T, k]`` int64.

    ``static`` gathers one replica per expert. The others decide how many of this rank's pairs
    of each expert each replica takes (``take [E, M]``: single-replica experts all on replica 0,
    only the multi experts' rows computed) and `deal` hands them out: which of an expert's pairs
    go where does not matter, only how many."""
    a = attention_rank
    if policy == "static":
        mine = table.replica_slots.gather(1, (a % table.num_replicas)[:, None])  # [E, 1]
        return mine.take(topk_ids.long())
    mine = counts.take(table.multi)  # [E2, 1] this rank's pairs of the multi experts
    if policy == "local":
        # pair o (0-based, in expert-sorted order) goes to replica (a + o) mod n: replica j
        # takes the o < mine with o = j - a (mod n), (mine + (a - 1 - j) mod n) // n of them
        n = table.multi_replicas
        take_m = (((a - 1) - table.col) % n).add_(mine).div_(n, rounding_mode="floor")
        take_m.masked_fill_(table.multi_pad > 0, 0)  # [E2, M]
    else:
        upto = all_counts.cumsum(0)  # [A, E] pairs of ranks <= a
        ends, order = _water_fill(table, upto[-1], cost)  # [E2, M], sorted replicas
        hi = upto[a].take(table.multi)  # [E2, 1] this rank's range [lo, hi) of the global order
        lo = hi - mine
        take_m = torch.diff(ends.clamp_(lo, hi), dim=1, prepend=lo)
        take_m = take_m.scatter(1, order, take_m)
    take = torch.outer(counts, table.first).put_(table.multi_at, take_m)  # [E, M]
    return deal(topk_ids, table.replica_slots, take)


def deal(topk_ids: torch.Tensor, replica_slots: torch.Tensor, take: torch.Tensor) -> torch.Tensor:
    """``topk_ids [T, k]`` int64, ``replica_slots [E, M]``, ``take [E, M]`` (pairs of expert
    ``e`` for replica ``j``; row ``e`` sums to the pairs of ``e`` in ``topk_ids``) ->
    ``slots [T, k]`` int64: the pairs of ``e``, in row-major order, go ``take[e, 0]`` to
    ``replica_slots[e, 0]``, the next ``take[e, 1]`` to ``replica_slots[e, 1]``, ...

    One stable sort of the pairs by expert, one ``repeat_interleave``, one scatter. On CPU in
    numpy (zero-copy views): its stable argsort of 16-bit keys is a radix sort, faster than
    ``torch.sort`` at a step's pair counts, and each numpy call's fixed cost is a fraction of
    torch's; `deal_reference` (the same in torch) runs on other devices."""
    if topk_ids.device.type != "cpu" or replica_slots.shape[0] > 1 << 16:
        return deal_reference(topk_ids, replica_slots, take)
    ids = topk_ids.numpy().reshape(-1)
    order = np.argsort(ids.astype(np.uint16), kind="stable")
    out = np.empty(ids.shape, dtype=np.int64)
    out[order] = np.repeat(replica_slots.numpy().reshape(-1), take.numpy().reshape(-1))
    return torch.from_numpy(out.reshape(topk_ids.shape))


def deal_reference(
    topk_ids: torch.Tensor, replica_slots: torch.Tensor, take: torch.Tensor
) -> torch.Tensor:
    """`deal` in torch (any device)."""
    ids = topk_ids.reshape(-1)
    _, order = torch.sort(ids, stable=True)  # [P] pairs grouped by expert
    slots = torch.repeat_interleave(replica_slots.view(-1), take.view(-1), output_size=ids.numel())
    return slots.scatter(0, order, slots).view(topk_ids.shape)


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
    return cost.activate * active + pairs, pairs, active
