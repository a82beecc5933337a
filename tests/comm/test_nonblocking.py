"""Non-blocking transport: `dispatch` returns before any expert rank has received (its handle
still pending), on gloo (communication threads), shared memory and two-phase; the results match
the comm oracle bit for bit; an expert rank may post its next receive before it computes.

An expert rank calls `receive` only once every attention rank has written, after `dispatch`
returned, that its handle was still pending: a dispatch that waited for the experts would hang
(the job's timeout fails the test)."""

from __future__ import annotations

import os
import re
import signal
import threading
import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
from comm_ref import reference_layer
from small_default import write_small_model

from splitmoe import LLM, RankFailure, SamplingParams
from splitmoe.comm.local_job import run_ranks
from splitmoe.comm.shm import ShmHub, host_shm_supported
from splitmoe.comm.topology import Topology
from splitmoe.comm.transfer import _ThreadPoster
from splitmoe.comm.transports import TRANSPORTS
from splitmoe.config import ParallelConfig
from splitmoe.kernels.fused_moe import fused_moe_ref

H, I, NUM_EXPERTS, K = 16, 8, 8, 2
MICRO_BATCHES = 2


def _inputs(mb: int, a: int):
    g = torch.Generator().manual_seed(100 * mb + a)
    n = 5 + 2 * mb + a
    x = torch.randn(n, H, generator=g)
    ids = torch.stack([torch.randperm(NUM_EXPERTS, generator=g)[:K] for _ in range(n)])
    return x, ids, torch.rand(n, K, generator=g)


def _weights():
    g = torch.Generator().manual_seed(0)
    return torch.randn(NUM_EXPERTS, 2 * I, H, generator=g), torch.randn(
        NUM_EXPERTS, H, I, generator=g
    )


