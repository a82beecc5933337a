"""Two-phase and adaptive dispatch/combine against the flat transport and the comm oracle.

One multi-rank job per emulated node layout runs the flat, two-phase and adaptive transports over
the same layers; the main process checks, bit for bit, that every expert rank received the
oracle's rows and every attention rank got the oracle's output, whatever the transport.
"""

from __future__ import annotations

import json

import pytest
import torch
import torch.distributed as dist
from comm_ref import reference_layer

from splitmoe.comm.cost_model import CostModel, LinkProfile
from splitmoe.comm.local_job import run_ranks
from splitmoe.comm.topology import Topology
from splitmoe.comm.transports import TRANSPORTS
from splitmoe.comm.two_phase import NodeLayout, scheme_times, segment_index
from splitmoe.config import ParallelConfig
from splitmoe.kernels.fused_moe import fused_moe_ref

H, I, NUM_EXPERTS, K = 16, 8, 8, 2
NUM_LAYERS = 4
# A deliberately slow node-local link and costly network messages: the small layer 1 favours
# two-phase, the large layer 2 flat, so `auto` uses both within one job.
TEST_MODEL = CostModel(
    intra=LinkProfile(alpha_s=0.0, bytes_per_s=3e4),
    inter=LinkProfile(alpha_s=3e-2, bytes_per_s=1e12),
    name="test",
)


def _tokens_of(layer: int, a: int) -> int:
    """Layer 0: attention rank 1 has no token; 1: few; 2: many; 3: nobody has a token."""
    return [[3, 0, 2, 4], [4, 2, 1, 3], [60, 61, 62, 63], [0, 0, 0, 0]][layer][a]


def _experts_of(layer: int) -> list[int]:
    # layer 1 only uses experts 0-3 (all on expert rank 0): the other expert rank gets nothing
    return [0, 1, 2, 3] if layer == 1 else list(range(NUM_EXPERTS))


def _inputs(layer: int, a: int):
    g = torch.Generator().manual_seed(1000 * layer + a)
    n, pool = _tokens_of(layer, a), torch.tensor(_experts_of(layer))
    x = torch.randn(n, H, generator=g)
    rows = [pool[torch.randperm(len(pool), generator=g)[:K]] for _ in range(n)]
    ids = torch.stack(rows) if rows else torch.empty(0, K, dtype=torch.int64)
    return x, ids, torch.rand(n, K, generator=g)


def _weights():
    g = torch.Generator().manual_seed(0)
    return torch.randn(NUM_EXPERTS, 2 * I, H, generator=g), torch.randn(
        NUM_EXPERTS, H, I, generator=g
    )


def _job(rank, world, num_attention, ranks_per_node):
    parallel = ParallelConfig(
        attention_ranks=num_attention,
        expert_ranks=world - num_attention,
        ranks_per_node=ranks_per_node,
    )
    topo = Topology.build(rank, parallel, NUM_EXPERTS)
    cpu = torch.device("cpu")
    w13, w2 = _weights()
    out = {}
    for name in ("flat", "two_phase", "auto"):
        kw = {"cost_model": TEST_MODEL} if name == "auto" else {}
        t = TRANSPORTS[name](topo, dist.group.WORLD, cpu, H, K, torch.float32, cpu, **kw)
        layers = []
        for layer in range(NUM_LAYERS):
            if topo.is_attention:
                handle = t.dispatch(*_inputs(layer, rank), layer=layer)
                layers.append(t.combine(handle))
            else:
                mine = topo.experts_of(topo.expert_index)
                b = t.receive(layer=layer)
                y = fused_moe_ref(b.x, w13[mine], w2[mine], b.expert_ids.long(), b.weights)
                t.send_back(y, b)
                layers.append((b.x, b.expert_ids, b.weights))
        t.flush()  # the posted sends go out before the process group is torn down
        t.close()
        out[name] = (layers, t.stats_snapshot())
    return out


