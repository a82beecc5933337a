"""The KV agent and the pull path as edges: each reader's own lease, bounded lifetimes and
parked blocks, and whatever a peer sends (a banner, the wrong JSON, no signature, a lease
pointing outside the pool, silence), one transfer fails and the rank keeps stepping."""

from __future__ import annotations

import os
import socket
import threading
import time

import msgspec
import pytest

pytest.importorskip("mooncake.engine")

from pd.kv_sides import BS, HungAgent, Side, run_prompt, schedule_until  # noqa: E402

from splitmoe.kv_transfer import KVTransferParams, PoolLayout, PullResult  # noqa: E402
from splitmoe.kv_transfer import agent as agent_mod  # noqa: E402
from splitmoe.kv_transfer.agent import (  # noqa: E402
    AGENT_WORKERS,
    AgentFault,
    Granted,
    Lease,
    NotFound,
    Ok,
    ParkedBlocks,
    Refused,
    Release,
    ask,
)
from splitmoe.kv_transfer.auth import reply_tag, sign, verify  # noqa: E402
from splitmoe.sampling_params import SamplingParams  # noqa: E402
from splitmoe.scheduler.request import RequestSpec  # noqa: E402

SECRET = os.environ["SPLITMOE_KV_SECRET"].encode()  # (tests/pd/conftest.py)


class Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


# ---- the book of parked blocks -------------------------------------------------------------


def test_each_reader_leases_its_own_entry_and_frees_only_it():
    """The same prompt parked twice under one key (two prompts of one request with the same
    text): each reader gets an entry of its own, and one reader's ``done`` never frees blocks
    another reader holds a lease on."""
    clock = Clock()
    book = ParkedBlocks(30.0, 100, clock)
    assert book.park("t", "k", [[1, 2]], 1) and book.park("t", "k", [[3, 4]], 1)
    a, b = book.lease("k", "A"), book.lease("k", "B")
    assert a[0] == [[1, 2]] and b[0] == [[3, 4]]
    assert isinstance(book.lease("k", "C"), str)  # both entries have their reader
    assert book.done("k", "A")
    assert book.take_released() == [[[1, 2]]] and book.num_blocks == 2
    assert book.lease("k", "B")[0] == [[3, 4]]  # B's lease stands, renewed
    assert book.done("k", "B") and book.take_released() == [[[3, 4]]]
    assert book.num_blocks == 0 and book.num_entries == 0
    assert not book.done("k", "B")  # (nothing left to be done with)


def test_n_readers_of_one_entry_each_count_once():
    clock = Clock()
    book = ParkedBlocks(30.0, 100, clock)
    book.park("t", "k", [[5, 6, 7]], 3)
    for r in "ABC":
        assert book.lease("k", r)[0] == [[5, 6, 7]]
    assert isinstance(book.lease("k", "D"), str)
    book.done("k", "A")
    book.done("k", "A")  # (a repeated done counts once)
    assert book.take_released() == [] and book.num_entries == 1
    assert isinstance(book.lease("k", "A"), str)  # done: no lease again
    book.done("k", "B")
    book.done("k", "C")
    assert book.take_released() == [[[5, 6, 7]]]


def test_leases_and_entries_have_bounded_lifetimes():
    """A lease lasts the timeout from each renewal and at most twice the timeout from its
    first; an entry takes new readers for the timeout, then waits only for live leases."""
    clock = Clock()
    book = ParkedBlocks(10.0, 100, clock)
    book.park("t", "k", [[1]], 2)
    clock.now += 9.0
    assert book.lease("k", "A")[1] == 10.0  # a fresh lease: the full timeout
    clock.now += 2.0  # past the entry's own deadline: a second reader is not taken
    assert isinstance(book.lease("k", "B"), str)
    held_until = 0.0
    while isinstance(got := book.lease("k", "A"), tuple):  # renewed just before it ends
        held_until = clock.now + got[1]
        clock.now += 8.0
    assert held_until == 100.0 + 9.0 + 20.0  # at most twice the timeout from its first lease
    book.take_released()  # (no live lease, no more readers: expired)
    assert book.num_entries == 0 and book.counters["kv_parked_expired"] == 1


def test_an_unleased_entry_expires_a_leased_one_waits_for_its_reader():
    clock = Clock()
    book = ParkedBlocks(10.0, 100, clock)
    book.park("t", "a", [[1]], 1)
    book.park("t", "b", [[2]], 1)
    clock.now += 5.0
    book.lease("b", "R")  # (holds until 115)
    clock.now += 5.5
    assert book.take_released() == [[[1]]]  # a expired; b is being read
    clock.now += 5.0
    assert book.take_released() == [[[2]]]  # b's lease ended


def test_parked_blocks_are_capped():
    book = ParkedBlocks(10.0, 5, Clock())
    assert book.park("t", "a", [[1, 2, 3]], 1)
    assert not book.park("t", "b", [[4, 5, 6]], 1)  # 6 > 5
    assert book.park("t", "c", [[4, 5]], 1) and book.num_blocks == 5
    assert book.counters["kv_park_refused"] == 1


