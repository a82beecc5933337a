"""The control plane: one small all-gather per step that every rank takes part in.

Whether a step runs, and whether the job ends, is decided from data all ranks share, never from
local state, so the collective pattern of the data plane can never diverge between ranks.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from splitmoe.comm.distributed import Collective
from splitmoe.timeline import StepTimes


@dataclass(frozen=True)
class StepRow:
    """What one rank tells every other before a step: ``tokens`` it computes this step (0 for
    expert ranks), ``done`` (no more requests will come and it has no work), ``rebalance`` (it
    asks for an expert rebalance), ``ready`` (the next placement's weights are staged),
    ``publish`` (its counters are due to go out), ``times`` (what it measured in its last
    step; None: it ran none since the last exchange)."""

    tokens: int = 0
    done: bool = True
    rebalance: bool = False
    ready: bool = True
    publish: bool = False
    times: StepTimes | None = None

    def encode(self) -> list[int]:
        t = self.times
        ns = (0, 0, 0) if t is None else (_ns(t.compute), _ns(t.comm), _ns(t.wait))
        flags = (self.done, self.rebalance, self.ready, self.publish)
        return [self.tokens, *map(int, flags), *ns]


_COLUMNS = len(StepRow().encode())


@dataclass(frozen=True)
class StepDecision:
    """What every rank decides alike from every rank's `StepRow`: ``tokens[r]`` attention rank
    ``r`` computes (0 for expert ranks); ``finished`` (every rank is done: all leave);
    ``rebalance`` (some rank asked: every rank starts it before this iteration's step);
    ``ready`` (every rank has the next placement staged: a rebalance in progress switches at
    such a step boundary); ``publish`` (some rank's counters are due: every rank sends its own
    now, so the snapshots are of one moment); ``times[r]``: what rank ``r`` measured in the
    step before this exchange (zeros where it ran none), the same numbers on every rank."""

    tokens: tuple[int, ...]
    finished: bool
    rebalance: bool = False
    ready: bool = True
    publish: bool = False
    times: tuple[StepTimes, ...] = ()

    @property
    def run(self) -> bool:
        return any(self.tokens)


class StepSync:
    """All-gathers every rank's `StepRow` over a CPU collective of the whole world (shared
    memory on one host, else the gloo group) and decides the step."""

    def __init__(self, group: Collective, world_size: int):
        self.group = group
        self.world_size = world_size
        self._out = torch.zeros(world_size, _COLUMNS, dtype=torch.int64)

    def exchange(self, row: StepRow) -> StepDecision:
        """Times travel as whole nanoseconds, so every rank decodes the same floats."""
        mine = row.encode()
        if self.world_size == 1:  # nothing to agree on
            rows = [mine]
        else:
            self.group.all_gather_single(self._out.view(-1), torch.tensor(mine, dtype=torch.int64))
            rows = self._out.tolist()
        counts = tuple(r[0] for r in rows)
        return StepDecision(
            tokens=counts,
            finished=not any(counts) and all(r[1] for r in rows),
            rebalance=any(r[2] for r in rows),
            ready=all(r[3] for r in rows),
            publish=any(r[4] for r in rows),
            times=tuple(_times(r[5:8]) for r in rows),
        )

    def warm_up(self, data_group: dist.ProcessGroup, comm_device: torch.device) -> None:
        """Opens every peer connection once at start-up (gloo connects lazily), so the first
        request does not pay for it."""
        self.exchange(StepRow(done=False))
        n = torch.zeros(self.world_size, dtype=torch.int64, device=comm_device)
        dist.all_to_all_single(torch.empty_like(n), n, group=data_group)


def _ns(seconds: float) -> int:
    return max(0, round(seconds * 1e9))


def _times(ns) -> StepTimes:
    return StepTimes(*(v / 1e9 for v in ns))


# How often a survivor polls the store while the membership of a recovery is being agreed.
_AGREE_POLL_S = 0.01


class RankEvicted(RuntimeError):
    """This rank was left out of the job's membership by a recovery: it checked in after the
    survivors had decided without it (it was stopped, hung or slow past the window). It must
    exit rather than rejoin; the survivors already go on without it."""


# How long a survivor waits for the others' check-ins after its own, in timeouts
WINDOW = 1.5


def agree_membership(
    store: dist.Store,
    epoch: int,
    rank: int,
    world_size: int,
    gone: list[int],
    timeout_s: float,
) -> list[int]:
    """The ranks (of the current world) that survive a failure, the same list on every survivor:
    the fault-tolerant control plane, over the job's rendezvous store rather than the process
    groups (which a lost member has broken).

    Every survivor checks in under recovery ``epoch``'s prefix with the ranks it saw exit
    (``gone``), then waits until every rank that no survivor saw exit has checked in, or until
    `WINDOW` times ``timeout_s`` has passed since its own check-in: a rank silent that long
    (exited, stopped, hung, or on a host gone quiet) is left out. Then it proposes the ranks
    that checked in, less those any of them saw exit, with one compare-and-set of the membership
    key: the first proposal stands, and every survivor adopts the stored one (a survivor still
    waiting adopts it as soon as it appears). No rank leads, so no rank's silence (rank 0's
    included) can stall the others; the store is a single server, so the compare-and-set has one
    winner.

    The window covers the survivors' own detection: each leaves its step within ``timeout_s`` of
    its last progress, but a survivor blocked in a send over gloo counts from the send's start,
    which came before the failure, while a peer on the lost rank's host sees its process exit at
    once: the last survivors check in up to about ``timeout_s`` after the first, and the window
    (1.5 ``timeout_s``) leaves them a margin (with exactly ``timeout_s`` a survivor was left out
    now and then, over gloo). A rank that checks in after the membership was set (a frozen one
    woken late) finds itself left out and raises `RankEvicted`."""
    prefix = f"splitmoe-membership-{epoch}/"
    key = f"{prefix}members"
    store.set(f"{prefix}here/{rank}", ",".join(map(str, gone)))
    deadline = time.monotonic() + WINDOW * timeout_s
    seen: dict[int, set[int]] = {}
    while not store.check([key]):
        for r in range(world_size):
            if r not in seen and store.check([f"{prefix}here/{r}"]):
                told = store.get(f"{prefix}here/{r}").decode()
                seen[r] = {int(x) for x in told.split(",") if x}
        dead = set(gone).union(*seen.values())
        waiting = [r for r in range(world_size) if r not in seen and r not in dead]
        if not waiting or time.monotonic() > deadline:
            proposal = ",".join(str(r) for r in sorted(seen) if r not in dead)
            store.compare_set(key, "", proposal)
            break
        time.sleep(_AGREE_POLL_S)
    members = [int(x) for x in store.get(key).decode().split(",") if x]
    if rank not in members:
        raise RankEvicted(
            f"rank {rank} was left out of the job's membership by recovery {epoch} "
            f"(members: {members}): it did not check in within the window (stopped, hung "
            "or slow); it exits rather than rejoin"
        )
    return members
