"""Placement planner and per-step balancer on tensors (no processes)."""

from __future__ import annotations

import pytest
import torch

from splitmoe.config import ParallelConfig
from splitmoe.scheduler.balancer import (
    POLICIES,
    ExpertCost,
    ReplicaTable,
    assign,
    global_quota,
    rank_loads,
)
from splitmoe.scheduler.placement import Placement
from splitmoe.sim.imbalance import route

E, K, RANKS, A = 32, 4, 8, 3


def _zipf(s: float, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    w = 1.0 / torch.arange(1, E + 1, dtype=torch.float64) ** s
    return w[torch.randperm(E, generator=g)] / w.sum()


def _routing(tokens: list[int], s: float = 1.0, seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [route(t, K, _zipf(s), g) for t in tokens]


def test_initial_placement_without_replicas_is_contiguous():
    p = Placement.initial(E, RANKS, 0, (0, 1))
    assert p.slot_expert[0].tolist() == list(range(E))
    assert p.experts_on(1) == {0: [4, 5, 6, 7], 1: [4, 5, 6, 7]}


def test_plan_replicates_hot_experts_on_distinct_ranks():
    load = torch.bincount(torch.cat(_routing([512])).flatten(), minlength=E)
    p = Placement.initial(E, RANKS, 8, (0,)).plan(load[None])
    row = p.slot_expert[0]
    assert sorted(set(row.tolist())) == list(range(E))  # every expert somewhere
    assert row.numel() == E + 8 and p.version == 1
    for e in range(E):  # replicas of one expert on different ranks
        ranks = p.slot_rank[row == e]
        assert ranks.unique().numel() == ranks.numel()
    hottest = int(load.argmax())
    assert int((row == hottest).sum()) > 1
    # the same inputs give the same placement (every rank computes it on its own)
    assert torch.equal(
        Placement.initial(E, RANKS, 8, (0,)).plan(load[None]).slot_expert, p.slot_expert
    )


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("tokens", [[0, 5, 1], [64, 64, 64]])
def test_every_pair_served_once_by_a_slot_holding_its_expert(policy, tokens):
    ids = _routing(tokens)
    load = torch.bincount(torch.cat(ids).flatten(), minlength=E)
    p = Placement.initial(E, RANKS, 12, (0,)).plan(load[None])
    table = ReplicaTable.build(p, 0)
    counts = torch.stack([torch.bincount(i.flatten(), minlength=E) for i in ids])
    for a, x in enumerate(ids):
        slots = assign(policy, table, x, a, ExpertCost(), counts)
        assert slots.shape == x.shape
        assert torch.equal(p.row(0)[slots], x)  # one slot per pair, holding that expert


def test_global_is_identical_on_every_attention_rank_and_fills_quotas():
    ids = _routing([40, 7, 90])
    load = torch.bincount(torch.cat(ids).flatten(), minlength=E)
    p = Placement.initial(E, RANKS, 12, (0,)).plan(load[None])
    table = ReplicaTable.build(p, 0)
    counts = torch.stack([torch.bincount(i.flatten(), minlength=E) for i in ids])
    cost = ExpertCost(activate=16)
    # each rank computes the quotas from the same counts: identical everywhere
    quotas = [global_quota(table, counts.sum(0).clone(), cost) for _ in range(A)]
    assert all(torch.equal(q, quotas[0]) for q in quotas)
    assert torch.equal(quotas[0].sum(1), counts.sum(0))
    # together the ranks' choices fill every replica exactly to its quota
    slots = torch.cat(
        [assign("global", table, x, a, cost, counts).flatten() for a, x in enumerate(ids)]
    )
    per_slot = torch.bincount(slots, minlength=p.num_slots)
    want = torch.zeros(p.num_slots, dtype=torch.int64)
    want.index_add_(
        0,
        table.replica_slots.flatten(),
        quotas[0].flatten()
        * (torch.arange(table.replica_slots.shape[1]) < table.num_replicas[:, None]).flatten(),
    )
    assert torch.equal(per_slot, want)


def test_global_flattens_the_busiest_rank():
    ids = _routing([256] * A, s=1.2, seed=3)
    load = torch.bincount(torch.cat(ids).flatten(), minlength=E)
    p = Placement.initial(E, RANKS, E // 4, (0,)).plan(load[None])
    table = ReplicaTable.build(p, 0)
    counts = torch.stack([torch.bincount(i.flatten(), minlength=E) for i in ids])
    cost = ExpertCost(activate=4)

    def peak(policy):
        slots = torch.cat([assign(policy, table, x, a, cost, counts) for a, x in enumerate(ids)])
        c, _, _ = rank_loads(table, slots, p.slot_rank, cost)
        return c.max().item() / c.float().mean().item()

    assert peak("global") <= 1.10
    assert peak("global") < peak("static")


def test_options_are_validated():
    with pytest.raises(ValueError, match="balancer='round_robin'"):
        ParallelConfig(1, 2, balancer="round_robin")
    with pytest.raises(ValueError, match="expert_ranks=0"):
        ParallelConfig(1, 0, balancer="global")
    with pytest.raises(ValueError, match="redundant_experts=-1"):
        ParallelConfig(1, 2, redundant_experts=-1)
    with pytest.raises(ValueError, match="rebalance_interval=0"):
        ParallelConfig(1, 2, rebalance_interval=0)
    assert ParallelConfig(1, 0, redundant_experts=4).num_redundant == 0  # colocated ignores R
    with pytest.raises(ValueError, match="another rank"):
        Placement.initial(8, 1, 1, (0,))
    with pytest.raises(ValueError, match="at most 8 replicas"):
        Placement.initial(8, 2, 9, (0,))
