"""The KV agent: the side channel next to the bytes of a transfer.

A prefill rank *parks* a finished prompt's blocks in its `ParkedBlocks` book. Its agent (a small
TCP server, `KVAgent`) answers three requests, one JSON line each way, signed with the
deployment's secret (`splitmoe.kv_transfer.auth`):

* `Lease` ``(key, reader)`` -> `Granted` (where the blocks are, held for ``valid_s`` seconds)
  or `NotFound`: each reader holds a lease of its own on one parked entry; a prompt parked
  twice under one key (the same text twice in one request) is two entries, each with its own
  readers, so no reader's ``done`` frees blocks another still reads;
* `Done` ``(key, reader)`` -> `Ok`: that reader finished (or gave up); an entry's blocks go
  back when every reader it waits for is done, or when its time is over and no lease is live;
* `Release` ``(transfer_id)`` -> `Ok`: the router gave up on a transfer (the decode instance
  refused the request, or its client left): its entries take no new reader and go back as
  soon as no lease on them is live.

Everything a peer sends is bounded and checked before it is used: the line's length, the
signature, the message's type and every field's type and range (msgspec), the time a
connection may take, the connections served at once. A request that fails any check gets a
`Refused` answer (or a closed connection) and changes nothing. `ask` is the reader's side, with
the same checks on the answer: whatever a peer does, a caller gets a reply of a declared type
or an `AgentFault`.
"""

from __future__ import annotations

import logging
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Annotated

import msgspec

from splitmoe.kv_transfer import PoolLayout
from splitmoe.kv_transfer.auth import reply_tag, sign, verify, verify_reply

logger = logging.getLogger("splitmoe")

MAX_REQUEST_LINE = 4096  # a request is a key and a reader id: a few hundred bytes
MAX_REPLY_LINE = 1 << 24  # a lease lists every block of a prompt (16 MiB: ~1.5M block ids)
IO_TIMEOUT_S = 5.0  # one request and its answer, from the connection's start
MAX_MESSAGES_PER_CONNECTION = 16
AGENT_WORKERS = 8  # connections served at once; more are closed at once (the caller retries)
NULL_BLOCK = 0  # (the window pool's null block: `window_blocks.NULL_BLOCK`)

Key = Annotated[str, msgspec.Meta(min_length=1, max_length=256)]
ReaderId = Annotated[str, msgspec.Meta(min_length=1, max_length=64)]
TransferId = Annotated[str, msgspec.Meta(min_length=1, max_length=128)]
BlockId = Annotated[int, msgspec.Meta(ge=0, lt=1 << 40)]


# ---- messages --------------------------------------------------------------------------------


class Lease(msgspec.Struct, tag="lease", forbid_unknown_fields=True):
    key: Key
    reader: ReaderId


class Done(msgspec.Struct, tag="done", forbid_unknown_fields=True):
    key: Key
    reader: ReaderId


class Release(msgspec.Struct, tag="release", forbid_unknown_fields=True):
    transfer_id: TransferId


AgentRequest = Lease | Done | Release


class Granted(msgspec.Struct, tag="granted", forbid_unknown_fields=True):
    """Where a parked entry's blocks are: ``tables[p]`` of pool ``pools[p]`` on the Mooncake
    segment ``session``, not freed for ``valid_s`` seconds from the answer."""

    session: Annotated[str, msgspec.Meta(min_length=3, max_length=300)]
    pools: Annotated[list[PoolLayout], msgspec.Meta(min_length=1, max_length=4)]
    tables: Annotated[list[list[BlockId]], msgspec.Meta(min_length=1, max_length=4)]
    valid_s: Annotated[float, msgspec.Meta(ge=0.0, le=86400.0)]


class NotFound(msgspec.Struct, tag="not_found", forbid_unknown_fields=True):
    reason: Annotated[str, msgspec.Meta(max_length=300)] = ""


class Ok(msgspec.Struct, tag="ok", forbid_unknown_fields=True):
    released: Annotated[int, msgspec.Meta(ge=0)] = 0