def _wait_for(paths: list[str], timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not all(os.path.exists(p) for p in paths):
        assert time.monotonic() < deadline, f"no signal from {paths}"
        time.sleep(0.01)


def _job(rank, world, num_attention, ranks_per_node, name, shm, signal_dir):
    parallel = ParallelConfig(
        attention_ranks=num_attention,
        expert_ranks=world - num_attention,
        ranks_per_node=ranks_per_node,
    )
    topo = Topology.build(rank, parallel, NUM_EXPERTS)
    cpu = torch.device("cpu")
    hub = ShmHub(rank, world, dist.group.WORLD, timedelta(seconds=60)) if shm else None
    t = TRANSPORTS[name](topo, dist.group.WORLD, cpu, H, K, torch.float32, cpu, hub=hub)
    w13, w2 = _weights()
    posted = [os.path.join(signal_dir, f"posted{a}") for a in range(num_attention)]
    if topo.is_attention:
        # two micro-batches in flight at once, as the ping-pong has them
        handles = [t.dispatch(*_inputs(mb, rank), layer=0) for mb in range(MICRO_BATCHES)]
        pending = [not h.done() for h in handles]
        open(posted[rank], "w").close()
        outs = [t.combine(h) for h in handles]
        result = {"pending": pending, "done_after": [h.done() for h in handles], "y": outs}
    else:
        _wait_for(posted)  # every dispatch has returned: only now does this rank receive
        mine = topo.experts_of(topo.expert_index)
        # both receives posted before either is used: they complete in posting order
        batches = [t.receive(layer=0) for _ in range(MICRO_BATCHES)]
        got = []
        for b in batches:
            y = fused_moe_ref(b.wait().x, w13[mine], w2[mine], b.expert_ids.long(), b.weights)
            t.send_back(y, b)
            got.append((b.x, b.expert_ids, b.weights))
        t.flush()
        result = {"received": got}
    t.close()
    if hub is not None:
        hub.close()
    return result


CASES = [
    # (transport, attention ranks, expert ranks, ranks per node, shared memory)
    pytest.param("flat", 1, 1, None, False, id="flat-gloo-1+1"),
    pytest.param("flat", 2, 2, None, True, id="flat-shm-2+2"),
    pytest.param("two_phase", 2, 2, 2, False, id="two_phase-gloo-2+2"),
    pytest.param("two_phase", 2, 2, 2, True, id="two_phase-shm-2+2"),
]


@pytest.mark.parametrize("name,num_attention,num_expert,per_node,shm", CASES)
def test_dispatch_returns_before_experts_receive(
    tmp_path, name, num_attention, num_expert, per_node, shm
):
    if shm and not host_shm_supported():
        pytest.skip("no shared memory on this host")
    world = num_attention + num_expert
    out = run_ranks(_job, world, num_attention, per_node, name, shm, str(tmp_path), timeout=90)
    owner = Topology.build(0, ParallelConfig(num_attention, num_expert), NUM_EXPERTS).expert_owner
    w13, w2 = _weights()

    def expert_fn(j, x, ids, w):
        mine = [e for e, o in enumerate(owner) if o == j]
        return fused_moe_ref(x, w13[mine], w2[mine], ids.long(), w)

    for a in range(num_attention):
        assert out[a]["pending"] == [True] * MICRO_BATCHES  # returned, nothing received yet
        assert out[a]["done_after"] == [True] * MICRO_BATCHES
    for mb in range(MICRO_BATCHES):
        inputs = {a: _inputs(mb, a) for a in range(num_attention)}
        received, outputs = reference_layer(inputs, owner, num_expert, expert_fn)
        for a in range(num_attention):
            assert torch.equal(out[a]["y"][mb], outputs[a]), (a, mb)
        for j in range(num_expert):
            for got, want in zip(out[num_attention + j]["received"][mb], received[j]):
                assert torch.equal(got, want), (j, mb)


@pytest.mark.parametrize("shared_memory", [False, True], ids=["gloo", "shm"])
def test_rank_killed_with_transfers_in_flight_fails_the_job(tmp_path, shared_memory):
    """An expert rank killed mid-generate, two micro-batches per step (transfers posted and not
    yet waited for on every rank): generate raises `RankFailure` naming it, and no rank is
    left running or hanging in a communication thread."""
    if shared_memory and not host_shm_supported():
        pytest.skip("no shared memory on this host")
    ckpt = write_small_model(tmp_path / "m")
    llm = LLM(
        str(ckpt),
        attention_ranks=1,
        expert_ranks=2,
        device="cpu",
        micro_batches=2,
        shared_memory=shared_memory,
        timeout_s=60,
    )
    pids = list(llm.rank_pids)
    stop, served, failure = threading.Event(), threading.Event(), []

    def serve() -> None:
        try:
            while not stop.is_set():
                llm.generate([[1, 2, 3]] * 8, SamplingParams(max_tokens=16, ignore_eos=True))
                served.set()
        except Exception as e:  # (what the test checks)
            failure.append(e)

    thread = threading.Thread(target=serve)
    thread.start()
    try:
        assert served.wait(timeout=120), failure  # the job steps, generate after generate
        time.sleep(0.2)
        os.kill(pids[2], signal.SIGKILL)
        start = time.monotonic()
        thread.join(timeout=60)
        assert not thread.is_alive(), "generate hung after a rank was killed"
        assert time.monotonic() - start < 60
    finally:
        stop.set()
        thread.join(timeout=5)
        llm.close()
    assert failure and isinstance(failure[0], RankFailure), failure
    assert re.search(r"rank 2 \(expert\) died \(killed by SIGKILL\)", str(failure[0]))
    deadline = time.monotonic() + 20
    while any(_alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not [p for p in pids if _alive(p)]


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except OSError:
        return False


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_transfers_run_on_their_own_stream_after_their_inputs():
    """A posted function runs on the lane's stream, after the work that wrote its inputs on the
    poster's stream (a missing event would let it read ``x`` half written), and the waiter's
    stream is ordered after it."""
    poster = _ThreadPoster("test-lane", torch.cuda.Stream())
    a = torch.randn(2048, 2048, device="cuda")
    try:
        for _ in range(3):
            x = a @ a @ a  # long enough on the compute stream to race a missing event
            t = poster.post(lambda x=x: (torch.cuda.current_stream(), x * 2), False, (x,))
            stream, y = t.wait()
            assert stream != torch.cuda.current_stream()
            assert torch.equal(y, x * 2)
    finally:
        poster.close()
