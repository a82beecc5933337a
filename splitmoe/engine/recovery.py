"""Fault tolerance, the survivors' side (docs/fault_tolerance.md): whether a failure is a lost
peer (`survivable`), and going on without it (`recover`): agree on who is left, rejoin as a
new world, re-place the lost experts (replicas first, else grown slots read from the
checkpoint), rebuild the data and control planes and rebind the worker to them."""

from __future__ import annotations

import logging
import socket
import time
from dataclasses import replace

import torch.distributed as dist

from splitmoe.comm.control import agree_membership
from splitmoe.comm.distributed import rejoin
from splitmoe.comm.topology import Topology
from splitmoe.config import ParallelConfig
from splitmoe.engine.channel import Channel
from splitmoe.engine.rank import RankParts
from splitmoe.eplb.placement import Placement
from splitmoe.memory import device_room, growth_fits

logger = logging.getLogger("splitmoe")

# How long a rank whose collective broke waits to see a peer's process exit (fault tolerance)
_EXIT_GRACE_S = 1.0


def survivable(me: RankParts, error: Exception) -> bool:
    """Whether a failure inside a sync or step is a lost peer that fault tolerance recovers
    from: some rank of this host has exited, or a wait or collective timed out or broke (a
    peer on another host: the membership protocol then decides who is gone)."""
    if not me.cfg.parallel.fault_tolerance or me.topo.world_size == 1:
        return False
    if isinstance(error, (TimeoutError, dist.DistBackendError)):
        return True
    # gloo raises as soon as the dead peer's sockets close, which a dying process does before
    # it shows as exited: give it a moment to
    deadline = time.monotonic() + _EXIT_GRACE_S
    while not me.groups.gone(me.topo.rank):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


def recover(me: RankParts, error: Exception, channel: Channel) -> None:
    """The survivors' side of losing ranks (fault tolerance): agree on who is left, rejoin as a
    new world, re-place the lost experts and rebuild the data and control planes; the caller
    then replays the interrupted step (without a lost attention rank's part: its requests are
    resumed elsewhere by the front end). Raises `RankLost` where the loss is not survivable (no
    attention or no expert rank left, an expert that fits nowhere), and `RankEvicted` on a rank
    the others left out (it answered too late)."""
    t0 = time.monotonic()
    topo, par = me.topo, me.cfg.parallel
    logger.warning("%s: a peer failed (%s); recovering", topo.describe(), error)
    gone = me.groups.gone(topo.rank)
    if me.transport is not None:
        me.transport.close()
    if me.groups.hub is not None:
        me.groups.hub.close()
    epoch = len(me.members.recoveries) + 1
    members = agree_membership(
        me.groups.store, epoch, topo.rank, topo.world_size, gone, par.timeout_s
    )
    lost = [r for r in range(topo.world_size) if r not in members]
    origin_lost = [me.members.ranks[r] for r in lost]
    lost_attention = [r for r in lost if r < topo.num_attention]
    lost_experts = [r - topo.num_attention for r in lost if r >= topo.num_attention]
    if len(lost_attention) == topo.num_attention:
        raise RankLost(f"every attention rank is lost ({origin_lost})") from error
    if lost_experts and topo.num_expert == len(lost_experts):
        raise RankLost(f"every expert rank is lost ({origin_lost})") from error
    # (a lost attention rank's requests are the front end's to move: `LLM._resume_lost`)
    rank = members.index(topo.rank)
    me.groups = rejoin(
        me.groups,
        epoch,
        rank,
        len(members),
        me.device,
        topo.local_world_size,
        par.timeout,
        shared_memory=par.shared_memory,
        spin_s=me.spin_s,
    )
    new_par = replace(
        par,
        attention_ranks=topo.num_attention - len(lost_attention),
        expert_ranks=topo.num_expert - len(lost_experts),
    )
    old = me.balance
    placement = None
    if old is not None:
        placement = _placement_without(me, old.placement, lost_experts, new_par, error)
        new_par = replace(new_par, redundant_experts=placement.redundant)
    me.cfg = replace(me.cfg, parallel=new_par)
    me.topo = Topology.build(
        rank, new_par, me.cfg.model.num_experts, topo.local_rank, topo.local_world_size
    )
    me.connect(placement)
    read = 0
    if old is not None:
        me.balance.keep_cost(old)
        read = me.worker.rebind(me.topo, me.transport, me.balance)
    me.control()
    me.members.ranks = [me.members.ranks[r] for r in members]
    took = time.monotonic() - t0
    me.members.recoveries.append(
        {"lost": origin_lost, "members": list(me.members.ranks), "seconds": took,
         "weights_read": read,
         "placement_version": None if placement is None else placement.version,
         "expert_slots": None if placement is None else placement.slots_per_rank.tolist()}
    )  # fmt: skip
    logger.warning(
        "%s (was rank %d): recovered without rank(s) %s in %.2f s",
        me.topo.describe(), me.origin, origin_lost, took,
    )  # fmt: skip
    channel.recovered(me.members.stats())


def _placement_without(
    me: RankParts, placement: Placement, lost: list[int], new_par: ParallelConfig, error: Exception
) -> Placement:
    """The placement after losing expert ranks ``lost`` (`Placement.without`): replica slots
    first; where a lost expert finds none, the survivors grow their slots if memory allows
    (`memory.growth_fits`: ``expert_memory_gb`` and what each device has free, which every
    survivor tells over the rebuilt world, so all decide alike), else `RankLost`. Every rank
    of the new world calls it, in step (``me.groups`` is the rebuilt world's)."""
    try:
        return placement.without(lost)
    except ValueError as no_room:
        grown = placement.without(lost, grow=True)
        mine = (f"{socket.gethostname()}/{me.device}", device_room(me.device))
        rooms: list = [None] * dist.get_world_size(me.groups.cpu)
        dist.all_gather_object(rooms, mine, group=me.groups.cpu)
        survivors = [r for r in range(placement.num_ranks) if r not in lost]
        after = replace(me.cfg, parallel=replace(new_par, redundant_experts=grown.redundant))
        why = growth_fits(me.cfg, after, survivors, rooms[new_par.attention_ranks :])
        if why is not None:
            raise RankLost(f"{no_room}; {why}") from error
        logger.warning(
            "%s: no replica slot holds every lost expert: expert slots grow from %s to %s",
            me.topo.describe(), placement.slots_per_rank[survivors].tolist(),
            grown.slots_per_rank.tolist(),
        )  # fmt: skip
        return grown


class RankLost(RuntimeError):
    """A rank was lost and the job cannot go on without it (even with fault tolerance)."""
