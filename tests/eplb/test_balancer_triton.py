"""The balancer's Triton kernels (`splitmoe.kernels.balance_triton`, run by Triton's interpreter
here) against the PyTorch reference `assign`: every policy's slots and the load counts exactly
equal on every attention rank, for uniform, Zipf and hot-set routings, shapes with 0 tokens, no
replicas, replicas up to the expert count, and costs that make ties (activate 0) or dominate."""

from __future__ import annotations

import pytest
import torch

from splitmoe.eplb.balancer import Balancer
from splitmoe.eplb.placement import Placement
from splitmoe.eplb.policy import (
    POLICIES,
    ExpertCost,
    ReplicaTable,
    assign,
    expert_counts,
)
from splitmoe.sim.imbalance import route
from tests.eplb.test_balancer_kernels import GivenCounts, popularity

pytest.importorskip("triton")

# (routing, experts, top-k, expert ranks, replicas, tokens per attention rank, activate, planned)
CASES = [
    ("uniform", 16, 4, 4, 6, (17, 0), 7, True),
    ("zipf", 32, 8, 8, 32, (64, 3, 0), 0, True),
    ("hot", 8, 2, 1, 0, (0,), 64, False),
    ("hot", 12, 3, 3, 12, (40, 9, 1, 25), 1000, True),
    ("zipf", 24, 6, 6, 0, (33, 12), 1, False),
    ("uniform", 8, 8, 4, 24, (5, 21), 7, False),
    ("zipf", 64, 8, 16, 64, (200, 90), 7, True),
]


@pytest.mark.parametrize("case", range(len(CASES)))
def test_triton_kernels_equal_reference(case):
    kind, E, k, ranks, R, tokens, activate, planned = CASES[case]
    g = torch.Generator().manual_seed(case)
    weights = popularity(kind, E, g)
    placement = Placement.initial(E, ranks, R, (0,))
    if planned:
        window = route(300, k, weights, g)
        placement = placement.plan(torch.bincount(window.flatten(), minlength=E)[None])
    ids = [route(t, k, weights, g) for t in tokens]
    counts = torch.stack([expert_counts(x, E) for x in ids])
    cost = ExpertCost(activate=activate)
    table = ReplicaTable.build(placement, 0)
    for policy in POLICIES:
        for a, x in enumerate(ids):
            b = GivenCounts(
                policy, placement, a, len(ids), cost, torch.device("cpu"), gathered=counts,
                kernel="triton",
            )  # fmt: skip
            got = b.choose(0, x.int() if a % 2 else x)  # int32 ids as well
            want = assign(policy, table, x, a, cost, counts[a], counts)
            assert torch.equal(got, want), (case, policy, a)
            assert torch.equal(b.load.total[0], counts[a]), (case, policy, a)


def test_triton_kernel_is_asked_for_explicitly_on_cpu():
    p = Placement.initial(8, 2, 2, (0,))
    # "auto" on a CPU rank stays the native kernel; "triton" runs (here: interpreted)
    assert Balancer("local", p, 0, 1, ExpertCost(), torch.device("cpu")).kernel == "native"
    b = Balancer("local", p, 0, 1, ExpertCost(), torch.device("cpu"), kernel="triton")
    assert b.kernel == "triton"
