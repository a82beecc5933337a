"""The loop every rank runs, whoever started it (the `LLM` front end, torchrun or mpirun).

Each iteration: attention ranks take new requests from their `Channel` and plan a step; all ranks
all-gather ``(tokens, done)``; if any attention rank has tokens, every rank runs the step (attention
ranks with zero tokens still join each dispatch/combine, expert ranks serve every MoE layer); when
no rank has work and every attention rank's channel is closed, all ranks leave together.
"""

from __future__ import annotations

import ctypes
import gc
import logging
import os
import pickle
import resource
import socket
import time
from dataclasses import dataclass, field, replace
from typing import Protocol

import torch
import torch.distributed as dist

from splitmoe.attention_nodes.worker import AttentionWorker, RemoteExperts, RequestUpdate
from splitmoe.comm.control import StepSync, agree_membership
from splitmoe.comm.distributed import Groups, init_groups, new_collective, rank_device, rejoin
from splitmoe.comm.shm import CONTROL_CAPACITY, CONTROL_SPIN_S, OWN_CORE_SPIN_S
from splitmoe.comm.topology import Topology
from splitmoe.comm.transports import TRANSPORTS
from splitmoe.config import EngineConfig, ParallelConfig
from splitmoe.eplb.placement import Placement
from splitmoe.eplb.rebalance import ExpertBalance
from splitmoe.expert_nodes.worker import ExpertWorker
from splitmoe.kernels.settle import settle_cpu_kernels
from splitmoe.memory import device_room, growth_fits
from splitmoe.metrics import StepRecord
from splitmoe.scheduler.micro_batches import MicroBatchChooser
from splitmoe.scheduler.request import RequestSpec

logger = logging.getLogger("splitmoe")

# How long an idle attention rank blocks on its channel before the next sync: the heartbeat that
# keeps the idle expert ranks' collective timeouts from firing. The front end wakes every
# attention rank as soon as it has work for any of them (and for stats, traces, rebalances and
# closing), so this bounds only how often an idle job wakes up: 5 ms made an idle `LLM` cost its
# host ~2 x 200 process wake-ups a second, and slowed whatever else ran there.
IDLE_POLL_S = 0.1

# A rank publishes its counters (`rank_counters`) on its own, the front end keeps the latest
# (`LLM.latest_stats`) and GET /metrics reads that, asking no rank: a scrape used to wait for
# every rank's answer and paused token delivery meanwhile. While anything changes they go out
# at most every STATS_PUBLISH_S; a request arriving or aborted, or the job going idle, is told
# after STATS_EVENT_S at most (so a scrape soon after sees it), which bounds a rank's cost (a
# /proc read and a small pickle each time) to STATS_EVENT_S's rate however often requests come.
# An idle job publishes nothing.
STATS_PUBLISH_S = 1.0
STATS_EVENT_S = 0.02

# An attention rank whose only work is KV still arriving from a prefill instance checks for it
# this often (and meanwhile for new requests) instead of spinning through empty steps.
PULL_POLL_S = 0.002


@dataclass
class Inbox:
    """What a rank found in its channel: new requests, and whether a stats snapshot is wanted."""

    requests: list[RequestSpec] = field(default_factory=list)
    aborts: list[int] = field(default_factory=list)  # request ids to drop at once
    stats_wanted: bool = False
    trace_wanted: bool = False
    rebalance_wanted: bool = False  # answered with `send_stats` once every rank has rebalanced


class Channel(Protocol):
    """Where a rank's requests and commands come from and its results go."""

    @property
    def closed(self) -> bool:
        """True once no more requests will arrive (always, for expert ranks)."""

    def poll(self, timeout: float) -> Inbox:
        """New requests and commands; waits up to ``timeout`` seconds when there are none."""

    def emit(self, updates: list[RequestUpdate], record: StepRecord | None) -> None:
        """Tokens produced by one step, and the step's record (None: aborted requests' final
        updates, outside a step)."""

    def ready(self, topo: Topology) -> None:
        """This rank has joined the job and loaded its weights."""

    def send_stats(self, stats: dict) -> None:
        """Answer to a stats request."""


