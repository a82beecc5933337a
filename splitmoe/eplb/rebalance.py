"""This rank's share of expert load balancing, and the live rebalance protocol between steps.

`ExpertBalance` joins the subsystem's parts for the runtime: the `Placement`, the attention
side's `Balancer` and its `LoadStats`, and the expert side's weight moves. The expert worker is
reached only through the two calls it offers (``stage(placement)`` and ``switch_layer(staged,
layer, placement)``) and the staged weights through ``ready`` and ``read_s``, so this package
imports nothing from `splitmoe.expert_nodes` (which imports `splitmoe.eplb.placement`).
"""

from __future__ import annotations

import logging
import statistics
import time
from collections import deque
from typing import Protocol

import torch
import torch.distributed as dist

from splitmoe.comm.distributed import Groups, new_collective
from splitmoe.comm.shm import COUNTS_CAPACITY
from splitmoe.comm.topology import Topology
from splitmoe.config import EngineConfig
from splitmoe.eplb.balancer import Balancer
from splitmoe.eplb.placement import Placement
from splitmoe.eplb.policy import ExpertCost

logger = logging.getLogger("splitmoe")


class Staged(Protocol):
    """An expert rank's weights of a coming placement, read in the background
    (`splitmoe.expert_nodes.experts.StagedExperts`)."""

    @property
    def ready(self) -> bool: ...

    @property
    def read_s(self) -> float: ...


