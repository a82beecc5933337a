"""Where a rank's work comes from and its results go: the `Channel` its loop talks to.

`Channel` is the abstract rank-side end; its optional abilities (answering queries, publishing
counters, reporting a recovery) have defaults, so a rank loop calls them on any channel.
`RankChannel` is the one a front end's ranks use: commands in and reports out over ZeroMQ
(`engine.transport.RankSocket`), in the declared messages of `engine.protocol`. The batch
launcher (`splitmoe.launch`) has a channel of its own with no front end at all.
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from dataclasses import dataclass, field

from splitmoe.comm.topology import Topology
from splitmoe.engine.protocol import (
    AbortRequests,
    AddRequests,
    Close,
    Evicted,
    Exited,
    Finished,
    Follow,
    RankError,
    Ready,
    RebalanceDone,
    RebalanceQuery,
    Recovered,
    Report,
    Snapshot,
    StatsQuery,
    StatsReply,
    StepOutput,
    TraceQuery,
    TraceReply,
    Wake,
)
from splitmoe.engine.transport import FRONT_END_KEYS, RankSocket
from splitmoe.metrics import StepRecord
from splitmoe.scheduler.request import RequestSpec

# A rank that holds its step outputs back (`protocol.Follow`) sends them at the latest this
# long after the first of them, or when this many wait: what the front end reads late, as a
# pipe that nobody waits on would hold it.
HOLD_S = 0.1
HOLD_MAX = 64


@dataclass
class Inbox:
    """What a rank found in its channel since its last look."""

    requests: list[RequestSpec] = field(default_factory=list)
    aborts: list[int] = field(default_factory=list)  # request ids to drop at once
    stats: list[int] = field(default_factory=list)  # ids of stats queries to answer
    traces: list[int] = field(default_factory=list)  # ids of trace queries to answer
    rebalances: list[int] = field(default_factory=list)  # answered once the switch is done

    def __bool__(self) -> bool:
        return bool(self.requests or self.aborts or self.stats or self.traces or self.rebalances)


class Channel(ABC):
    """A rank's end of its front end (or its launcher's input)."""

    @property
    @abstractmethod
    def closed(self) -> bool:
        """True once no more requests will arrive (always, for expert ranks)."""

    @abstractmethod
    def poll(self, timeout: float) -> Inbox:
        """New requests and queries; waits up to ``timeout`` seconds when there are none."""

    @abstractmethod
    def emit(self, updates: list, record: StepRecord | None) -> None:
        """Tokens produced by one step (`RequestUpdate`s), and the step's record (None: final
        updates of requests refused or aborted outside a step)."""

    def connect(self, store) -> None:
        """The rank joined its job (``store``: the job's rendezvous store); before `ready`."""

    def ready(self, topo: Topology) -> None:
        """This rank has joined the job and loaded its weights."""

    @property
    def publishes(self) -> bool:
        """Whether a front end keeps this rank's counters (`publish`)."""
        return False

    def publish(self, counters: dict) -> None:
        """This rank's counters, sent on its own (`runtime.STATS_PUBLISH_S`)."""

    def answer_stats(self, query_id: int, stats: dict) -> None:
        """The answer to a stats query."""

    def answer_trace(self, query_id: int, role: str, timeline: list) -> None:
        """The answer to a trace query."""

    def rebalanced(self, query_id: int, placement: dict) -> None:
        """The rebalance asked by query ``query_id`` runs on every rank now."""

    def recovered(self, membership: dict) -> None:
        """The job lost ranks and goes on without them (fault tolerance)."""

    def evicted(self, role: str, message: str) -> None:
        """This rank woke after its peers went on without it; it exits."""

    def failed(self, role: str, message: str, traceback: str) -> None:
        """This rank failed and exits."""

    def close(self, role: str) -> None:
        """This rank leaves the job normally."""


class RankChannel(Channel):
    """The channel of a rank whose front end is an `EngineClient`: over ZeroMQ, directly to
    it wherever this rank runs (``address`` and ``token``: the front end's socket and the job's
    token; for a rank a launcher started elsewhere, read from the job's store in `connect`)."""

    def __init__(
        self,
        rank: int,
        takes_requests: bool,
        address: str | None = None,
        token: str | None = None,
        announce: bool = False,
    ):
        self.rank = rank
        self._closed = not takes_requests
        self._address, self._token, self._announce = address, token, announce
        self._socket: RankSocket | None = None
        self._every_step = True
        self._held: list[StepOutput] = []
        self._held_since = 0.0
        if address is not None:
            self._socket = RankSocket(address, rank, token)

    def connect(self, store) -> None:
        address_key, token_key = FRONT_END_KEYS
        if self._announce:  # (the rank its front end spawned tells the launcher's others)
            store.set(address_key, self._address)
            store.set(token_key, self._token)
        elif self._socket is None:  # (a launched rank: its front end announced where it is)
            store.wait([address_key, token_key])
            address = store.get(address_key).decode()
            token = store.get(token_key).decode()
            self._socket = RankSocket(address, self.rank, token)

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def publishes(self) -> bool:
        return True

    def poll(self, timeout: float) -> Inbox:
        inbox = Inbox()
        if self._held:
            self._release_held(due_only=True)
            if self._held:
                timeout = min(timeout, HOLD_S)
        for command in self._socket.receive(timeout):
            self._take(inbox, command)
        return inbox

    def _take(self, inbox: Inbox, command) -> None:
        if isinstance(command, AddRequests):
            inbox.requests.extend(command.requests)
        elif isinstance(command, AbortRequests):
            inbox.aborts.extend(command.request_ids)
        elif isinstance(command, StatsQuery):
            inbox.stats.append(command.id)
        elif isinstance(command, TraceQuery):
            inbox.traces.append(command.id)
        elif isinstance(command, RebalanceQuery):
            inbox.rebalances.append(command.id)
        elif isinstance(command, Follow):
            self._every_step = command.every_step
            if command.every_step:
                self._release_held(due_only=False)
        elif isinstance(command, Close):
            self._closed = True
        else:  # (`Wake`: work arrived for another rank; the next sync comes now anyway)
            assert isinstance(command, Wake), command

    def emit(self, updates: list, record: StepRecord | None) -> None:
        finished, logprobs = [], None
        for i, u in enumerate(updates):
            if u.metrics is not None:
                finished.append(Finished(i, u.finish_reason, u.metrics, u.error))
        if any(u.logprobs for u in updates):
            logprobs = [u.logprobs for u in updates]
        out = StepOutput(
            self.rank,
            [u.request_id for u in updates],
            [u.new_token_ids for u in updates],
            finished,
            logprobs,
            record,
        )
        if self._every_step or finished or record is None:
            self._release_held(due_only=False)
            self._send(out)
            return
        if not self._held:
            self._held_since = time.monotonic()
        self._held.append(out)
        self._release_held(due_only=True)

    def _release_held(self, due_only: bool) -> None:
        if not self._held:
            return
        if due_only and len(self._held) < HOLD_MAX:
            if time.monotonic() - self._held_since < HOLD_S:
                return
        held, self._held = self._held, []
        for out in held:
            self._send(out)

    def _send(self, report: Report) -> None:
        self._socket.send(report)

    def ready(self, topo: Topology) -> None:
        self._send(Ready(self.rank, topo.role))

    def publish(self, counters: dict) -> None:
        self._send(Snapshot(self.rank, counters))

    def answer_stats(self, query_id: int, stats: dict) -> None:
        self._release_held(due_only=False)
        self._send(StatsReply(query_id, self.rank, stats))

    def answer_trace(self, query_id: int, role: str, timeline: list) -> None:
        self._send(TraceReply(query_id, self.rank, role, timeline))

    def rebalanced(self, query_id: int, placement: dict) -> None:
        self._send(RebalanceDone(query_id, self.rank, placement))

    def recovered(self, membership: dict) -> None:
        self._send(Recovered(self.rank, membership))

    def evicted(self, role: str, message: str) -> None:
        self._finish(Evicted(self.rank, role, message))

    def failed(self, role: str, message: str, traceback: str) -> None:
        self._finish(RankError(self.rank, role, message, traceback))

    def close(self, role: str) -> None:
        self._finish(Exited(self.rank, role))

    def _finish(self, last: Report) -> None:
        if self._socket is None:
            return
        self._release_held(due_only=False)
        self._send(last)
        self._socket.close()  # (its linger hands the last reports over)
        self._socket = None
