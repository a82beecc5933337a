"""Collectives over shared memory, for the ranks of a group that share one host.

Over loopback TCP, gloo pays a fixed cost of the order of a hundred microseconds per
``all_to_all_single`` even for a few bytes, many times the cost of the data it moves at decode
batch sizes, and every MoE layer needs two to three of them per micro-batch. Ranks on one host
can instead write into each other's memory, which is what NVLink buffers are to GPU ranks
(DeepEP's intra-node kernels work the same way): a round trip through shared memory costs about
a tenth of gloo's, as it crosses no socket.

Layout: a group (a *lane*, `ShmLane`) gives each member an inbox, a file in ``/dev/shm`` holding
one single-producer single-consumer byte ring per source member. A ring has a monotonic write
position (advanced only by the source) and read position (advanced only by the owner) on separate
cache lines, then ``capacity`` data bytes. Every non-empty message is framed by its byte length,
which the receiver checks against what it expects, so diverging collective calls fail loudly
instead of mixing up data. (Zero-size shares carry no frame, so that an asynchronous send needs
nothing from its receivers: a rank that sends bytes where its peer expects none is caught at the
peer's next non-empty receive, not at this call.)

Sends never wait for the receiver unless its ring is full, so `all_to_all_single` with
``async_op=True`` (sends only) returns once the bytes are copied. A rank that must wait (ring
full, or data not there yet) moves whatever has arrived in all its rings into private staging
buffers while it waits, so two ranks sending each other more than a ring holds cannot deadlock
(the progress rule of MPI implementations). Waiting spins briefly, then sleeps on a futex on
the position the peer will move (a send always wakes its ring's futex; a reader wakes a writer
that sleeps on a full ring), so a waiting rank leaves its core to the ranks doing the work:
where ranks share cores, a spinning waiter takes cycles from the rank that computes. A rank that
has cores of its own (the runtime pinned it: ``spin_s``, `OWN_CORE_SPIN_S`) keeps polling for up
to ``spin_s`` before it sleeps, as MPI's busy polling does: waking a sleeping process can cost
on the order of 100 us in a VM, twice per layer when attention and experts take turns. A peer
whose process has exited, or that sent nothing for ``timeout``, ends the wait with an error
naming it.

The files are unlinked as soon as every member has mapped them, so nothing is left in
``/dev/shm`` however the job ends. Ordering relies on x86's total store order (data bytes are
written before the position that publishes them); `host_shm_supported` refuses other CPUs.

Here: `ShmHub`, the host's ranks and the registry of lanes. `ShmLane` (inbox files, frames and
the collectives) is in `splitmoe.comm.shm_lane`, one ring in `splitmoe.comm.shm_ring`, the
waiting (polls, futex sleeps, liveness and timeout checks) in `splitmoe.comm.shm_wait`.
"""

from __future__ import annotations

import os
import platform
import secrets
import socket
from collections.abc import Sequence
from datetime import timedelta

import torch.distributed as dist

from splitmoe.comm.shm_lane import SHM_DIR, ShmLane
from splitmoe.comm.shm_wait import process_alive

DATA_CAPACITY = 4 << 20  # bytes per ring on data lanes: several decode-step messages
CONTROL_CAPACITY = 4 << 10  # bytes per ring on control lanes (a few int64 per step)
COUNTS_CAPACITY = 256 << 10  # per-expert counts of every (layer, micro-batch) of a step
# How long a rank with cores of its own polls before it sleeps: a peer's answer within a layer
# then finds it awake, which saves the cost of waking a vCPU (a cost that grows with the host's
# load), with one micro-batch or two.
OWN_CORE_SPIN_S = 0.005
# The control lane's cap: a step-boundary wait longer than this sleeps (one wake-up per step; a
# decode step's boundary wait is of the order of a millisecond), so an idle job's expert rank
# polls less of its core than at the full `OWN_CORE_SPIN_S`.
CONTROL_SPIN_S = 0.002