def _oracle(num_attention: int, num_expert: int, layer: int):
    owner = Topology.build(0, ParallelConfig(num_attention, num_expert), NUM_EXPERTS).expert_owner
    w13, w2 = _weights()

    def expert_fn(j, x, ids, w):
        mine = [e for e, o in enumerate(owner) if o == j]
        return fused_moe_ref(x, w13[mine], w2[mine], ids.long(), w)

    inputs = {a: _inputs(layer, a) for a in range(num_attention)}
    return inputs, *reference_layer(inputs, owner, num_expert, expert_fn)


def _record(snap: dict, layer: int) -> dict:
    return snap["layers"][str(layer)]


# (attention ranks, expert ranks, ranks per node):
#   4+2 / 2: nodes {0,1} {2,3} attention, {4,5} experts;
#   4+2 / 3: {0,1,2} attention, {3 | 4,5} a mixed node (rank 3 reaches its experts directly);
#   3+2 / 2: {0,1}, {2 | 3} mixed with a lone attention rank, {4} a smaller last node;
#   2+2 / 4: one node (two-phase degenerates to direct messages).
LAYOUTS = [(4, 2, 2), (4, 2, 3), (3, 2, 2), (2, 2, 4)]


@pytest.fixture(scope="module")
def jobs():
    """``jobs(A, E, g)``: the per-rank results of `_job` for a layout, run once per module."""
    cache = {}

    def get(A, E, g):
        if (A, E, g) not in cache:
            cache[A, E, g] = run_ranks(_job, A + E, A, g)
        return cache[A, E, g]

    return get


@pytest.mark.parametrize("A,E,g", LAYOUTS, ids=[f"{a}+{e}-g{g}" for a, e, g in LAYOUTS])
def test_two_phase_and_auto_match_flat_and_oracle(A, E, g, jobs):
    out = jobs(A, E, g)
    w13, w2 = _weights()
    for layer in range(NUM_LAYERS):
        inputs, received, outputs = _oracle(A, E, layer)
        if layer == 1:
            assert received[1][0].shape[0] == 0  # an expert rank that receives nothing
        for name in ("flat", "two_phase", "auto"):
            for a in range(A):
                got = out[a][name][0][layer]
                assert torch.equal(got, outputs[a]), f"{name} layer {layer} attention rank {a}"
                x, ids, w = inputs[a]
                ref = fused_moe_ref(x, w13, w2, ids, w)  # all experts in one place
                torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)
            for j in range(E):
                for got, want in zip(out[A + j][name][0][layer], received[j]):
                    assert torch.equal(got, want), f"{name} layer {layer} expert rank {j}"

    # Every rank took the same scheme per layer, and `auto` used both.
    chosen = {}
    for layer in range(NUM_LAYERS):
        per_rank = {
            tuple(sorted(k for k, v in _record(o["auto"][1], layer)["schemes"].items() if v))
            for o in out
        }
        assert len(per_rank) == 1, f"ranks disagree on layer {layer}: {per_rank}"
        chosen[layer] = per_rank.pop()
    if g < A + E:
        assert chosen[1] == ("two_phase",) and chosen[2] == ("flat",), chosen
    # ... the scheme the cost model gives on the shared counts
    topo = Topology.build(0, ParallelConfig(A, E, ranks_per_node=g), NUM_EXPERTS)
    lay = NodeLayout.build(topo)
    owner = torch.tensor(topo.expert_owner)
    for layer in range(NUM_LAYERS):
        counts = torch.zeros(A, E, dtype=torch.int64)
        for a in range(A):
            ids = _inputs(layer, a)[1]
            for j in range(E):
                counts[a, j] = int((owner[ids] == j).any(dim=1).sum())
        t = scheme_times(lay, counts, H * 4 + 8 * K, H * 4, TEST_MODEL)
        assert chosen[layer] == ("two_phase" if t["two_phase"] < t["flat"] else "flat",)
    for o in out:
        json.dumps(o["auto"][1])  # the snapshot is JSON-ready
        assert o["two_phase"][1]["transport"] == "two_phase"