class PublishingChannel(Channel, Protocol):
    """A channel whose front end keeps the rank's latest counters (a server's: see
    `STATS_PUBLISH_S`)."""

    def publish(self, counters: dict) -> None:
        """This rank's `rank_counters`, sent on its own (not an answer to a request)."""


class MailChannel(Channel, Protocol):
    """A channel that reaches its front end through the control plane (a launched server's
    ranks, see `splitmoe.llm.RelayChannel`): what it has to send goes out with the step sync."""

    def outgoing(self):
        """Messages to relay (None: nothing), taken out of the channel."""

    def deliver(self, mail: list) -> None:
        """Every rank's pickled mail (`StepSync.relay`; None: none), from which it takes (and
        unpickles) what is addressed to it."""


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
class _Publication:
    """When this rank's counters are due to go out (see `STATS_PUBLISH_S`)."""

    last: float = -float("inf")  # time.monotonic() of the last publication
    changed: bool = True  # since then (a new rank has not published yet)
    urgent: bool = True  # a change a scrape should see soon

    def note(self, changed: bool, urgent: bool = False) -> None:
        self.changed |= changed or urgent
        self.urgent |= urgent

    def due(self, now: float) -> bool:
        wait = STATS_EVENT_S if self.urgent else STATS_PUBLISH_S
        return self.changed and now - self.last >= wait

    def sent(self, now: float) -> None:
        self.last, self.changed, self.urgent = now, False, False


