"""Decode steps with each (layer, micro-batch) in one native call, on the attention ranks
(`RemoteDecodeStep`) and the expert ranks (`ExpertWorker`'s `cpu_native.ExpertCall`), against
the per-op paths over the same transport: the same logits to the bit, the same frames and
stats, HF's tokens; on rings large and small (where frames wait for room and arrive in pieces,
so the calls hand their waits to the lanes)."""

from __future__ import annotations

import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
from tiny_models import prompt_ids

from splitmoe import SamplingParams
from splitmoe.comm.distributed import Groups
from splitmoe.comm.local_job import run_ranks
from splitmoe.comm.topology import Topology
from splitmoe.config import EngineConfig, ModelConfig, ParallelConfig
from splitmoe.kernels import cpu_native
from splitmoe.scheduler.request import RequestSpec

pytestmark = pytest.mark.skipif(not cpu_native.available(), reason="needs the native kernels")

MAX_TOKENS = 6
# Per attention rank: prompt lengths. Rank 0's prefill sends an expert rank more rows than its
# call first holds (64: the buffers grow). Rank 1's one request finishes a step early (so it
# joins the last step with no tokens) and with two or more micro-batches leaves some of them
# empty.
PROMPTS = {0: (3, 9, 1, 5, 12, 40), 1: (4,)}
STEPS = MAX_TOKENS  # a prefill step, then MAX_TOKENS - 1 decode steps


def _requests(rank: int) -> list[list[int]]:
    return [prompt_ids(n, seed=10 * rank + i) for i, n in enumerate(PROMPTS[rank])]


def _job(rank, world, num_attention, ckpt, capacity, m, redundant, drain, fused, stray=False):
    import splitmoe.comm.transport as tr
    from splitmoe.attention_nodes.worker import AttentionWorker
    from splitmoe.comm.shm import ShmHub
    from splitmoe.expert_nodes.worker import ExpertWorker
    from splitmoe.runtime import ExpertBalance

    if drain:  # before each native call, what a wait on any lane does: the bytes that have
        # arrived moved to staging; then later frames arrive behind them on the rings
        layer = cpu_native.RemoteBatch.layer

        def drained(self, i):
            hub.progress()
            time.sleep(0.002)
            return layer(self, i)

        cpu_native.RemoteBatch.layer = drained

    lane = tr.new_collective  # rings of ``capacity`` bytes (a frame may not fit one)
    tr.new_collective = lambda ranks, hub, timeout, group=None: lane(
        ranks, hub, timeout, capacity=capacity, group=group
    )
    par = ParallelConfig(num_attention, world - num_attention, redundant_experts=redundant)
    cfg = EngineConfig(model=ModelConfig.from_hf(ckpt), parallel=par, device="cpu", dtype="float32")
    topo = Topology.build(rank, par, cfg.model.num_experts)
    cpu = torch.device("cpu")
    hub = ShmHub(rank, world, dist.group.WORLD, timedelta(seconds=30))
    groups = Groups(data=dist.group.WORLD, cpu=dist.group.WORLD, comm_device=cpu, hub=hub)
    m_cfg = cfg.model
    transport = tr.FlatTransport(
        topo, dist.group.WORLD, cpu, m_cfg.hidden_size, m_cfg.top_k, torch.float32, cpu,
        hub=hub, native=True,
    )  # fmt: skip
    balance = ExpertBalance(cfg, topo, groups, cpu)
    out = {}
    if topo.is_attention:
        worker = AttentionWorker(cfg, transport, cpu, rank, balance.balancer)
        out["native"] = worker.remote_decode is not None
        if not fused:
            worker.remote_decode = None
        logits = []
        sample = worker._sample_logits
        worker._sample_logits = lambda x, *rest: logits.append(x.clone()) or sample(x, *rest)
        params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True)
        for i, p in enumerate(_requests(rank)):
            worker.add_request(RequestSpec(i, p, params, time.time()))
        reqs = list(worker.scheduler.waiting)
        for _ in range(STEPS):
            worker.plan()
            worker.execute(m)
        out["tokens"] = [list(r.output_token_ids) for r in reqs]
        out["logits"] = logits
        out["load"] = balance.balancer.load.total.clone()
        worker.stats()  # (as `LLM.stats` does: the native steps' stats recorded before a read)
        out["spans"] = sorted({s.name for s in worker.timeline.export()})
    else:
        worker = ExpertWorker(topo, cfg, transport, cpu, balance.placement)
        out["native"] = worker.native is not None
        if not fused:
            worker.native = None
        for step in range(STEPS):
            if stray and step == 1:  # a frame the attention rank does not expect, before the
                # partial sums of its first decode step
                worker.frames.send(0, torch.zeros(8, dtype=torch.uint8), 0, 8)
            worker.step(m)
        out["served"] = worker.timeline.export()[-1].name  # (it ran every layer)
    out["comm"] = {  # (all but the seconds)
        layer: {key: value for key, value in rec.items() if key != "seconds"}
        for layer, rec in transport.stats.layers.items()
    }
    hub.close()
    return out


@pytest.mark.parametrize(
    "num_attention,num_expert,m,capacity,redundant,drain",
    [
        (1, 1, 2, 1 << 22, 0, False),
        (1, 1, 2, 1 << 22, 0, True),  # later micro-batches' partial sums staged (by a wait)
        (1, 2, 3, 256, 0, False),  # 256 B: every frame waits for room or arrives in pieces
        (2, 2, 2, 1 << 22, 2, True),  # replicas: the static map is not the identity
        (2, 2, 1, 512, 0, False),
    ],
)
def test_native_decode_matches_the_per_op_forward(
    tiny_ckpt, hf_ref, num_attention, num_expert, m, capacity, redundant, drain
):
    ckpt = str(tiny_ckpt("qwen3_moe"))
    world = num_attention + num_expert
    args = (num_attention, ckpt, capacity, m, redundant, drain)
    fused = run_ranks(_job, world, *args, True)
    per_op = run_ranks(_job, world, *args, False)
    for rank in range(num_attention):
        a, b = fused[rank], per_op[rank]
        assert a["native"] and b["native"]  # (taken in the first run, turned off in the second)
        assert a["tokens"] == b["tokens"]
        assert a["tokens"] == [hf_ref(ckpt, p, MAX_TOKENS) for p in _requests(rank)]
        assert len(a["logits"]) == len(b["logits"]) > STEPS - 1
        for x, y in zip(a["logits"], b["logits"]):
            assert torch.equal(x, y)
        assert torch.equal(a["load"], b["load"]) and a["load"].sum() > 0
        assert "dispatch L0" in a["spans"] and "combine L0" in a["spans"]
    for rank in range(world):  # the same calls, messages and bytes per layer on every rank
        assert fused[rank]["native"]
        assert fused[rank]["comm"] == per_op[rank]["comm"]


def test_a_frame_of_another_size_ends_the_job_with_an_error(tiny_ckpt):
    """Partial sums of the wrong size (ranks whose calls diverged) are reported, not summed."""
    ckpt = str(tiny_ckpt("qwen3_moe"))
    with pytest.raises(RuntimeError, match="sent 8 bytes .* collective calls diverged"):
        run_ranks(_job, 2, 1, ckpt, 1 << 22, 2, 0, False, True, True, timeout=60)
