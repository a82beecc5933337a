"""Process-group setup: one data-plane group (NCCL on distinct GPUs, else gloo) and one gloo group
for the small control messages that decide every step; on a CPU data plane, the shared-memory hub
that carries the collectives of ranks sharing a host (`splitmoe.comm.shm`)."""

from __future__ import annotations

import os
import socket
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from splitmoe.comm.shm import DATA_CAPACITY, ShmHub, ShmLane, process_alive


@dataclass(frozen=True)
class Groups:
    """``data``: token traffic; ``cpu``: control plane (gloo, CPU tensors).

    ``comm_device`` is where data-plane tensors must live: the GPU under NCCL, the CPU under gloo
    (several ranks sharing one GPU fall back to gloo, staging through host memory). ``hub``: the
    shared-memory hub when the data plane is on the CPU and shared memory is allowed, else None.
    """

    data: dist.ProcessGroup
    cpu: dist.ProcessGroup
    comm_device: torch.device
    hub: ShmHub | None = None
    # fault tolerance: the job's rendezvous store (a fresh rendezvous of the survivors meets
    # there under a new prefix) and every rank's (host, pid), to tell who is gone
    store: dist.Store | None = None
    where: tuple[tuple[str, int], ...] = ()

    def gone(self, me: int) -> list[int]:
        """Ranks of this host whose process has exited (``me``: this rank, never counted)."""
        if not self.where:
            return []
        host = self.where[me][0]
        return [
            r for r, (h, pid) in enumerate(self.where)
            if r != me and h == host and not process_alive(pid)
        ]  # fmt: skip


class DistGroup:
    """A ``torch.distributed`` group behind the collective calls the runtime makes, the same as
    `ShmLane`'s, so callers need not know which one carries them."""

    def __init__(self, group: dist.ProcessGroup, ranks: Sequence[int]):
        self.group = group
        self.ranks = list(ranks)

    def all_to_all_single(
        self, output, input, output_split_sizes=None, input_split_sizes=None, async_op=False
    ):
        return dist.all_to_all_single(
            output,
            input,
            output_split_sizes,
            input_split_sizes,
            group=self.group,
            async_op=async_op,
        )

    def all_gather_single(self, output: torch.Tensor, input: torch.Tensor) -> None:
        dist.all_gather_into_tensor(output, input, group=self.group)

    def all_gather_from(
        self, output: torch.Tensor, input: torch.Tensor, senders: Sequence[int]
    ) -> None:
        """`ShmLane.all_gather_from`: one all-gather in which the members not in ``senders``
        contribute zeros."""
        me = self.ranks.index(dist.get_rank())
        dist.all_gather_into_tensor(
            output, input if me in senders else torch.zeros_like(input), group=self.group
        )

    def all_to_all_counted(
        self, input: torch.Tensor, input_split_sizes: list[int], senders: list[int]
    ) -> tuple[torch.Tensor, list[int]]:
        """`ShmLane.all_to_all_counted`: a count all-to-all, then the rows (every member takes
        part in both; only the members in ``senders`` have rows to send)."""
        send = torch.tensor(input_split_sizes, dtype=torch.int64, device=input.device)
        recv = torch.empty_like(send)
        self.all_to_all_single(recv, send)
        counts = recv.tolist()
        output = input.new_empty((sum(counts), *input.shape[1:]))
        self.all_to_all_single(output, input, counts, input_split_sizes)
        return output, counts


Collective = DistGroup | ShmLane


def new_collective(
    ranks: Sequence[int],
    hub: ShmHub | None,
    timeout: timedelta,
    capacity: int = DATA_CAPACITY,
    group: dist.ProcessGroup | None = None,
    max_spin_s: float | None = None,
) -> Collective | None:
    """The collective of ``ranks`` for this rank (None if it is not a member): over shared memory
    when ``hub`` says they share a host (``max_spin_s``: see `ShmHub.lane`), else over a
    ``torch.distributed`` group (``group``, or a new one). Every world rank calls it, in the
    same order, like ``dist.new_group``."""
    if group is None:
        group = dist.new_group(list(ranks), timeout=timeout)
    lane = hub.lane(ranks, capacity, max_spin_s) if hub is not None else None
    if lane is not None:
        return lane
    return DistGroup(group, ranks) if dist.get_rank() in ranks else None


def rank_device(device_type: str, local_rank: int) -> torch.device:
    if device_type == "cuda":
        return torch.device("cuda", local_rank % torch.cuda.device_count())
    return torch.device("cpu")


HOSTED_STORE = "splitmoe-store://"  # an init_method naming a store that a front end hosts


