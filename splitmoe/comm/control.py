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

_COLUMNS = 9  # tokens, done, rebalance, ready, mail, publish, then `StepTimes` in nanoseconds


@dataclass(frozen=True)
class StepDecision:
    """``tokens[r]``: tokens attention rank ``r`` computes this step (0 for expert ranks);
    ``rebalance``: some rank asked for an expert rebalance, which every rank then starts before
    this iteration's step; ``ready``: every rank has the weights of the next placement staged
    (a rebalance in progress switches at such a step boundary); ``mail``: some rank has messages
    to relay (`StepSync.relay` runs on every rank; the job does not end while any is left);
    ``publish``: some rank's counters are due to go out, and every rank sends its own now (so a
    launched job relays all of them in one exchange, and the snapshots are of one moment);
    ``times[r]``: what rank ``r`` measured in the step before this exchange (zeros where it ran
    none), the same numbers on every rank, whatever each one's clock read."""

    tokens: tuple[int, ...]
    finished: bool
    rebalance: bool = False
    ready: bool = True
    mail: bool = False
    publish: bool = False
    times: tuple[StepTimes, ...] = ()

    @property
    def run(self) -> bool:
        return any(self.tokens)


class StepSync:
    """All-gathers ``(tokens this step, done, rebalance wanted, next placement staged, mail
    bytes, counters due, the previous step's times)`` from every rank over a CPU collective of
    the whole world (shared memory on one host, else the gloo group).

    Mail is how a launched job's server on rank 0 reaches ranks in other processes (see
    `splitmoe.llm.RelayChannel`): new requests, aborts and commands go out, token progress and
    stats come back. Only an iteration in which some rank has mail pays for a second collective,
    `relay`: one all-gather of the pickled mail over the gloo group ``objects``, padded to the
    longest (every size is known from the first)."""

    def __init__(
        self, group: Collective, world_size: int, objects: dist.ProcessGroup | None = None
    ):
        self.group = group
        self.world_size = world_size
        self.objects = objects
        self._out = torch.zeros(world_size, _COLUMNS, dtype=torch.int64)
        self._sizes: list[int] = []

    def exchange(
        self,
        tokens: int,
        done: bool,
        rebalance: bool = False,
        ready: bool = True,
        mail: int = 0,
        publish: bool = False,
        times: StepTimes | None = None,
    ) -> StepDecision:
        """``times``: what this rank measured in its last step (None: it ran none since the
        last exchange). Times travel as whole nanoseconds, so every rank decodes the same
        floats from them."""
        ns = (0, 0, 0) if times is None else (_ns(times.compute), _ns(times.comm), _ns(times.wait))
        if self.world_size == 1:  # nothing to agree on
            return StepDecision(
                tokens=(tokens,),
                finished=not tokens and done,
                rebalance=rebalance,
                ready=ready,
                publish=publish,
                times=(_times(ns),),
            )
        mine = torch.tensor(
            [tokens, int(done), int(rebalance), int(ready), mail, int(publish), *ns],
            dtype=torch.int64,
        )
        self.group.all_gather_single(self._out.view(-1), mine)
        rows = self._out.tolist()
        counts = tuple(r[0] for r in rows)
        self._sizes = [r[4] for r in rows]
        mail = any(self._sizes)
        return StepDecision(
            tokens=counts,
            finished=not any(counts) and all(r[1] for r in rows) and not mail,
            rebalance=any(r[2] for r in rows),
            ready=all(r[3] for r in rows),
            mail=mail,
            publish=any(r[5] for r in rows),
            times=tuple(_times(r[6:9]) for r in rows),
        )

    def relay(self, blob: bytes) -> list[bytes | None]:
        """Every rank's mail (``blob``: this rank's, of the size it gave `exchange`; None where
        a rank has none), in rank order; run by every rank after an `exchange` whose decision
        has ``mail``."""
        n = max(self._sizes)
        mine = torch.zeros(n, dtype=torch.uint8)
        if blob:
            mine[: len(blob)] = torch.frombuffer(bytearray(blob), dtype=torch.uint8)
        parts = [torch.empty(n, dtype=torch.uint8) for _ in range(self.world_size)]
        dist.all_gather(parts, mine, group=self.objects)
        return [
            parts[r][:size].numpy().tobytes() if size else None
            for r, size in enumerate(self._sizes)
        ]

    def warm_up(self, data_group: dist.ProcessGroup, comm_device: torch.device) -> None:
        """Opens every peer connection once at start-up (gloo connects lazily), so the first
        request does not pay for it."""
        self.exchange(0, False)
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
    ``timeout_s`` has passed since its own check-in: a rank silent that long (exited, stopped,
    hung, or on a host gone quiet) is left out. Then it proposes the ranks that checked in,
    less those any of them saw exit, with one compare-and-set of the membership key: the first
    proposal stands, and every survivor adopts the stored one (a survivor still waiting adopts
    it as soon as it appears). No rank leads, so no rank's silence (rank 0's included) can
    stall the others; the store is a single server, so the compare-and-set has one winner.

    The window is the same bound the survivors' own detection has: each leaves its step within
    ``timeout_s`` of its last progress, and after a failure every survivor stops progressing
    within a layer of the others, so they all check in within ``timeout_s`` of the first one.
    A rank that checks in after the membership was set (a frozen one woken late) finds itself
    left out and raises `RankEvicted`."""
    prefix = f"splitmoe-membership-{epoch}/"
    key = f"{prefix}members"
    store.set(f"{prefix}here/{rank}", ",".join(map(str, gone)))
    deadline = time.monotonic() + timeout_s
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