class Refused(msgspec.Struct, tag="refused", forbid_unknown_fields=True):
    message: Annotated[str, msgspec.Meta(max_length=300)]


AgentReply = Granted | NotFound | Ok | Refused

_request_decoder = msgspec.json.Decoder(AgentRequest)
_reply_decoder = msgspec.json.Decoder(AgentReply)


class AgentFault(Exception):
    """A KV agent could not be asked, or its answer was not one (unreachable, slow, closed,
    unsigned, malformed, of the wrong type): fails that transfer alone."""


# ---- the prefill side's book of parked blocks ------------------------------------------------


@dataclass
class _Reader:
    first: float  # when its first lease began
    until: float  # its lease holds until then
    done: bool = False


@dataclass
class _Entry:
    transfer_id: str
    tables: list[list[int]]
    num_blocks: int
    capacity: int  # readers it waits for
    open_until: float  # new readers are taken until then
    readers: dict[str, _Reader] = field(default_factory=dict)

    def all_done(self) -> bool:
        return sum(r.done for r in self.readers.values()) >= self.capacity

    def leased(self, now: float) -> bool:
        return any(not r.done and r.until > now for r in self.readers.values())


def blocks_held(tables: list[list[int]]) -> int:
    """Blocks a set of per-pool tables holds (a window pool's null entries hold none)."""
    return len(tables[0]) + sum(b != NULL_BLOCK for t in tables[1:] for b in t)


class ParkedBlocks:
    """The prefill side's parked entries and their readers' leases (thread-safe: the agent's
    threads lease and release, the rank's step loop parks and frees).

    Bounds: an entry takes readers for ``timeout_s`` from its parking; a reader's lease lasts
    ``timeout_s`` from each renewal and at most ``2 * timeout_s`` from its first, so no entry
    outlives ``3 * timeout_s``; at most ``max_blocks`` blocks are parked at once (`park` says
    False beyond, and the caller frees the blocks)."""

    def __init__(self, timeout_s: float, max_blocks: int, clock=time.monotonic):
        self.timeout_s = timeout_s
        self.max_lease_s = 2 * timeout_s
        self.max_blocks = max_blocks
        self._clock = clock
        self._lock = threading.Lock()
        self._entries: dict[str, list[_Entry]] = {}
        self._released: list[list[list[int]]] = []
        self.num_blocks = 0
        self.counters = {"kv_parked_expired": 0, "kv_park_refused": 0, "kv_released_early": 0}

    @property
    def num_entries(self) -> int:
        with self._lock:
            return sum(len(v) for v in self._entries.values())

    def park(self, transfer_id: str, key: str, tables: list[list[int]], readers: int) -> bool:
        """Keeps ``tables`` readable under ``key`` for ``readers`` readers; False (nothing kept)
        when that would park more than ``max_blocks`` blocks."""
        n = blocks_held(tables)
        with self._lock:
            if self.num_blocks + n > self.max_blocks:
                self.counters["kv_park_refused"] += 1
                return False
            entry = _Entry(
                transfer_id, [list(t) for t in tables], n, readers, self._clock() + self.timeout_s
            )
            self._entries.setdefault(key, []).append(entry)
            self.num_blocks += n
        return True

    def lease(self, key: str, reader: str) -> tuple[list[list[int]], float] | str:
        """``(tables, seconds the lease holds)`` for ``reader`` (a new lease, or its own
        renewed), or why not."""
        now = self._clock()
        with self._lock:
            entries = self._entries.get(key, ())
            for e in entries:
                r = e.readers.get(reader)
                if r is not None:  # a renewal: capped by the lease's whole lifetime
                    if r.done:
                        return "this reader is done with the entry"
                    r.until = max(r.until, min(now + self.timeout_s, r.first + self.max_lease_s))
                    if r.until <= now:
                        return "the lease's lifetime is over"
                    return e.tables, r.until - now
            for e in entries:
                if len(e.readers) < e.capacity and e.open_until > now:
                    e.readers[reader] = _Reader(now, now + self.timeout_s)
                    return e.tables, self.timeout_s
        return "no parked entry under this key takes another reader"

    def done(self, key: str, reader: str) -> bool:
        """``reader`` is finished with its entry (the last one releases it); False when it holds
        no lease under ``key``."""
        with self._lock:
            entries = self._entries.get(key, [])
            for i, e in enumerate(entries):
                r = e.readers.get(reader)
                if r is None:
                    continue
                r.done, r.until = True, 0.0
                if e.all_done():
                    self._drop(key, i)
                return True
        return False

    def release(self, transfer_id: str) -> int:
        """Closes every entry of ``transfer_id`` to new readers; those without a live lease go
        back now, the others when their leases end. Returns how many entries it closed."""
        now = self._clock()
        closed = 0
        with self._lock:
            for key in list(self._entries):
                for e in self._entries[key]:
                    if e.transfer_id == transfer_id:
                        e.open_until = min(e.open_until, now)
                        closed += 1
            self.counters["kv_released_early"] += closed
        return closed

    def take_released(self) -> list[list[list[int]]]:
        """The tables of entries that are done, or whose time is over with no live lease (each
        returned once)."""
        now = self._clock()
        with self._lock:
            for key in list(self._entries):
                entries = self._entries[key]
                for i in reversed(range(len(entries))):
                    e = entries[i]
                    if e.open_until <= now and not e.leased(now):
                        self.counters["kv_parked_expired"] += not e.all_done()
                        self._drop(key, i)
            out, self._released = self._released, []
        return out

    def _drop(self, key: str, i: int) -> None:
        entries = self._entries[key]
        e = entries.pop(i)
        if not entries:
            del self._entries[key]
        self.num_blocks -= e.num_blocks
        self._released.append(e.tables)