class ExpertBalance:
    """This rank's share of expert load balancing: the `Placement` every rank holds (identical
    everywhere), the attention side's `Balancer` (None on expert ranks) and rebalancing.

    Rebalance protocol, without a stall: every decision comes from `StepSync`'s all-gather, so
    every rank takes it at the same step boundary.

    1. `begin` (when a rank asked, or every ``rebalance_interval`` steps): all ranks start an
       all-reduce of the attention ranks' per-(layer, expert) pair counts of the window over the
       CPU group, in the background.
    2. Each rank reports in the step all-gather whether its part of the current phase is done
       (`ready`); at a boundary where every rank is, `advance` takes the next phase on every
       rank at once. First the plan: all compute the same next placement; expert ranks start
       reading the weights of their slots whose expert changes, in a background thread
       (`LocalExperts.stage`); every rank keeps serving the current placement meanwhile.
    3. Then, once all are staged, one changed layer per boundary moves to the new placement:
       attention ranks rebuild that layer's replica table, expert ranks copy its staged weights
       into their slots (a memory copy of the changed slots only). A step uses, per layer, one
       placement on every rank; no request is touched.
    """

    def __init__(
        self,
        cfg: EngineConfig,
        topo: Topology,
        groups: Groups,
        device: torch.device,
        placement: Placement | None = None,
    ):
        """``placement``: the one in use (default: `Placement.initial`); a job that lost an
        expert rank rebuilds this object around `Placement.without`."""
        par, m = cfg.parallel, cfg.model
        self.cfg = cfg
        self.topo = topo
        self.groups = groups
        self.placement = placement or Placement.initial(
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
        # a rebalance in progress: the placement it moves to, this expert rank's staged
        # weights, the layers still to switch
        self._reduce = None  # the load all-reduce in flight (a torch.distributed Work)
        self._load: torch.Tensor | None = None
        self.target: Placement | None = None
        self._staged: Staged | None = None
        self._to_switch: list[int] = []
        self.events: deque[dict] = deque(maxlen=256)  # recent plan / switch times (stats)

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

    def keep_cost(self, other: ExpertBalance) -> None:
        """Takes ``other``'s calibrated `ExpertCost` (the expert ranks measured it at start-up;
        a rebuilt balance keeps it rather than measuring again mid-run)."""
        self.cost, self.measured_cost_s = other.cost, other.measured_cost_s
        self.events.extend(other.events)
        if self.balancer is not None and other.cost is not None:
            self.balancer.cost = other.cost

    def due(self) -> bool:
        """Counts a step; True when ``rebalance_interval`` says a rebalance follows it."""
        self.steps += 1
        n = self.cfg.parallel.rebalance_interval
        return bool(n) and self.steps % n == 0

    @property
    def in_transition(self) -> bool:
        """A rebalance has begun and not every changed layer has switched yet."""
        return self._reduce is not None or self.target is not None

    @property
    def ready(self) -> bool:
        """This rank's part of the rebalance's next phase is done (what it reports each step):
        its load all-reduce has completed, or its weights are staged."""
        if self._reduce is not None:
            return self._reduce.is_completed()
        return self._staged is None or self._staged.ready

    def begin(self) -> None:
        """Every rank, at the same boundary: starts the all-reduce of the window's load (the
        attention ranks' pair counts) in the background; `advance` plans from it."""
        L, E = len(self.placement.layers), self.placement.num_experts
        if self.balancer is not None:
            self._load = self.balancer.load.window.clone()
            self.balancer.load.window.zero_()
        else:
            self._load = torch.zeros(L, E, dtype=torch.int64)
        self._reduce = dist.all_reduce(self._load, group=self.groups.cpu, async_op=True)
        self.events.append({"time": time.time(), "event": "begin"})

    def advance(self, worker) -> bool:
        """Every rank, at the same boundary where every rank was `ready`: the rebalance's next
        step (plan and start staging; then one changed layer per boundary). True once the new
        placement is in use everywhere."""
        if self._reduce is not None:
            self._plan(worker)
            return self.target is None
        return self._switch_next(worker)

    def _plan(self, worker) -> None:
        t = time.perf_counter()
        self._reduce.wait()
        self._reduce = None
        target = self.placement.plan(self._load)
        if self.balancer is None:
            self._staged = worker.stage(target)
        changed = (target.slot_expert != self.placement.slot_expert).any(1).tolist()
        self.target = target
        self._to_switch = [layer for layer, c in zip(target.layers, changed) if c]
        plan = {"time": time.time(), "event": "plan", "version": target.version}
        self.events.append({**plan, "plan_s": time.perf_counter() - t})
        if not self._to_switch:
            self._finish()

    def _switch_next(self, worker) -> bool:
        t = time.perf_counter()
        layer = self._to_switch.pop(0)
        i = self.placement.layers.index(layer)
        rows = self.placement.slot_expert.clone()
        rows[i] = self.target.slot_expert[i]
        last = not self._to_switch
        version = self.target.version if last else self.placement.version
        placement = Placement(
            self.placement.num_experts, self.placement.num_ranks, self.placement.layers, rows,
            version,
        )  # fmt: skip
        if self.balancer is not None:
            self.balancer.set_placement(placement, layers=(layer,))
        else:
            worker.switch_layer(self._staged, layer, placement)
        self.placement = placement
        switch = {"time": time.time(), "event": f"switch L{layer}", "version": version}
        self.events.append({**switch, "switch_s": time.perf_counter() - t})
        if last:
            self._finish()
        return last

    def _finish(self) -> None:
        logger.info("%s: expert placement v%d", self.topo.describe(), self.target.version)
        if self._staged is not None:
            self.events.append(
                {"time": time.time(), "event": "read", "read_s": self._staged.read_s}
            )
        self.placement = self.target
        self.target, self._staged, self._to_switch = None, None, []
        done = {"time": time.time(), "event": "done", "version": self.placement.version}
        self.events.append(done)

    def stats(self) -> dict:
        out = {
            "policy": self.cfg.parallel.balancer,
            "cost": None if self.cost is None else vars(self.cost),
            "measured_cost_s": self.measured_cost_s,
            "placement_version": self.placement.version,
            "rebalance_events": list(self.events),
            "slot_expert": {
                str(layer): self.placement.slot_expert[i].tolist()
                for i, layer in enumerate(self.placement.layers)
            },
        }
        if self.balancer is not None:
            out["load"] = self.balancer.load.snapshot()
        return out
