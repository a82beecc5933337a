"""This rank's share of expert load balancing, and the rebalance protocol between steps."""

from __future__ import annotations

import logging
import statistics

import torch
import torch.distributed as dist

from splitmoe.comm.distributed import Groups, new_collective
from splitmoe.comm.shm import COUNTS_CAPACITY
from splitmoe.comm.topology import Topology
from splitmoe.config import EngineConfig
from splitmoe.scheduler.balancer import Balancer, ExpertCost
from splitmoe.scheduler.placement import Placement

logger = logging.getLogger("splitmoe")


class ExpertBalance:
    """This rank's share of expert load balancing: the `Placement` every rank holds (identical
    everywhere), the attention side's `Balancer` (None on expert ranks) and rebalancing.

    Rebalance protocol (between steps, decided through `StepSync` so every rank runs it after the
    same step): all ranks all-reduce the attention ranks' per-(layer, expert) pair counts of the
    window over the CPU group, all compute the same next placement from them, attention ranks
    switch their balancer's replica tables, expert ranks load the weights of the slots whose
    expert changed (from the checkpoint) before the next step. No request is touched: a step
    never straddles two placements.
    """

    def __init__(
        self,
        cfg: EngineConfig,
        topo: Topology,
        groups: Groups,
        device: torch.device,
    ):
        par, m = cfg.parallel, cfg.model
        self.cfg = cfg
        self.topo = topo
        self.groups = groups
        self.placement = Placement.initial(
            m.num_experts, par.expert_ranks, par.num_redundant, m.moe_layers
        )
        # The global policy's count all-gather runs on a group of the attention ranks only
        # (every rank creates it, as torch.distributed requires; shared memory on one host).
        group = None
        if par.balancer == "global" and par.attention_ranks > 1:
            attention = range(par.attention_ranks)
            group = new_collective(attention, groups.hub, par.timeout, COUNTS_CAPACITY)
        self.balancer = None
        if topo.is_attention:
            self.balancer = Balancer(
                par.balancer,
                self.placement,
                topo.rank,
                par.attention_ranks,
                ExpertCost(),
                device,
                group,
                groups.comm_device if groups.comm_device.type == "cuda" else None,
            )
        self.steps = 0
        self.cost: ExpertCost | None = None  # set by `calibrate` (global policy)
        self.measured_cost_s: dict | None = None

    def calibrate(self, worker) -> ExpertCost:
        """Collective over every rank, once at start-up (global policy only: the others ignore
        costs): expert ranks measure their cost per activated expert and per pair
        (`LocalExperts.measure_cost`); every rank takes the medians, so all attention ranks use
        the same integer `ExpertCost` (activate = per-expert / per-pair seconds)."""
        mine = worker.experts.measure_cost() if not self.topo.is_attention else None
        everyone: list = [None] * self.topo.world_size
        dist.all_gather_object(everyone, mine, group=self.groups.cpu)
        measured = [m for m in everyone if m is not None]
        per_expert = statistics.median(m[0] for m in measured)
        per_pair = statistics.median(m[1] for m in measured)
        # Bounded: a noisy measurement must not make either term vanish.
        ratio = per_expert / per_pair if per_pair > 0 else 1024
        cost = ExpertCost(activate=int(min(1024, max(1, round(ratio)))))
        self.measured_cost_s = {"per_expert": per_expert, "per_pair": per_pair}
        if self.balancer is not None:
            self.balancer.cost = cost
        self.cost = cost
        logger.info(
            "%s: expert cost %.1f us per expert, %.2f us per pair -> activate=%d",
            self.topo.describe(), 1e6 * per_expert, 1e6 * per_pair, cost.activate,
        )  # fmt: skip
        return cost

    def due(self) -> bool:
        """Counts a step; True when ``rebalance_interval`` says a rebalance follows it."""
        self.steps += 1
        n = self.cfg.parallel.rebalance_interval
        return bool(n) and self.steps % n == 0

    def rebalance(self, worker) -> Placement:
        """Collective over every rank (see the class doc)."""
        L, E = len(self.placement.layers), self.placement.num_experts
        load = (
            self.balancer.load.window.clone()
            if self.balancer is not None
            else torch.zeros(L, E, dtype=torch.int64)
        )
        dist.all_reduce(load, group=self.groups.cpu)
        new = self.placement.plan(load)
        if self.balancer is not None:
            self.balancer.set_placement(new)
            self.balancer.load.window.zero_()
        else:
            worker.set_placement(new)
        self.placement = new
        logger.info("%s: expert placement v%d", self.topo.describe(), new.version)
        return new

    def stats(self) -> dict:
        out = {
            "policy": self.cfg.parallel.balancer,
            "cost": None if self.cost is None else vars(self.cost),
            "measured_cost_s": self.measured_cost_s,
            "placement_version": self.placement.version,
            "slot_expert": {
                str(layer): self.placement.slot_expert[i].tolist()
                for i, layer in enumerate(self.placement.layers)
            },
        }
        if self.balancer is not None:
            out["load"] = self.balancer.load.snapshot()
        return out