# ---- the agent's server ----------------------------------------------------------------------


class KVAgent:
    """Answers `AgentRequest`s about ``book`` on ``host`` (a port the OS picks): a bounded pool
    of `AGENT_WORKERS` threads, each connection closed after `IO_TIMEOUT_S` or
    `MAX_MESSAGES_PER_CONNECTION` requests, lines over `MAX_REQUEST_LINE` refused, and nothing
    answered to a request not signed with ``secret``."""

    def __init__(
        self,
        host: str,
        book: ParkedBlocks,
        secret: bytes,
        session: str,
        pools: list[PoolLayout],
    ):
        self.book, self.secret = book, secret
        self.session, self.pools = session, list(pools)
        self.refused = 0  # requests answered `Refused` (unsigned, malformed, ...)
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self._sock = socket.socket(family, socket.SOCK_STREAM)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._sock.bind((host, 0))
        self._sock.listen(64)
        self._sock.settimeout(0.5)  # (how often the accept loop sees `close`)
        port = self._sock.getsockname()[1]
        self.address = f"[{host}]:{port}" if family == socket.AF_INET6 else f"{host}:{port}"
        self._slots = threading.BoundedSemaphore(AGENT_WORKERS)
        self._pool = ThreadPoolExecutor(AGENT_WORKERS, thread_name_prefix="kv-agent")
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._accept, daemon=True, name="kv-agent")
        self._thread.start()

    def _accept(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self._sock.accept()
            except TimeoutError:
                continue
            except OSError:
                return  # (closed)
            if not self._slots.acquire(blocking=False):
                conn.close()  # every worker busy: the caller tries again or fails its pull
                continue
            try:
                self._pool.submit(self._serve, conn)
            except RuntimeError:  # (shut down meanwhile)
                self._slots.release()
                conn.close()
                return

    def _serve(self, conn: socket.socket) -> None:
        deadline = time.monotonic() + IO_TIMEOUT_S
        try:
            with conn:
                buf = bytearray()
                for _ in range(MAX_MESSAGES_PER_CONNECTION):
                    line = read_line(conn, buf, MAX_REQUEST_LINE, deadline)
                    if line is None:
                        return
                    conn.sendall(self.answer(line))
        except (OSError, AgentFault):
            pass  # (a slow, silent or closed caller: its connection goes, nothing else)
        finally:
            self._slots.release()

    def answer(self, line: bytes) -> bytes:
        """The signed answer line to one request line."""
        tag, _, body = line.partition(b" ")
        tag_text = tag.decode("ascii", "replace")
        reply = self._reply(tag_text, body)
        if isinstance(reply, Refused):
            self.refused += 1
        payload = msgspec.json.encode(reply)
        return reply_tag(self.secret, tag_text, payload).encode() + b" " + payload + b"\n"

    def _reply(self, tag: str, body: bytes) -> AgentReply:
        if not verify(self.secret, tag, body):
            return Refused("not signed with this deployment's KV secret")
        try:
            msg = _request_decoder.decode(body)
        except msgspec.DecodeError as e:
            return Refused(f"malformed request: {str(e)[:200]}")
        if isinstance(msg, Lease):
            got = self.book.lease(msg.key, msg.reader)
            if isinstance(got, str):
                return NotFound(got)
            tables, valid = got
            return Granted(self.session, self.pools, tables, valid)
        if isinstance(msg, Done):
            return Ok() if self.book.done(msg.key, msg.reader) else NotFound("no such lease")
        return Ok(released=self.book.release(msg.transfer_id))

    def close(self) -> None:
        self._stop.set()
        try:
            self._sock.close()
        except OSError:
            pass
        self._thread.join(timeout=2)
        self._pool.shutdown(wait=False, cancel_futures=True)


# ---- the caller's side -----------------------------------------------------------------------


def read_line(sock: socket.socket, buf: bytearray, limit: int, deadline: float) -> bytes | None:
    """The next line (without its newline) from ``sock``, ``buf`` holding what was read past
    the last one; None at a clean end. An `AgentFault` past ``deadline`` (however slowly the
    peer drips bytes) or past ``limit`` bytes."""
    while True:
        end = buf.find(b"\n")
        if end >= 0:
            line = bytes(buf[:end])
            del buf[: end + 1]
            return line
        if len(buf) > limit:
            raise AgentFault(f"a line longer than {limit} bytes")
        left = deadline - time.monotonic()
        if left <= 0:
            raise AgentFault("no answer in time")
        sock.settimeout(left)
        try:
            chunk = sock.recv(min(1 << 20, limit + 1 - len(buf)))
        except TimeoutError:
            raise AgentFault("no answer in time") from None
        if not chunk:
            if buf:
                raise AgentFault("the connection closed mid-line")
            return None
        buf += chunk


def split_address(agent: str) -> tuple[str, int]:
    """``host:port`` (``[v6]:port`` too) as a socket address; ValueError when it is not one."""
    host, _, port = agent.rpartition(":")
    host = host.strip("[]")
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"{agent!r} is not host:port")
    return host, int(port)


