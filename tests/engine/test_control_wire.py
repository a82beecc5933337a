"""The control plane's wire (`splitmoe.engine.transport`) and messages
(`splitmoe.engine.protocol`): a rank never blocks on a front end that reads late, every
message arrives once and in order, a peer without the job's token steers nothing, and bytes
that are not a message of the protocol are an error naming them, never a silent close."""

from __future__ import annotations

import threading
import time

import msgspec
import pytest
import zmq

from splitmoe.engine import protocol
from splitmoe.engine.channel import HOLD_S, RankChannel
from splitmoe.engine.protocol import (
    AbortRequests,
    AddRequests,
    Close,
    Finished,
    Follow,
    Hello,
    ProtocolError,
    Ready,
    StatsQuery,
    StepOutput,
)
from splitmoe.engine.transport import FrontEndSocket, RankSocket
from splitmoe.outputs import RequestMetrics
from splitmoe.sampling_params import SamplingParams
from splitmoe.scheduler.request import RequestSpec

METRICS = RequestMetrics(0.0, 0.1, 0.2, 0.01, 0.3, 4, 2)


def collect(front: FrontEndSocket, n: int, timeout: float = 10.0) -> list:
    got, deadline = [], time.monotonic() + timeout
    while len(got) < n and time.monotonic() < deadline:
        got += front.receive(0.1)[0]
    return got


def test_sends_never_block_and_every_report_arrives_once_in_order():
    front = FrontEndSocket()
    ranks = [RankSocket(front.address, r, front.token) for r in range(2)]
    tokens = [[i] * (i * 97 % 2003) for i in range(300)]  # up to ~16 KB a message
    t0 = time.monotonic()
    for r, sock in enumerate(ranks):  # (nobody reads meanwhile)
        for i, t in enumerate(tokens):
            sock.send(StepOutput(r, [i], [t]))
    assert time.monotonic() - t0 < 5, "a send waited for the reader"
    got = collect(front, 600)
    for r in range(2):
        mine = [m for rank, m in got if rank == r]
        assert [m.request_ids[0] for m in mine] == list(range(300))
        assert [m.new_tokens[0] for m in mine] == tokens
    for sock in ranks:
        sock.close()
    front.close()


def test_commands_reach_their_rank_and_a_gone_rank_is_reported():
    front = FrontEndSocket()
    rank = RankSocket(front.address, 3, front.token)
    assert not front.send(3, protocol.Wake())  # (it has not said Hello yet)
    rank.send(Ready(3, "attention"))
    assert collect(front, 1) == [(3, Ready(3, "attention"))]
    spec = RequestSpec(7, [1, 2], SamplingParams(max_tokens=3, stop=("x",)), 1.5)
    assert front.send(3, AddRequests([spec])) and front.send(3, AbortRequests([7]))
    got, deadline = [], time.monotonic() + 5
    while len(got) < 2 and time.monotonic() < deadline:
        got += rank.receive(0.1)
    assert got == [AddRequests([spec]), AbortRequests([7])]
    assert not front.send(5, Close())  # (no such rank)
    rank.close()
    front.close()


def test_receive_waits_its_timeout_and_wake_ends_it():
    front = FrontEndSocket()
    t = time.monotonic()
    assert front.receive(0.2) == ([], False)
    assert 0.19 <= time.monotonic() - t < 2
    threading.Timer(0.1, front.wake).start()
    t = time.monotonic()
    assert front.receive(10) == ([], True)
    assert time.monotonic() - t < 5
    front.close()


def test_a_peer_without_the_token_steers_nothing():
    front = FrontEndSocket()
    thief = RankSocket(front.address, 0, "not-the-token")
    thief.send(Ready(0, "attention"))
    ctx = zmq.Context()
    raw = ctx.socket(zmq.DEALER)
    raw.connect(front.address)
    raw.send(b"\x00garbage")  # (not even a message: ignored from a stranger)
    time.sleep(0.3)
    assert front.receive(0.3)[0] == [] and front.ignored >= 3
    assert not front.send(0, Close())
    raw.close(0)
    ctx.term()
    thief.close()
    front.close()


def test_a_rank_that_sends_no_message_of_the_protocol_is_named():
    front = FrontEndSocket()
    ctx = zmq.Context()
    raw = ctx.socket(zmq.DEALER)
    raw.connect(front.address)
    raw.send(protocol.encode(Hello(4, front.token)))
    raw.send(msgspec.msgpack.encode(("step", 4, [1, 2])))  # a tagged tuple of old
    with pytest.raises(ProtocolError, match="rank 4: not a report"):
        collect(front, 1)
    raw.close(0)
    ctx.term()
    front.close()


def test_every_message_round_trips_and_directions_are_checked():
    spec = RequestSpec(1, [5], SamplingParams(temperature=0.5, seed=3, logit_bias={3: 1.0}), 0.0)
    for cmd in (AddRequests([spec]), AbortRequests([1, 2]), StatsQuery(9), Follow(False)):
        assert protocol.decode_command(protocol.encode(cmd)) == cmd
        with pytest.raises(ProtocolError, match="not a report"):
            protocol.decode_report(protocol.encode(cmd))
    step = StepOutput(0, [1], [[4, 5]], [Finished(0, "length", METRICS)], [[(0.1, [])]])
    assert protocol.decode_report(protocol.encode(step)) == step
    with pytest.raises(ProtocolError, match="not a command"):
        protocol.decode_command(b"\x93\xa4step\x01\x02")


class _Update:
    def __init__(self, rid, tokens, finished=False):
        self.request_id, self.new_token_ids = rid, tokens
        self.metrics = METRICS if finished else None
        self.finish_reason = "length" if finished else None
        self.logprobs = self.error = None


def test_a_rank_holds_steps_back_until_a_request_finishes_when_asked():
    """`Follow(every_step=False)`: the front end wants finished requests only; a rank sends a
    step's output when one finished in it (with the held ones before it), or when they have
    waited `HOLD_S`: the front end wakes once per finished request, not per step."""
    front = FrontEndSocket()
    ch = RankChannel(0, True, front.address, front.token)
    front.receive(0.5)  # (its Hello)
    assert front.send(0, Follow(False))
    ch.poll(1.0)  # (takes the command)
    ch.emit([_Update(1, [7])], record=None)  # (outside a step: sent at once)
    ch.emit([_Update(1, [8])], record=_record())
    ch.emit([_Update(1, [9])], record=_record())
    assert [m.new_tokens for _, m in collect(front, 3, timeout=0.5)] == [[[7]]]
    ch.emit([_Update(1, [10], finished=True)], record=_record())
    got = collect(front, 3, timeout=2)
    assert [m.new_tokens for _, m in got] == [[[8]], [[9]], [[10]]]
    ch.emit([_Update(2, [1])], record=_record())
    time.sleep(HOLD_S * 1.5)
    ch.poll(0)  # (a rank's loop looks in every iteration: held ones that waited go out)
    assert [m.new_tokens for _, m in collect(front, 1)] == [[[1]]]
    ch.close("attention")
    front.close()


def _record():
    from splitmoe.metrics import StepRecord

    return StepRecord(0, 0.0, 1, 1, 1, 1, 8, 0, 0)