def test_release_closes_a_transfer():
    clock = Clock()
    book = ParkedBlocks(30.0, 100, clock)
    book.park("t1", "a", [[1]], 2)
    book.park("t1", "b", [[2]], 1)
    book.park("t2", "c", [[3]], 1)
    book.lease("b", "R")
    assert book.release("t1") == 2
    assert book.take_released() == [[[1]]]  # b waits for its reader, c is another transfer
    assert isinstance(book.lease("a", "S"), str) and isinstance(book.lease("b", "S"), str)
    book.done("b", "R")
    assert book.take_released() == [[[2]]] and book.num_entries == 1


def test_the_parked_cap_frees_the_blocks_of_a_prompt_it_refuses():
    pre = Side(32)
    pre.connector.book.max_blocks = 4
    prompt = list(range(5, 5 + 19))  # 5 blocks
    run_prompt(pre, 1, prompt, {"transfer_id": "t", "do_remote_decode": True})
    assert pre.used() == 0 and pre.connector.num_parked == 0
    assert pre.connector.stats()["kv_park_refused"] == 1


# ---- the agent's side channel ----------------------------------------------------------------


def raw_exchange(address: str, data: bytes, timeout: float = 5.0) -> bytes:
    host, port = address.rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=timeout) as s:
        try:
            s.sendall(data)
            s.shutdown(socket.SHUT_WR)
        except OSError:  # (it closed already: what it said is still to be read)
            pass
        out = b""
        try:
            while chunk := s.recv(1 << 16):
                out += chunk
        except ConnectionResetError:  # (closed with what we sent unread)
            pass
    return out


def test_the_agent_answers_only_signed_well_formed_requests():
    pre = Side(32)
    prompt = list(range(5, 5 + 9))
    run_prompt(pre, 1, prompt, {"transfer_id": "t", "do_remote_decode": True})
    from splitmoe.kv_transfer import transfer_key

    key = transfer_key("t", prompt)
    addr = pre.connector.address
    body = msgspec.json.encode(Lease(key, "thief"))
    for line in (
        body,  # no tag
        b"1.0abc " + body,  # a made-up tag
        sign(b"another-deployments-secret", body).encode() + b" " + body,
        sign(SECRET, body, now=time.time() - 3600).encode() + b" " + body,  # stale
    ):
        reply = raw_exchange(addr, line + b"\n")
        assert b'"refused"' in reply and b"session" not in reply, reply[:200]
    for body in (b"[1,2]", b'{"type":"lease"}', b'{"type":"lease","key":"k","reader":"r","x":1}'):
        reply = raw_exchange(addr, sign(SECRET, body).encode() + b" " + body + b"\n")
        assert b'"refused"' in reply and b"malformed" in reply
    long = b"x" * (agent_mod.MAX_REQUEST_LINE + 10)
    assert raw_exchange(addr, long) == b""  # (closed: no answer to a line that long)
    # nothing was leased meanwhile: the one reader it waits for still gets it
    lease = ask(addr, Lease(key, "reader"), SECRET, time.monotonic() + 5)
    assert isinstance(lease, Granted) and pre.connector.stats()["kv_agent_refused"] >= 7
    assert isinstance(ask(addr, Lease(key, "other"), SECRET, time.monotonic() + 5), NotFound)
    assert isinstance(ask(addr, Release("t"), SECRET, time.monotonic() + 5), Ok)


def test_the_agent_serves_a_bounded_number_of_connections(monkeypatch):
    """Callers that connect and say nothing hold a worker for the I/O timeout at most; beyond
    `AGENT_WORKERS` of them a new connection is closed at once; then it serves again."""
    monkeypatch.setattr(agent_mod, "IO_TIMEOUT_S", 1.0)
    pre = Side(32)
    host, port = pre.connector.address.rsplit(":", 1)
    idle = [socket.create_connection((host, int(port))) for _ in range(AGENT_WORKERS)]
    time.sleep(0.3)
    extra = socket.create_connection((host, int(port)), timeout=5)
    t0 = time.monotonic()
    assert extra.recv(10) == b"" and time.monotonic() - t0 < 0.9  # closed, not queued
    time.sleep(1.2)  # the idle ones timed out
    assert all(s.recv(10) == b"" for s in idle)
    reply = ask(pre.connector.address, Release("none"), SECRET, time.monotonic() + 5)
    assert reply == Ok(released=0)
    for s in [*idle, extra]:
        s.close()


class FakeAgent:
    """A listener on a KV agent's port that answers every line with ``reply(tag)`` (the
    request's tag in: a reply may be signed with it) and then closes."""

    def __init__(self, reply):
        self.reply = reply
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.address = f"127.0.0.1:{self.sock.getsockname()[1]}"
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self):
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            with conn:
                data = conn.recv(1 << 16)
                tag = data.split(b" ", 1)[0].decode("ascii", "replace")
                try:
                    conn.sendall(self.reply(tag))
                except OSError:
                    pass

    def close(self):
        self.sock.close()