def hosted_store(host: str, timeout: timedelta) -> tuple[dist.TCPStore, str]:
    """A rendezvous store served by this process (a front end that spawns its ranks), and the
    ``init_method`` that makes `init_groups` join it as a client: with fault tolerance, so that
    losing rank 0 (where ``tcp://`` puts the store) does not take the store with it."""
    store = dist.TCPStore(host, 0, is_master=True, wait_for_workers=False, timeout=timeout)
    return store, f"{HOSTED_STORE}{host}:{store.port}"


def init_groups(
    rank: int,
    world_size: int,
    init_method: str,
    device: torch.device,
    local_world_size: int,
    timeout: timedelta,
    shared_memory: bool = True,
    spin_s: float = 0.0,
    fault_tolerance: bool = False,
) -> Groups:
    """Joins the job. NCCL only when every rank of a node has a GPU of its own; a shared-memory
    hub when the data plane is on the CPU and ``shared_memory`` allows it (``spin_s``: its
    waits' polling, see `ShmHub`). ``fault_tolerance``: keeps the rendezvous store and every
    rank's (host, pid) for `rejoin`, and the hub's waits watch every rank of the host."""
    return _join(
        rank, world_size, device, local_world_size, timeout, shared_memory, spin_s,
        fault_tolerance, init_method=init_method,
    )  # fmt: skip


def rejoin(
    groups: Groups,
    epoch: int,
    rank: int,
    world_size: int,
    device: torch.device,
    local_world_size: int,
    timeout: timedelta,
    shared_memory: bool = True,
    spin_s: float = 0.0,
) -> Groups:
    """A fresh rendezvous of the survivors after a failure (fault tolerance): every survivor
    destroys its process groups (whose dead member can never answer again) and joins a new
    world of ``world_size`` ranks, as ``rank``, over the old job's store under the prefix of
    recovery ``epoch`` (the same on every survivor); the shared-memory hub is rebuilt too (new
    lanes, new segment names). The hub's old lanes must be closed by the caller first."""
    if groups.store is None:
        raise ValueError("rejoin needs the groups of a job started with fault_tolerance=True")
    if dist.is_initialized():
        dist.destroy_process_group()
    store = dist.PrefixStore(f"splitmoe-recovery-{epoch}/", groups.store)
    return _join(
        rank, world_size, device, local_world_size, timeout, shared_memory, spin_s, True,
        store=store, base_store=groups.store,
    )  # fmt: skip


def _join(
    rank: int,
    world_size: int,
    device: torch.device,
    local_world_size: int,
    timeout: timedelta,
    shared_memory: bool,
    spin_s: float,
    fault_tolerance: bool,
    init_method: str | None = None,
    store: dist.Store | None = None,
    base_store: dist.Store | None = None,
) -> Groups:
    use_nccl = device.type == "cuda" and local_world_size <= torch.cuda.device_count()
    backend = "nccl" if use_nccl else "gloo"
    kwargs = {"device_id": device} if use_nccl else {}
    if store is None and init_method.startswith(HOSTED_STORE):
        # the rendezvous store lives in the process that started the ranks (`hosted_store`),
        # not in rank 0: the job's recoveries meet on it whichever rank is lost
        host, _, port = init_method[len(HOSTED_STORE) :].rpartition(":")
        store = dist.TCPStore(host, int(port), is_master=False, timeout=timeout)
        base_store = store if fault_tolerance else None
    if store is not None:
        kwargs["store"] = store
    else:
        kwargs["init_method"] = init_method
    dist.init_process_group(backend, rank=rank, world_size=world_size, timeout=timeout, **kwargs)
    data = dist.group.WORLD
    cpu = dist.new_group(backend="gloo", timeout=timeout) if use_nccl else data
    comm_device = device if use_nccl else torch.device("cpu")
    hub = (
        ShmHub(rank, world_size, cpu, timeout, spin_s, watch_all=fault_tolerance)
        if shared_memory and not use_nccl
        else None
    )
    where: tuple = ()
    if fault_tolerance:
        if base_store is None:  # (the store the launcher's rendezvous made: kept alive here)
            base_store = dist.distributed_c10d._get_default_store()
        everyone: list = [None] * world_size
        dist.all_gather_object(everyone, (socket.gethostname(), os.getpid()), group=cpu)
        where = tuple(everyone)
    return Groups(
        data=data, cpu=cpu, comm_device=comm_device, hub=hub, store=base_store, where=where
    )


def job_store(groups: Groups) -> dist.Store:
    """The job's rendezvous store, which every rank joined (where a launched job's ranks learn
    their front end's address, `engine.transport.FRONT_END_KEYS`)."""
    return groups.store or dist.distributed_c10d._get_default_store()


def shutdown_groups() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()