def host_shm_supported() -> bool:
    """x86 (total store order) Linux with a writable ``/dev/shm``."""
    return (
        platform.machine().lower() in ("x86_64", "amd64")
        and os.path.isdir(SHM_DIR)
        and os.access(SHM_DIR, os.W_OK)
    )


def _host_id() -> str:
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = ""
    return f"{socket.gethostname()}/{boot}"


class ShmHub:
    """This rank's view of the host: which world ranks share it, their pids, and the job's key
    for naming inbox files. Built collectively (every world rank, same order) over ``group``;
    then `lane` builds the shared-memory collective of any group whose members share a host."""

    def __init__(
        self,
        rank: int,
        world_size: int,
        group: dist.ProcessGroup,
        timeout: timedelta,
        spin_s: float = 0.0,
        watch_all: bool = False,
    ):
        """``spin_s``: how long a wait polls before it sleeps (beyond the first `SPIN` polls);
        more than 0 only for a rank that has its cores to itself. ``watch_all``: a long wait
        also checks every other rank of the host, not only the peer it waits for (fault
        tolerance: a rank waiting on a live peer learns that a third one died, so every
        survivor leaves its step within `LIVENESS_S`)."""
        self.rank = rank
        self.timeout_s = timeout.total_seconds()
        self.spin_s = spin_s
        self.watch_all = watch_all
        key = [secrets.token_hex(6) if rank == 0 else None]
        dist.broadcast_object_list(key, src=0, group=group)
        self.key = key[0]
        # A rank that cannot use shared memory gets a host of its own: it shares no lane.
        host = _host_id() if host_shm_supported() else f"{_host_id()}/no-shm/{rank}"
        mine = (host, os.getpid())
        everyone: list = [None] * world_size
        dist.all_gather_object(everyone, mine, group=group)
        self.hosts = [h for h, _ in everyone]
        self.pids = [p for _, p in everyone]
        self.lanes: list[ShmLane] = []
        self._next_lane = 0

    def check_peers(self, what: str) -> None:
        """Raises RuntimeError if a rank of this host has exited (``what``: what this rank was
        waiting for)."""
        for r, (host, pid) in enumerate(zip(self.hosts, self.pids)):
            if r != self.rank and host == self.hosts[self.rank] and not process_alive(pid):
                raise RuntimeError(
                    f"rank {self.rank}: rank {r} (pid {pid}) exited while this rank waited "
                    f"for rank(s) to {what}"
                )

    def shares_host(self, ranks: Sequence[int]) -> bool:
        return len({self.hosts[r] for r in ranks}) == 1

    def lane(
        self, ranks: Sequence[int], capacity: int = DATA_CAPACITY, max_spin_s: float | None = None
    ) -> ShmLane | None:
        """The shared-memory collective of ``ranks`` (world ranks, in group order) for members;
        None for non-members or when the ranks do not share a host. Call it on every world rank
        in the same order (lane ids are counted everywhere), like ``dist.new_group``.
        ``max_spin_s``: caps the hub's ``spin_s`` on this lane."""
        if capacity < 64 or capacity % 64:
            raise ValueError(f"shared-memory lane capacity {capacity} must be a multiple of 64")
        lane_id = self._next_lane
        self._next_lane += 1
        ranks = list(ranks)
        if self.rank not in ranks or not self.shares_host(ranks):
            return None
        spin_s = self.spin_s if max_spin_s is None else min(self.spin_s, max_spin_s)
        lane = ShmLane(self, lane_id, ranks, capacity, spin_s)
        self.lanes.append(lane)
        return lane

    def progress(self) -> None:
        """Moves every byte that has arrived in any ring of this rank into staging."""
        for lane in self.lanes:
            lane.drain()

    def close(self) -> None:
        for lane in self.lanes:
            lane.close()
        self.lanes.clear()
