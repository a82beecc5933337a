"""Placement planner and per-step balancer on tensors (no processes)."""

from __future__ import annotations

import pytest
import torch

from splitmoe.config import ParallelConfig
from splitmoe.eplb.balancer import Balancer
from splitmoe.eplb.placement import Placement
from splitmoe.eplb.policy import (
    POLICIES,
    ExpertCost,
    ReplicaTable,
    assign,
    deal,
    deal_reference,
    expert_counts,
    global_quota,
    rank_loads,
)
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
        slots = assign(policy, table, x, a, ExpertCost(), counts[a], counts)
        assert slots.shape == x.shape and slots.dtype == torch.int64
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
    multi = table.multi[:, 0]
    assert torch.equal(quotas[0].sum(1), counts.sum(0)[multi])
    assert int((quotas[0] * (table.multi_pad > 0)).abs().sum()) == 0  # nothing on padding
    # together the ranks' choices fill every replica exactly to its quota (single-replica
    # experts: all their pairs on their one slot)
    slots = torch.cat(
        [
            assign("global", table, x, a, cost, counts[a], counts).flatten()
            for a, x in enumerate(ids)
        ]
    )
    want = torch.zeros(table.replica_slots.shape, dtype=torch.int64)
    want[:, 0] = counts.sum(0)
    want[multi] = quotas[0]
    per_slot = torch.zeros(p.num_slots, dtype=torch.int64)
    per_slot.index_add_(0, table.replica_slots.flatten(), want.flatten())
    assert torch.equal(torch.bincount(slots, minlength=p.num_slots), per_slot)