def test_counters_inter_node_messages_drop_by_node_size(jobs):
    """4 attention ranks in 2 nodes of 2 + 2 expert ranks: in a layer where every attention rank
    reaches every expert rank, inter-node messages halve, inter-node bytes stay; the extra bytes
    are the phase-1 forwarding inside the attention nodes."""
    A, E, g = 4, 2, 2
    out = jobs(A, E, g)
    layer = 2
    totals = {}
    for name in ("flat", "two_phase"):
        t = {d: {c: [0, 0] for c in ("intra", "inter")} for d in ("dispatch", "combine")}
        for o in out:
            rec = _record(o[name][1], layer)
            for d in t:
                for c in t[d]:
                    t[d][c][0] += rec[d][c]["messages"]
                    t[d][c][1] += rec[d][c]["bytes"]
        totals[name] = t
    flat, two = totals["flat"], totals["two_phase"]
    for d in ("dispatch", "combine"):
        assert flat[d]["inter"][0] == A * E
        assert two[d]["inter"][0] == A * E // g
        assert flat[d]["inter"][1] == two[d]["inter"][1]
        assert flat[d]["intra"] == [0, 0]
        assert two[d]["intra"][0] == A  # each rank forwards to the other proxy of its node
    # Intra bytes: the rows each rank hands to the other proxy of its node.
    owner = Topology.build(0, ParallelConfig(A, E), NUM_EXPERTS).expert_owner
    forwarded = 0
    for a in range(A):
        _, ids, _ = _inputs(layer, a)
        other = 1 - a % 2  # node {2i, 2i+1}: rank 2i + j proxies expert rank j
        forwarded += sum(1 for row in ids.tolist() if any(owner[e] == other for e in row))
    assert two["dispatch"]["intra"][1] == forwarded * (H * 4 + 8 * K)
    assert two["combine"]["intra"][1] == forwarded * H * 4
    rec = _record(out[0]["two_phase"][1], layer)
    assert rec["calls"] == 1 and rec["seconds"]["aggregate"] > 0 and rec["seconds"]["exchange"] > 0


def test_layout_proxies_and_traffic():
    """Static proxy table and phase matrices, without processes."""
    topo = Topology.build(0, ParallelConfig(4, 4, ranks_per_node=2), NUM_EXPERTS)
    lay = NodeLayout.build(topo)  # nodes {0,1} {2,3} attention, {4,5} {6,7} experts
    assert lay.members == (range(0, 2), range(2, 4), range(0), range(0))
    # expert ranks 4..7 -> proxies 0,1,0,1 in node 0 and 2,3,2,3 in node 1 (rail-aligned)
    assert lay.proxy.tolist() == [[0, 1, 0, 1]] * 2 + [[2, 3, 2, 3]] * 2
    counts = torch.tensor([[1, 2, 3, 4], [5, 6, 7, 8], [0, 0, 0, 0], [1, 0, 0, 1]])
    phase1, phase2 = lay.traffic(counts)
    assert phase1.tolist() == [[4, 6, 0, 0], [12, 14, 0, 0], [0, 0, 0, 0], [0, 0, 1, 1]]
    assert phase2.tolist() == [[6, 0, 10, 0], [0, 8, 0, 12], [1, 0, 0, 0], [0, 0, 0, 1]]
    # mixed node: 4 attention + 2 expert ranks, 3 per node -> node 1 = {3 | 4, 5}
    topo = Topology.build(0, ParallelConfig(4, 2, ranks_per_node=3), NUM_EXPERTS)
    lay = NodeLayout.build(topo)
    assert lay.proxy.tolist() == [[0, 1], [0, 1], [0, 1], [-1, -1]]
    starts, lengths = torch.tensor([5, 0, 9]), torch.tensor([2, 0, 3])
    assert segment_index(starts, lengths).tolist() == [5, 6, 9, 10, 11]
