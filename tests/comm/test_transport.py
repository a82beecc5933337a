"""Flat dispatch/combine against a pure-PyTorch reference (the comm oracle)."""

from __future__ import annotations

import torch
import torch.distributed as dist

from splitmoe.comm.flat import FlatTransport
from splitmoe.comm.local_job import run_ranks
from splitmoe.comm.topology import Topology
from splitmoe.config import ParallelConfig
from splitmoe.kernels.fused_moe import fused_moe_ref

H, I, NUM_EXPERTS, K = 16, 8, 8, 2


def _weights():
    g = torch.Generator().manual_seed(0)
    w13 = torch.randn(NUM_EXPERTS, 2 * I, H, generator=g)
    w2 = torch.randn(NUM_EXPERTS, H, I, generator=g)
    return w13, w2


def _tokens(rank: int, n: int, experts: list[int]):
    """n tokens whose top-k experts are drawn from ``experts``."""
    g = torch.Generator().manual_seed(100 + rank)
    x = torch.randn(n, H, generator=g)
    pool = torch.tensor(experts)
    rows = [pool[torch.randperm(len(experts), generator=g)[:K]] for _ in range(n)]
    ids = torch.stack(rows) if rows else torch.empty(0, K, dtype=torch.int64)
    w = torch.rand(n, K, generator=g)
    return x, ids, w


# Per attention rank, per layer: (tokens, experts they may route to). Attention rank 1 has no
# tokens in layer 0; in layer 1 every token avoids expert rank 1 (it receives nothing).
PLAN = {0: [(7, list(range(8))), (5, [0, 1, 2, 3])], 1: [(0, list(range(8))), (3, [0, 1, 2, 3])]}


def _job(rank, world, num_attention):
    parallel = ParallelConfig(attention_ranks=num_attention, expert_ranks=world - num_attention)
    topo = Topology.build(rank, parallel, NUM_EXPERTS)
    t = FlatTransport(
        topo, dist.group.WORLD, torch.device("cpu"), H, K, torch.float32, torch.device("cpu")
    )
    w13, w2 = _weights()
    results = []
    for layer in range(2):
        if topo.is_attention:
            n, experts = PLAN[rank][layer]
            x, ids, w = _tokens(rank * 10 + layer, n, experts)
            # the CPU (numpy) routing and the torch one (other devices) agree exactly
            fast, generic = t._route_numpy(ids, w), t._route_torch(ids, w)
            for a, b in zip(fast[:3], generic[:3]):
                assert a.dtype == b.dtype and torch.equal(a, b)
            assert fast[3] == generic[3]
            handle = t.dispatch(x, ids, w)
            y = t.combine(handle)
            ref = fused_moe_ref(x, w13, w2, ids, w)
            results.append((y, ref))
        else:
            mine = topo.experts_of(topo.expert_index)
            batch = t.receive()
            y = fused_moe_ref(batch.x, w13[mine], w2[mine], batch.expert_ids.long(), batch.weights)
            t.send_back(y, batch)
            results.append(batch.x.shape[0])
    t.flush()  # the posted sends go out before the process group is torn down
    t.close()
    return results, t.stats.messages, t.stats.bytes


def test_flat_dispatch_combine_matches_reference():
    out = run_ranks(_job, 4, 2)
    for rank in (0, 1):
        for y, ref in out[rank][0]:
            torch.testing.assert_close(y, ref, rtol=1e-5, atol=1e-5)
    # attention rank 1 sent nothing in layer 0 and still took part; expert rank 3 got no token in
    # layer 1 (experts 0-3 live on expert rank 2).
    assert out[1][0][0][0].shape == (0, H)
    assert out[3][0][1] == 0
    assert out[2][0][1] == 5 + 3


def test_each_token_sent_once_per_destination_rank():
    """Rows sent = distinct (token, destination expert rank) pairs, not tokens x top-k."""
    out = run_ranks(_job, 3, 1)  # 1 attention rank, 2 expert ranks
    owner = Topology.build(0, ParallelConfig(1, 2), NUM_EXPERTS).expert_owner
    expected_rows = 0
    for layer, (n, experts) in enumerate(PLAN[0]):
        _, ids, _ = _tokens(layer, n, experts)
        expected_rows += sum(len({owner[e] for e in row.tolist()}) for row in ids)
    served = out[1][0][0] + out[1][0][1] + out[2][0][0] + out[2][0][1]
    assert served == expected_rows
    row_bytes = H * 4 + 8 * K
    assert out[0][2] == expected_rows * row_bytes  # attention rank's sent bytes