def signed(payload: bytes):
    return lambda tag: reply_tag(SECRET, tag, payload).encode() + b" " + payload + b"\n"


def _outside_the_pool(tag: str) -> bytes:
    pool = PoolLayout(1 << 20, 2, 2, 4, 512)
    lease = Granted("127.0.0.1:1", [pool], [[0, 1, 2, 99]], 30.0)
    return signed(msgspec.json.encode(lease))(tag)


GARBAGE = {
    "banner": lambda tag: b"SSH-2.0-OpenSSH_9.6\r\n",
    "json list": lambda tag: b"[1, 2, 3]\n",
    "json number": lambda tag: b"42\n",
    "unsigned lease": lambda tag: b'{"type":"granted","session":"h:1","pools":[],"tables":[]}\n',
    "signed list": signed(b"[1, 2]"),
    "signed wrong type": signed(b'{"type":"granted","session":7}'),
    "signed refusal": signed(b'{"type":"refused","message":"no"}'),
    "lease outside the pool": _outside_the_pool,
    "nothing": lambda tag: b"",
    "no newline": lambda tag: b'{"type":"ok"}',
    "binary": lambda tag: bytes(range(256)) + b"\n",
}


@pytest.mark.parametrize("kind", sorted(GARBAGE))
def test_a_garbage_agent_reply_fails_that_pull_alone(kind):
    """The request whose prefill side answers garbage computes its prompt here; another
    request keeps stepping meanwhile; nothing raises into the scheduler; nothing leaks."""
    fake = FakeAgent(GARBAGE[kind])
    dec = Side(32, timeout=3.0)
    prompt = list(range(5, 5 + 13))
    kv = {"transfer_id": "g", "do_remote_prefill": True, "remote_agents": [fake.address]}
    local = dec.sched.add(RequestSpec(2, prompt, SamplingParams(), 0.0))
    pulled = dec.sched.add(RequestSpec(1, prompt, SamplingParams(kv_transfer_params=kv), 0.0))
    schedule_until(dec, lambda: pulled in dec.sched.running)
    assert pulled.num_computed_tokens == 0 and local in dec.sched.running
    assert dec.connector.counters["kv_transfer_failures"] == 1
    dec.sched.abort(1)
    dec.sched.abort(2)
    assert dec.used() == 0
    fake.close()


def test_remote_agents_are_bounded_and_a_pull_has_one_deadline():
    with pytest.raises(ValueError, match="at most 16"):
        KVTransferParams("t", do_remote_prefill=True, remote_agents=("127.0.0.1:1",) * 17)
    hung = [HungAgent() for _ in range(16)]
    dec = Side(32, timeout=1.0)
    kv = {"transfer_id": "h", "do_remote_prefill": True, "remote_agents": [h.address for h in hung]}
    prompt = list(range(5, 5 + 2 * BS))
    req = dec.sched.add(RequestSpec(1, prompt, SamplingParams(kv_transfer_params=kv), 0.0))
    t0 = time.monotonic()
    schedule_until(dec, lambda: req in dec.sched.running)
    assert time.monotonic() - t0 < 3.0  # one deadline for the whole pull, not 16 of them
    assert req.num_computed_tokens == 0
    for h in hung:
        h.close()


def test_a_pull_past_the_schedulers_deadline_is_abandoned():
    """A read that never ends (a peer's transfer engine hanging) does not hold its request:
    it computes its prompt in blocks of its own; the blocks the read may still write go back
    only when it ends."""
    dec = Side(32, timeout=0.5)
    gate = threading.Event()
    dec.connector.pull = lambda *a: (gate.wait(30), PullResult(False))[1]
    kv = {"transfer_id": "s", "do_remote_prefill": True, "remote_agents": ["127.0.0.1:9"]}
    prompt = list(range(5, 5 + 2 * BS))
    req = dec.sched.add(RequestSpec(1, prompt, SamplingParams(kv_transfer_params=kv), 0.0))
    dec.sched.schedule()
    held = dec.used()
    req.kv_pull_deadline = time.monotonic()  # (its deadline, reached)
    batch = dec.sched.schedule()
    assert batch.requests == [req] and req.num_computed_tokens == 0
    assert dec.used() == 2 * held  # its own blocks, and the abandoned ones still held
    dec.sched.abort(1)
    gate.set()
    schedule_until(dec, lambda: not dec.sched.abandoned)
    assert dec.used() == 0 and not dec.sched.has_work


def test_signatures():
    tag = sign(SECRET, b"body")
    assert verify(SECRET, tag, b"body") and not verify(SECRET, tag, b"bodY")
    assert not verify(None, tag, b"body") and not verify(SECRET, None, b"body")
    assert not verify(SECRET, "nan." + tag.split(".", 2)[-1], b"body")
    with pytest.raises(AgentFault):
        ask("127.0.0.1:9", Release("t"), SECRET, time.monotonic() - 1)
    assert isinstance(Refused("x"), Refused)