def set_threads(cfg: EngineConfig, topo: Topology) -> bool:
    """CPU threads per rank (`threads_per_rank`, else the node's cores shared by its ranks), then
    `pin_cores`; returns whether this rank has cores of its own."""
    if cfg.device_type != "cpu":
        return False
    cores, ranks = len(available_cores()), max(1, topo.local_world_size)
    n = cfg.threads_per_rank or max(1, cores // ranks)
    torch.set_num_threads(n)
    pinned = None
    if cfg.pin_cores:
        pinned = pin_cores(topo.local_rank, topo.local_world_size, n)
    return pinned is not None


# How long an idle OpenMP worker of a rank with cores of its own spins before it sleeps, in
# libgomp's spin iterations (`rank_openmp_env`): ~2.5 s at ~25 ns each on x86. A bound on what
# an idle rank burns, not a tuned speed: the longer the spin, the faster (libgomp's default,
# ~10 ms, sleeps between the parallel regions of one decode step), up to spinning forever.
RANK_OMP_SPINCOUNT = 100_000_000


def rank_openmp_env(cfg: EngineConfig, local_ranks: int) -> dict[str, str]:
    """Environment for rank processes this host starts (before they load OpenMP): where each
    rank gets cores of its own and several threads, its OpenMP workers keep spinning between
    the parallel regions of a step instead of sleeping after libgomp's default ~10 ms and
    paying a wake-up per region (colocated realistic preset, batch 32, float32, 2 threads on a
    2-core AMD EPYC: 575 decode tok/s with the default, 726 with this bound, 796 spinning
    forever, 291 never spinning). Nothing where ranks share cores (a spinning worker would
    take a core from another rank) or where the user set the OpenMP wait policy."""
    if cfg.device_type != "cpu" or not cfg.pin_cores:
        return {}
    if "OMP_WAIT_POLICY" in os.environ or "GOMP_SPINCOUNT" in os.environ:
        return {}
    cores, ranks = len(available_cores()), max(1, local_ranks)
    n = cfg.threads_per_rank or max(1, cores // ranks)
    if n < 2 or ranks * n > cores:
        return {}
    return {"GOMP_SPINCOUNT": str(RANK_OMP_SPINCOUNT)}


def available_cores() -> list[int]:
    """The cores this process may run on (its affinity mask: a `taskset` or a batch scheduler's
    allocation narrows it), in order."""
    try:
        return sorted(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return list(range(os.cpu_count() or 1))


def pin_cores(local_rank: int, local_world_size: int, threads: int) -> list[int] | None:
    """Binds this rank to cores of its own, ``threads`` of them, where the node's ranks fit on
    the available cores side by side; returns them (None: not pinned, the ranks would share).

    Left to the OS, the two busy ranks of a 1+1 job on 2 cores can land on one core for a
    while. The front end and other processes stay unpinned; ``pin_cores=False`` turns this
    off (several jobs sharing one host)."""
    cores = available_cores()
    if not hasattr(os, "sched_setaffinity") or local_world_size * threads > len(cores):
        return None
    mine = cores[local_rank * threads : (local_rank + 1) * threads]
    os.sched_setaffinity(0, mine)
    return mine


def keep_freed_memory() -> bool:
    """Asks glibc to serve blocks up to 32 MB from its heap and to keep freed memory rather than
    return it to the OS. By default every block over 128 KB is a fresh mmap, so each step's large
    temporaries (prefill activations, gathered KV) fault their pages in again, which is slow in a
    VM: a 32 x 32-token prefill step took 50-80 ms, 34-39 ms with this (CPU, default model).
    The price is that a rank keeps its peak heap. False where it does not apply (not glibc)."""
    try:
        libc = ctypes.CDLL("libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3
    return bool(mallopt(M_MMAP_THRESHOLD, 32 << 20)) and bool(mallopt(M_TRIM_THRESHOLD, 1 << 30))


@dataclass(frozen=True)
class RankContext:
    """What a finished rank hands back; its process groups are still up (the caller may gather
    results over ``groups.cpu``) until it calls `shutdown_groups`."""

    topo: Topology
    groups: Groups


# How long a rank whose collective broke waits to see a peer's process exit (fault tolerance)
_EXIT_GRACE_S = 1.0


@dataclass
class _Membership:
    """Who is in the job now (fault tolerance): ``ranks[r]`` is the rank at start-up of the
    current rank ``r`` (a front end knows its ranks by those); ``recoveries``: what each
    recovery found and how long it took."""

    ranks: list[int]
    recoveries: list[dict] = field(default_factory=list)

    def stats(self) -> dict:
        return {"members": list(self.ranks), "recoveries": list(self.recoveries)}


@dataclass
class _Rank:
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
    members: _Membership | None = None

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
        self.sync = StepSync(control, self.topo.world_size, groups.cpu)
        self.sync.warm_up(groups.data, groups.comm_device)


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
    me = _Rank(cfg, topo, groups, device, spin_s, worker=None)
    me.members = _Membership(list(range(topo.world_size)))
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
    # 1+1 ranks on CPU, batch 128, four alternated runs each: m=2 / m=1 went ~1.06x -> ~1.19x.
    gc.collect()
    gc.freeze()
    channel.ready(topo)
    logger.info("%s ready on %s", topo.describe(), device)
    # GPU ranks that exchange through the host share their GPUs (see `init_groups`)
    shared_gpu = device.type == "cuda" and groups.comm_device.type != "cuda"
    _loop(me, channel, shared_gpu)
    return RankContext(topo=me.topo, groups=me.groups)


def _loop(me: _Rank, channel: Channel, shared_gpu: bool = False) -> None:
    worker, cfg = me.worker, me.cfg
    busy = False
    chooser = MicroBatchChooser(cfg.parallel, shared_gpu)
    times = None  # this rank's times in its last step, shared in the next exchange
    rebalance_asked = False  # this rank's channel asked; answered once the switch is done
    answer_pending = False  # a rebalance this rank asked for has begun, not finished
    relays = hasattr(channel, "outgoing")  # (a `MailChannel`)
    publication = _Publication() if hasattr(channel, "publish") else None  # `PublishingChannel`
    replay = None  # (fault tolerance) the row of a step a failure interrupted, to run again
    while True:
        topo, transport, balance, sync = me.topo, me.transport, me.balance, me.sync
        if replay is None:
            wait = 0.0
            if topo.is_attention and not busy:  # (else a step is due at once)
                if not worker.has_work:
                    wait = IDLE_POLL_S
                elif worker.only_transfers:
                    wait = PULL_POLL_S
            inbox = channel.poll(wait)
        else:  # (the planned step stands: nothing may change it before it runs again)
            inbox = Inbox()
        if inbox.stats_wanted:
            stats = rank_stats(topo, worker, transport, balance, chooser, me.origin)
            channel.send_stats(_with_members(stats, me))
        rebalance_asked |= inbox.rebalance_wanted
        if inbox.trace_wanted:
            channel.send_stats(
                {"rank": me.origin, "role": topo.role, "timeline": worker.timeline.export()}
            )
        freed = False  # (KV blocks that a finished transfer gave back: counters changed)
        if replay is not None:
            row = replay
        elif topo.is_attention:
            with worker.timeline.span("schedule", "compute"):
                refused = [u for spec in inbox.requests if (u := worker.add_request(spec))]
                if refused:  # (requests whose admission raised: they fail alone)
                    channel.emit(refused, None)
                if inbox.aborts:
                    channel.emit(worker.abort(inbox.aborts), None)
                released = worker.kv_releases
                tokens = worker.plan()
                freed = worker.kv_releases != released
            row = (tokens, channel.closed and not worker.has_work)
        else:
            row = (0, True)
        ready = balance is None or balance.ready
        mail = channel.outgoing() if relays else None
        blob = b"" if mail is None else pickle.dumps(mail, pickle.HIGHEST_PROTOCOL)
        due = False
        if publication is not None:
            publication.note(False, urgent=bool(inbox.requests or inbox.aborts or freed))
            due = publication.due(time.monotonic())
        try:
            with worker.timeline.span("sync", "wait"):
                decision = sync.exchange(*row, rebalance_asked, ready, len(blob), due, times)
                if decision.mail:
                    channel.deliver(sync.relay(blob))
            if decision.finished:
                return
            chooser.observe(decision.times)
            times = None
            if publication is not None:
                if decision.publish:  # (some rank's are due: all go out together)
                    counters = rank_counters(topo, worker, me.origin)
                    counters["published_at"] = time.time()
                    channel.publish(_with_members(counters, me))
                    publication.sent(time.monotonic())
                # (the step about to run changes them; the job going idle, urgently)
                publication.note(decision.run, urgent=busy and not decision.run)
            if balance is not None:  # colocated: nothing to rebalance; asks answered at once
                if balance.in_transition and decision.ready:
                    with worker.timeline.span("rebalance", "compute"):
                        if balance.advance(worker) and answer_pending:
                            _answer_rebalance(channel, balance)
                            answer_pending = False
                if decision.rebalance and not balance.in_transition:  # else: after this one
                    balance.begin()
                    answer_pending, rebalance_asked = rebalance_asked, False
            elif rebalance_asked:
                _answer_rebalance(channel, None)
                rebalance_asked = False
            busy = decision.run
            if not busy:
                replay = None
                continue
            worker.timeline.step += 1
            m = chooser.choose(decision.tokens[: topo.num_attention])
            worker.timeline.take_times()  # (this step's times start here)
            if topo.is_attention:
                updates, record = worker.execute(m)
            else:
                worker.step(m)
        except Exception as error:
            if not _survivable(me, error):
                raise
            _recover(me, error, channel)
            # Replayed: the exchange (and the step) this failure interrupted. An attention
            # rank's planned batch still stands: a step commits its tokens only at its end
            # (one micro-batch under fault tolerance), and the replay writes the same KV again.
            replay, times, answer_pending = row, None, False
            continue
        replay = None
        times = worker.timeline.take_times()
        if topo.is_attention and record is not None:
            with worker.timeline.span("emit", "comm"):
                channel.emit(updates, record)
        if balance is not None and balance.due() and not balance.in_transition:
            balance.begin()


def _with_members(stats: dict, me: _Rank) -> dict:
    """A rank's stats with the job's membership when it runs fault-tolerant."""
    if me.cfg.parallel.fault_tolerance:
        stats["membership"] = me.members.stats()
    return stats


def _survivable(me: _Rank, error: Exception) -> bool:
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


def _recover(me: _Rank, error: Exception, channel: Channel) -> None:
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
        if me.topo.is_attention:
            me.worker.experts = RemoteExperts(me.transport, me.worker.timeline, me.balance.balancer)
        else:
            read = me.worker.adopt(me.topo, me.transport, placement)
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
    recovered = getattr(channel, "recovered", None)
    if recovered is not None:
        recovered(me.members.stats())


def _placement_without(
    me: _Rank, placement: Placement, lost: list[int], new_par: ParallelConfig, error: Exception
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


def _answer_rebalance(channel: Channel, balance: ExpertBalance | None) -> None:
    """Tells this rank's front end that the rebalance it asked for is in use everywhere."""
    channel.send_stats({"rebalanced": True, "stats": None if balance is None else balance.stats()})
