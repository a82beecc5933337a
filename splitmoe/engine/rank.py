"""One rank's parts (`RankParts`): its place in the job, its groups, transports, balance and
control all-gather, and its worker; what it reports of itself (`rank_stats`); and who is in the
job now (`Membership`, fault tolerance)."""

from __future__ import annotations

import os
import resource
from dataclasses import dataclass, field

import torch

from splitmoe.comm.control import StepSync
from splitmoe.comm.distributed import Groups, new_collective
from splitmoe.comm.shm import CONTROL_CAPACITY, CONTROL_SPIN_S
from splitmoe.comm.topology import Topology
from splitmoe.comm.transports import TRANSPORTS
from splitmoe.config import EngineConfig
from splitmoe.eplb.placement import Placement
from splitmoe.eplb.rebalance import ExpertBalance
from splitmoe.host import available_cores
from splitmoe.scheduler.micro_batches import MicroBatchChooser


def rank_stats(
    topo: Topology,
    worker,
    transport,
    balance: ExpertBalance | None = None,
    chooser: MicroBatchChooser | None = None,
    origin: int | None = None,
) -> dict:
    """A JSON-able snapshot of one rank: role, memory, worker state, transport counters (and the
    balancer's load statistics, and how many steps ran with each micro-batch count).
    ``origin``: the rank's rank at start-up, which its front end knows it by (default: its
    rank; they differ after a fault-tolerant job lost an expert rank)."""
    out = rank_counters(topo, worker, origin)
    if chooser is not None:
        out.update(chooser.stats())
    snapshot = getattr(transport, "stats_snapshot", None)
    out["comm"] = snapshot() if snapshot else None
    if balance is not None:
        out["balancer"] = balance.stats()
    return out


def rank_counters(topo: Topology, worker, origin: int | None = None) -> dict:
    """`rank_stats` without the transport's and the balancer's per-layer records (which grow
    with the model): role, memory and worker state, what a rank publishes on its own."""
    with open("/proc/self/statm") as f:
        rss = int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    peak_kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    out = {
        "rank": topo.rank if origin is None else origin,
        "role": topo.role,
        "rss_mb": rss / 2**20,
        "peak_rss_mb": peak_kb / 1024,
        "threads": torch.get_num_threads(),
        "cores": available_cores(),
    }
    out.update(worker.stats())
    return out


@dataclass
class Membership:
    """Who is in the job now (fault tolerance): ``ranks[r]`` is the rank at start-up of the
    current rank ``r`` (a front end knows its ranks by those); ``recoveries``: what each
    recovery found and how long it took."""

    ranks: list[int]
    recoveries: list[dict] = field(default_factory=list)

    def stats(self) -> dict:
        return {"members": list(self.ranks), "recoveries": list(self.recoveries)}


@dataclass
class RankParts:
    """One rank's parts that a recovery rebuilds (fault tolerance): the topology, groups,
    transport, balance and control plane of the world it is in now; the worker, with its
    requests and KV cache (attention) or weights (experts), lives on."""

    cfg: EngineConfig
    topo: Topology
    groups: Groups
    device: torch.device
    spin_s: float
    worker: object
    transport: object = None
    balance: ExpertBalance | None = None
    sync: StepSync | None = None
    members: Membership | None = None

    @property
    def origin(self) -> int:
        """This rank's rank at start-up."""
        return self.members.ranks[self.topo.rank]

    def connect(self, placement: Placement | None = None) -> None:
        """The data plane (transport and balance, over ``placement``: default the initial one)
        of ``topo`` over ``groups``; every rank calls it in the same order (it makes groups and
        shared-memory lanes)."""
        cfg, topo, groups = self.cfg, self.topo, self.groups
        self.transport = self.balance = None
        if topo.colocated:
            return
        self.transport = TRANSPORTS[cfg.parallel.transport](
            topo,
            groups.data,
            groups.comm_device,
            cfg.model.hidden_size,
            cfg.model.top_k,
            cfg.torch_dtype,
            self.device,
            timeout=cfg.parallel.timeout,
            hub=groups.hub,
        )
        self.balance = ExpertBalance(cfg, topo, groups, self.device, placement)

    def control(self) -> None:
        """The per-step all-gather of the whole world (after `connect`, on every rank)."""
        world = range(self.topo.world_size)
        par, groups = self.cfg.parallel, self.groups
        control = new_collective(
            world,
            groups.hub,
            par.timeout,
            CONTROL_CAPACITY,
            group=groups.cpu,
            max_spin_s=CONTROL_SPIN_S,
        )
        self.sync = StepSync(control, self.topo.world_size)
        self.sync.warm_up(groups.data, groups.comm_device)

    def with_members(self, stats: dict) -> dict:
        """A rank's stats with the job's membership when it runs fault-tolerant."""
        if self.cfg.parallel.fault_tolerance:
            stats["membership"] = self.members.stats()
        return stats