def _quota_reference(p: Placement, totals: list[int], activate: int) -> dict[int, list[int]]:
    """The water-filling of the module doc, one expert at a time in plain Python: per expert
    with replicas, pairs per replica (in slot order)."""
    row, rank = p.row(0).tolist(), p.slot_rank.tolist()
    replicas = {e: [s for s in range(len(row)) if row[s] == e] for e in set(row)}
    own = {
        e: totals[e] // len(r) + activate * (totals[e] // len(r) > 0) for e, r in replicas.items()
    }
    out = {}
    for e, slots in replicas.items():
        if len(slots) == 1:
            continue
        c = [  # the rank's cost from the other slots on it (+ this expert's activation)
            sum(own[row[o]] for o in range(len(row)) if rank[o] == rank[s] and o != s) + activate
            for s in slots
        ]
        order = sorted(range(len(slots)), key=lambda j: (c[j], j))
        cs = [c[j] for j in order]
        n = totals[e]
        levels = [(sum(cs[:m]) + n) // m for m in range(1, len(cs) + 1)]
        m = levels.index(min(levels)) + 1
        rem = (sum(cs[:m]) + n) % m
        x = [0] * len(slots)
        for i in range(m):
            x[order[i]] = levels[m - 1] - cs[i] + (i < rem)
        out[e] = x
    return out


@pytest.mark.parametrize("seed", range(12))
def test_global_quota_matches_a_plain_water_filling(seed):
    g = torch.Generator().manual_seed(seed)
    ranks = int(torch.randint(2, 9, (1,), generator=g))
    redundant = int(torch.randint(1, 3 * E // 2, (1,), generator=g))
    load = torch.randint(0, 60, (E,), generator=g) ** 2
    p = Placement.initial(E, ranks, redundant, (0,)).plan(load[None])
    table = ReplicaTable.build(p, 0)
    scale = [0, 2, 5, 40, 1000][seed % 5]  # idle, fewer pairs than replicas, ..., busy
    totals = torch.randint(0, scale + 1, (E,), generator=g)
    activate = int(torch.randint(0, 100, (1,), generator=g))
    quota = global_quota(table, totals, ExpertCost(activate))
    want = _quota_reference(p, totals.tolist(), activate)
    assert sorted(want) == table.multi[:, 0].tolist()
    for i, e in enumerate(table.multi[:, 0].tolist()):
        n = len(want[e])
        assert quota[i, :n].tolist() == want[e]
        assert int(quota[i, n:].abs().sum()) == 0


def test_local_deals_round_robin_from_the_rank():
    ids = _routing([64, 64, 64])
    load = torch.bincount(torch.cat(ids).flatten(), minlength=E)
    p = Placement.initial(E, RANKS, 12, (0,)).plan(load[None])
    table = ReplicaTable.build(p, 0)
    row = p.row(0)
    for a, x in enumerate(ids):
        counts = expert_counts(x, E)
        slots = assign("local", table, x, a, ExpertCost(), counts)
        for e in range(E):
            n = int(table.num_replicas[e])
            want = [0] * n
            for o in range(int(counts[e])):
                want[(a + o) % n] += 1
            got = [int((slots == table.replica_slots[e, j]).sum()) for j in range(n)]
            assert got == want and bool((row[table.replica_slots[e, :n]] == e).all())


@pytest.mark.parametrize(
    "tokens,k,experts,replicas",
    [(0, 4, 8, 2), (1, 1, 3, 1), (37, 4, 32, 5), (512, 8, 256, 9), (300, 2, 70000, 2)],
)
def test_deal_matches_its_reference(tokens, k, experts, replicas):
    g = torch.Generator().manual_seed(tokens)
    rows = [torch.randperm(experts, generator=g)[:k] for _ in range(tokens)]
    x = torch.stack(rows) if rows else torch.empty(0, k, dtype=torch.int64)  # [T, k]
    slots = torch.arange(experts * replicas).view(experts, replicas)
    counts = torch.bincount(x.flatten(), minlength=experts)
    # a random split of each expert's pairs over its replicas
    cut = torch.sort(torch.randint(0, 1 << 20, (experts, replicas - 1), generator=g), 1).values
    ends = torch.cat([cut * counts[:, None] // (1 << 20), counts[:, None]], 1)
    take = torch.diff(ends, dim=1, prepend=torch.zeros_like(counts[:, None]))
    got = deal(x, slots, take)
    assert torch.equal(got, deal_reference(x, slots, take))
    assert got.shape == x.shape and got.dtype == torch.int64
    assert torch.equal(got // replicas, x)  # each pair on a replica of its expert
    assert torch.equal(torch.bincount(got.flatten(), minlength=slots.numel()), take.flatten())


def test_global_flattens_the_busiest_rank():
    ids = _routing([256] * A, s=1.2, seed=3)
    load = torch.bincount(torch.cat(ids).flatten(), minlength=E)
    p = Placement.initial(E, RANKS, E // 4, (0,)).plan(load[None])
    table = ReplicaTable.build(p, 0)
    counts = torch.stack([torch.bincount(i.flatten(), minlength=E) for i in ids])
    cost = ExpertCost(activate=4)

    def peak(policy):
        slots = torch.cat(
            [assign(policy, table, x, a, cost, counts[a], counts) for a, x in enumerate(ids)]
        )
        c, _, _ = rank_loads(table, slots, p.slot_rank, cost)
        return c.max().item() / c.float().mean().item()

    assert peak("global") <= 1.10
    assert peak("global") < peak("static")


def test_without_replicas_every_policy_picks_the_expert():
    p = Placement.initial(E, RANKS, 0, (0,))
    table = ReplicaTable.build(p, 0)
    ids = _routing([20, 0, 9])
    counts = torch.stack([torch.bincount(i.flatten(), minlength=E) for i in ids])
    for policy in POLICIES:
        for a, x in enumerate(ids):
            assert torch.equal(assign(policy, table, x, a, ExpertCost(), counts[a], counts), x)


def test_balancer_choose_counts_load_and_folds_it_on_read():
    ids = _routing([30, 12])
    p = Placement.initial(E, RANKS, 6, (3, 5))
    b = Balancer("global", p, 0, 1, ExpertCost(), torch.device("cpu"))
    for layer, x in zip((3, 5), ids):
        assert torch.equal(p.row(layer)[b.choose(layer, x)], x)
    b.choose(3, ids[1])
    want = torch.stack(
        [expert_counts(ids[0], E) + expert_counts(ids[1], E), expert_counts(ids[1], E)]
    )
    assert torch.equal(b.load.window, want) and torch.equal(b.load.total, want)
    b.load.window.zero_()  # a rebalance restarts the window, not the total
    b.choose(5, ids[0])
    assert torch.equal(b.load.window[1], expert_counts(ids[0], E))
    assert torch.equal(b.load.total[1], want[1] + expert_counts(ids[0], E))
    assert b.load.snapshot()["total"] == b.load.total.tolist()


@pytest.mark.parametrize("redundant", [0, 6])
def test_static_choose_is_assign_and_counts_load(redundant):
    """`Balancer.choose` looks the static policy's slots up per placement: the same slots as
    `assign`, on every attention rank, with and without replicas, and the same load counts."""
    ids = _routing([30, 0, 12])
    p = Placement.initial(E, RANKS, redundant, (3, 5))
    for a in range(A):
        b = Balancer("static", p, a, A, ExpertCost(), torch.device("cpu"))
        for layer in (3, 5):
            for x in ids:
                want = assign("static", b.tables[layer], x, a, ExpertCost(), None)
                assert torch.equal(b.choose(layer, x), want)
        total = sum(expert_counts(x, E) for x in ids)
        assert torch.equal(b.load.total, torch.stack([total, total]))


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