def ask(agent: str, request: AgentRequest, secret: bytes, deadline: float) -> AgentReply:
    """Sends ``request`` to the agent at ``agent`` and returns its checked answer, all within
    ``deadline`` (`time.monotonic`); an `AgentFault` for anything else (unreachable, silent,
    closed, too long, unsigned, malformed, `Refused`)."""
    body = msgspec.json.encode(request)
    tag = sign(secret, body)
    left = deadline - time.monotonic()
    if left <= 0:
        raise AgentFault("no time left to ask")
    try:
        with socket.create_connection(split_address(agent), timeout=left) as s:
            s.settimeout(max(1e-3, deadline - time.monotonic()))
            s.sendall(tag.encode() + b" " + body + b"\n")
            line = read_line(s, bytearray(), MAX_REPLY_LINE, deadline)
    except (OSError, ValueError) as e:
        raise AgentFault(f"cannot reach it ({e})") from None
    if line is None:
        raise AgentFault("it closed the connection without an answer")
    got_tag, _, payload = line.partition(b" ")
    if not verify_reply(secret, tag, got_tag.decode("ascii", "replace"), payload):
        raise AgentFault("its answer is not signed with this deployment's KV secret")
    try:
        reply = _reply_decoder.decode(payload)
    except msgspec.DecodeError as e:
        raise AgentFault(f"malformed answer: {str(e)[:200]}") from None
    if isinstance(reply, Refused):
        raise AgentFault(f"it refused: {reply.message}")
    return reply
