"""The balancer's kernels against its PyTorch reference (`assign`): over random routings
(uniform, Zipf 0.5-1.5, hot sets) and shapes (experts 8-256, top-k 1-8, expert ranks 1-32,
tokens 0-2048, replicas 0 to the expert count), every policy's choice is exactly the
reference's, on every attention rank."""

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
from splitmoe.kernels import balance_cpu
from splitmoe.sim.imbalance import route


class GivenCounts(Balancer):
    """A `Balancer` whose count all-gather returns the given ``[A, E]`` counts."""

    def __init__(self, *args, gathered: torch.Tensor, **kwargs):
        super().__init__(*args, **kwargs)
        self.given = gathered

    def gather_counts(self, counts: torch.Tensor) -> torch.Tensor:
        assert torch.equal(counts, self.given[self.attention_rank])
        return self.given


def popularity(kind: str, E: int, g: torch.Generator) -> torch.Tensor:
    if kind == "uniform":
        return torch.full((E,), 1.0 / E)
    if kind == "hot":  # a few experts take most pairs
        w = torch.full((E,), 0.02)
        w[torch.randperm(E, generator=g)[: max(1, E // 16)]] = 4.0
        return w / w.sum()
    s = float(torch.empty(1).uniform_(0.5, 1.5, generator=g))  # Zipf s
    w = 1.0 / torch.arange(1, E + 1, dtype=torch.float64) ** s
    return (w[torch.randperm(E, generator=g)] / w.sum()).float()


def random_case(seed: int):
    """A placement (planned from a window of the routing, or the initial one), routings of
    every attention rank and a cost."""
    g = torch.Generator().manual_seed(seed)

    def pick(*choices):
        return choices[int(torch.randint(len(choices), (1,), generator=g))]

    E = pick(8, 16, 32, 60, 128, 256)
    k = int(torch.randint(1, 9, (1,), generator=g))
    ranks = min(E, pick(1, 2, 3, 4, 8, 13, 32))
    R = 0 if ranks == 1 else int(torch.randint(0, E + 1, (1,), generator=g))
    R = min(R, E * (ranks - 1))
    A = pick(1, 2, 3, 4)
    kind = pick("uniform", "zipf", "hot")
    weights = popularity(kind, E, g)
    layers = (0,)
    placement = Placement.initial(E, ranks, R, layers)
    if seed % 4:  # planned from observed load, as a rebalance does
        window = route(int(torch.randint(1, 512, (1,), generator=g)), k, weights, g)
        placement = placement.plan(torch.bincount(window.flatten(), minlength=E)[None])
    tokens = [pick(0, 1, 3, 17, 64, 200, 512, 2048) for _ in range(A)]
    ids = [route(t, k, weights, g) for t in tokens]
    cost = ExpertCost(activate=pick(0, 1, 7, 64, 1000))
    return placement, ids, cost


def native_choices(policy, placement, ids, cost):
    counts = torch.stack([expert_counts(x, placement.num_experts) for x in ids])
    out = []
    for a, x in enumerate(ids):
        b = GivenCounts(
            policy, placement, a, len(ids), cost, torch.device("cpu"), gathered=counts,
            kernel="native",
        )  # fmt: skip
        out.append(b.choose(0, x))
        assert torch.equal(b.load.total[0], counts[a])  # the load statistics as the reference's
    return out, counts


@pytest.mark.parametrize("chunk", range(4))
def test_native_kernel_equals_reference(chunk):
    """~240 random cases per chunk, all three policies."""
    for seed in range(chunk * 60, (chunk + 1) * 60):
        placement, ids, cost = random_case(seed)
        table = ReplicaTable.build(placement, 0)
        for policy in POLICIES:
            got, counts = native_choices(policy, placement, ids, cost)
            for a, x in enumerate(ids):
                want = assign(policy, table, x, a, cost, counts[a], counts)
                assert torch.equal(got[a], want), (seed, policy, a)


def test_native_kernel_takes_int32_ids_and_rejects_bad_ones():
    placement = Placement.initial(16, 4, 6, (0,))
    x = route(40, 4, torch.full((16,), 1 / 16), torch.Generator().manual_seed(1))
    for policy in POLICIES:
        b = Balancer(policy, placement, 0, 1, ExpertCost(), torch.device("cpu"), kernel="native")
        ref = Balancer(policy, placement, 0, 1, ExpertCost(), torch.device("cpu"), kernel="torch")
        assert torch.equal(b.choose(0, x.int()), ref.choose(0, x))
        with pytest.raises(ValueError, match="expert id outside"):
            b.choose(0, torch.tensor([[3, 16]]))


def test_auto_is_native_on_cpu_and_a_compiler_error_names_the_fix(tmp_path, monkeypatch):
    p = Placement.initial(8, 2, 2, (0,))
    assert Balancer("global", p, 0, 1, ExpertCost(), torch.device("cpu")).kernel == "native"
    monkeypatch.setenv("CC", "no-such-compiler")
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(balance_cpu.NativeUnavailable, match="needs a C compiler"):
        balance_cpu.build(tmp_path)


def test_native_results_are_independent_tensors():
    """Every call returns a tensor of its own: a result kept across calls stays intact."""
    placement = Placement.initial(16, 4, 6, (0,))
    g = torch.Generator().manual_seed(2)
    x, y = (route(40, 4, torch.full((16,), 1 / 16), g) for _ in range(2))
    for policy in POLICIES:
        b = Balancer(policy, placement, 0, 1, ExpertCost(), torch.device("cpu"), kernel="native")
        ref = Balancer(policy, placement, 0, 1, ExpertCost(), torch.device("cpu"), kernel="torch")
        want_x, want_y = ref.choose(0, x), ref.choose(0, y)
        first = b.choose(0, x)
        view, array = first[1:], first.numpy()
        assert torch.equal(b.choose(0, y), want_y)
        assert torch.equal(first, want_x) and torch.equal(view, want_x[1:])
        assert torch.equal(torch.from_numpy(array), want_x)


def test_choose_is_bound_once_per_policy_and_backend():
    """The constructor binds `choose` to one method; nothing is looked up per call."""
    placement = Placement.initial(8, 2, 2, (0,))
    for kernel in ("native", "torch"):
        for policy in POLICIES:
            b = Balancer(policy, placement, 0, 1, ExpertCost(), torch.device("cpu"), kernel=kernel)
            family = "kernel" if kernel == "native" else "torch"
            assert b.choose.__func__ is getattr(Balancer, f"_{policy}_{family}")
            assert (b.backend.name, b.kernel) == (kernel, kernel)
    with pytest.raises(ValueError, match="must be one of"):
        Balancer("static", placement, 0, 1, ExpertCost(), torch.device("cpu"), kernel="fast")
