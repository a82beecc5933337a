"""How a rank process uses its host: CPU threads and cores, OpenMP's wait policy, and the C
heap; and which cores this process may run on."""

from __future__ import annotations

import ctypes
import os

import torch

from splitmoe.comm.topology import Topology
from splitmoe.config import EngineConfig


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
# libgomp's spin iterations (`rank_openmp_env`): seconds on x86. A bound on what an idle rank burns,
# not a tuned speed: the longer the spin, the faster (libgomp's default, ~10 ms, sleeps between the
# parallel regions of one decode step), up to spinning forever.
RANK_OMP_SPINCOUNT = 100_000_000


def rank_openmp_env(cfg: EngineConfig, local_ranks: int) -> dict[str, str]:
    """Environment for rank processes this host starts (before they load OpenMP): where each rank
    gets cores of its own and several threads, its OpenMP workers keep spinning between the parallel
    regions of a step instead of sleeping after libgomp's default ~10 ms and paying a wake-up per
    region, which costs a colocated CPU decode step a large part of its speed. Nothing where ranks
    share cores (a spinning worker would take a core from another rank) or where the user set the
    OpenMP wait policy."""
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
    VM: the page faults can take a CPU prefill step a third of its time or more.
    The price is that a rank keeps its peak heap. False where it does not apply (not glibc)."""
    try:
        libc = ctypes.CDLL("libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3
    return bool(mallopt(M_MMAP_THRESHOLD, 32 << 20)) and bool(mallopt(M_TRIM_THRESHOLD, 1 << 30))
