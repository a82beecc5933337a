"""A rank from start to end, whoever started it (an `EngineClient`, torchrun or mpirun): its
threads and cores, its groups, its worker and data plane, then its loop
(`engine.rank_loop.RankLoop`) until every rank leaves the job together."""

from __future__ import annotations

import gc
import logging
from dataclasses import dataclass

import torch

from splitmoe.attention_nodes.worker import AttentionWorker
from splitmoe.comm.distributed import Groups, init_groups, job_store, rank_device
from splitmoe.comm.shm import OWN_CORE_SPIN_S
from splitmoe.comm.topology import Topology
from splitmoe.config import EngineConfig
from splitmoe.engine.channel import Channel
from splitmoe.engine.rank import Membership, RankParts
from splitmoe.engine.rank_loop import RankLoop
from splitmoe.expert_nodes.worker import ExpertWorker
from splitmoe.host import (  # noqa: F401 (the host helpers' older home)
    RANK_OMP_SPINCOUNT,
    available_cores,
    keep_freed_memory,
    pin_cores,
    rank_openmp_env,
    set_threads,
)
from splitmoe.kernels.settle import settle_cpu_kernels

logger = logging.getLogger("splitmoe")


@dataclass(frozen=True)
class RankContext:
    """What a finished rank hands back; its process groups are still up (the caller may gather
    results over ``groups.cpu``) until it calls `shutdown_groups`."""

    topo: Topology
    groups: Groups


def run_rank(
    cfg: EngineConfig,
    rank: int,
    init_method: str,
    channel: Channel,
    local_rank: int | None = None,
    local_world_size: int | None = None,
) -> RankContext:
    topo = Topology.build(rank, cfg.parallel, cfg.model.num_experts, local_rank, local_world_size)
    own_cores = set_threads(cfg, topo)
    if cfg.device_type == "cpu":
        keep_freed_memory()
    device = rank_device(cfg.device_type, topo.local_rank)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    par = cfg.parallel
    # a rank with cores of its own polls rather than sleeps through short waits
    spin_s = OWN_CORE_SPIN_S if own_cores else 0.0
    groups = init_groups(
        rank,
        topo.world_size,
        init_method,
        device,
        topo.local_world_size,
        par.timeout,
        shared_memory=par.shared_memory and topo.world_size > 1,
        spin_s=spin_s,
        fault_tolerance=par.fault_tolerance,
    )
    channel.connect(job_store(groups))
    me = RankParts(cfg, topo, groups, device, spin_s, worker=None)
    me.members = Membership(list(range(topo.world_size)))
    me.connect()
    transport, balance = me.transport, me.balance
    if topo.is_attention:
        me.worker = AttentionWorker(
            cfg, transport, device, rank, balance.balancer if balance else None
        )
    else:
        me.worker = ExpertWorker(topo, cfg, transport, device, balance.placement)
    settle_cpu_kernels(cfg, me.worker, topo)  # before anything is timed or served
    if balance is not None and par.balancer == "global":
        balance.calibrate(me.worker)
    me.control()
    # Everything built so far (torch, the model, the groups) lives as long as the rank: moved out
    # of the collector's sight, a full collection during a step walks only what steps create.
    gc.collect()
    gc.freeze()
    channel.ready(topo)
    logger.info("%s ready on %s", topo.describe(), device)
    # GPU ranks that exchange through the host share their GPUs (see `init_groups`)
    shared_gpu = device.type == "cuda" and groups.comm_device.type != "cuda"
    RankLoop(me, channel, shared_gpu).run()
    return RankContext(topo=me.topo, groups=me.groups)
