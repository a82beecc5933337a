"""Every message between the front end and the ranks, declared once.

The front end (`engine.client.EngineClient`, under `LLM` and the server) and each rank
(`engine.channel.RankChannel`) exchange these structs, encoded by one msgpack encoder and
decoded by one typed decoder per direction (`encode`, `decode_command`, `decode_report`) over
ZeroMQ (`engine.transport`). A message that is not one of these, or one with a field of the
wrong type, is a `ProtocolError` that names what arrived, never a silent close. A new ability
adds a struct or a field here, never a column to a positional row.

Front end -> rank (`Command`): requests to add, ids to abort, queries (stats, a trace, a
rebalance) each with a correlation id answered by its own reply, how often to report, close.
Rank -> front end (`Report`): ready, each step's output, answers, published counters,
recoveries, evictions, errors, exit.

Tensor data never travels here: the ranks exchange it through their transports (`comm/`).
"""

from __future__ import annotations

from typing import Any

import msgspec

from splitmoe.metrics import StepRecord
from splitmoe.outputs import RequestMetrics
from splitmoe.scheduler.request import RequestSpec
from splitmoe.timeline import Span

# ---- front end -> rank -------------------------------------------------------------------------


class AddRequests(msgspec.Struct, tag=True):
    requests: list[RequestSpec]


class AbortRequests(msgspec.Struct, tag=True):
    request_ids: list[int]


class Wake(msgspec.Struct, tag=True):
    """Work arrived for another rank: join the next step sync now."""


class StatsQuery(msgspec.Struct, tag=True):
    id: int


class TraceQuery(msgspec.Struct, tag=True):
    id: int


class RebalanceQuery(msgspec.Struct, tag=True):
    """Recompute the expert placement (one attention rank is asked; the step sync tells all);
    answered once the new placement runs everywhere."""

    id: int


class Follow(msgspec.Struct, tag=True):
    """How often the front end reads step outputs: ``every_step`` False lets a rank hold them
    back until a request finishes (the front end then wakes once per finished request, not per
    step: it shares cores with the ranks)."""

    every_step: bool


class Close(msgspec.Struct, tag=True):
    """No more requests: leave once every rank is idle."""


Command = AddRequests | AbortRequests | Wake | StatsQuery | TraceQuery | RebalanceQuery
Command = Command | Follow | Close

# ---- rank -> front end -------------------------------------------------------------------------


class Hello(msgspec.Struct, tag=True):
    """A rank's first message on its socket: who it is, and the job's token (a peer that cannot
    give it is ignored)."""

    rank: int
    token: str


class Ready(msgspec.Struct, tag=True):
    rank: int
    role: str


class Finished(msgspec.Struct, array_like=True):
    """A request that finished in a step: ``index`` into the step's ``request_ids``."""

    index: int
    reason: str
    metrics: RequestMetrics
    error: str | None = None


# One token's log-probability and the most likely alternatives, `sampler.token_logprobs`'s entry
TokenLogprob = tuple[float, list[tuple[int, float]]]


class StepOutput(msgspec.Struct, tag=True):
    """One step of one attention rank (or, with ``record`` None, the final updates of requests
    refused or aborted outside a step): the new tokens of each advanced request, those that
    finished, their log-probabilities where asked."""

    rank: int
    request_ids: list[int]
    new_tokens: list[list[int]]
    finished: list[Finished] = []
    # per request: its new tokens' entries, None where it asked for none
    logprobs: list[list[TokenLogprob | None] | None] | None = None
    record: StepRecord | None = None


class Snapshot(msgspec.Struct, tag=True):
    """A rank's counters, published on its own (`runtime.STATS_PUBLISH_S`)."""

    rank: int
    counters: dict[str, Any]


class StatsReply(msgspec.Struct, tag=True):
    id: int
    rank: int
    stats: dict[str, Any]


class TraceReply(msgspec.Struct, tag=True):
    id: int
    rank: int
    role: str
    timeline: list[Span]


class RebalanceDone(msgspec.Struct, tag=True):
    id: int
    rank: int
    placement: dict[str, Any]


class Recovered(msgspec.Struct, tag=True):
    """The job lost ranks and goes on (fault tolerance): its new membership."""

    rank: int
    membership: dict[str, Any]


class Evicted(msgspec.Struct, tag=True):
    """A rank that woke after its peers went on without it (it exits)."""

    rank: int
    role: str
    message: str


class RankError(msgspec.Struct, tag=True):
    """A rank failed and exits: ``message`` is one line, ``traceback`` the whole story."""

    rank: int
    role: str
    message: str
    traceback: str = ""


class Exited(msgspec.Struct, tag=True):
    rank: int
    role: str


Report = Hello | Ready | StepOutput | Snapshot | StatsReply | TraceReply | RebalanceDone
Report = Report | Recovered | Evicted | RankError | Exited


class ProtocolError(RuntimeError):
    """Bytes that are not a message of this protocol (or not of the expected direction)."""


_encoder = msgspec.msgpack.Encoder()
_commands = msgspec.msgpack.Decoder(Command)
_reports = msgspec.msgpack.Decoder(Report)


def encode(message: Command | Report) -> bytes:
    return _encoder.encode(message)


def decode_command(data: bytes) -> Command:
    """A front end's command, or a `ProtocolError` that names what came instead."""
    return _decode(_commands, data, "command")


def decode_report(data: bytes) -> Report:
    """A rank's report, or a `ProtocolError` that names what came instead."""
    return _decode(_reports, data, "report")


def _decode(decoder: msgspec.msgpack.Decoder, data: bytes, what: str):
    try:
        return decoder.decode(data)
    except msgspec.DecodeError as e:
        head = bytes(data[:48])
        raise ProtocolError(f"not a {what} of the engine protocol ({e}): {head!r}") from None
