"""The control plane's wire: ZeroMQ between the front end and each rank.

The front end binds one ROUTER socket (`FrontEndSocket`): ``ipc://`` in a private directory
when every rank runs on its host, ``tcp://`` on the address its peers reach when a launcher
(torchrun, mpirun) started ranks elsewhere. Each rank connects a DEALER socket
(`RankSocket`) of its own, directly: no rank relays for another. A rank's first message is
`protocol.Hello` with the job's token (a random string the front end hands its ranks); the
front end ignores every message from a peer that has not given it, so a stray or hostile
connection to a ``tcp://`` port steers nothing. Messages are single msgpack frames
(`protocol.encode`); each direction keeps its order. Sends never block: ZeroMQ's own thread
writes them (no high-water mark: a slow reader delays, it never drops or stalls a step).
"""

from __future__ import annotations

import logging
import os
import secrets
import shutil
import socket
import tempfile

import zmq

from splitmoe.engine import protocol
from splitmoe.engine.protocol import Command, Hello, Report

logger = logging.getLogger("splitmoe")

# Where a launched job's front end tells its other ranks (through the job's rendezvous store,
# which every rank has joined) its address and token.
FRONT_END_KEYS = ("splitmoe/front-end/address", "splitmoe/front-end/token")


def _socket(ctx: zmq.Context, kind: int, linger_ms: int) -> zmq.Socket:
    sock = ctx.socket(kind)
    sock.setsockopt(zmq.SNDHWM, 0)
    sock.setsockopt(zmq.RCVHWM, 0)
    sock.setsockopt(zmq.LINGER, linger_ms)
    return sock


def reachable_address(peer_host: str) -> str:
    """This host's address on the route to ``peer_host`` (what another host of the job reaches
    this one at; loopback for a local peer)."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect((peer_host, 9))  # (no packet is sent: this only picks the route)
            return s.getsockname()[0]
    except OSError:
        return "127.0.0.1"


class FrontEndSocket:
    """The front end's end: commands to ranks by rank number, their reports in arrival order.

    ``host`` None: an ``ipc://`` socket in a private temporary directory (every rank is a child
    on this host); else ``tcp://host:<port the OS picks>``."""

    def __init__(self, host: str | None = None):
        self.token = secrets.token_hex(16)
        self._ctx = zmq.Context(io_threads=1)
        self._sock = _socket(self._ctx, zmq.ROUTER, linger_ms=0)
        # (a command to a rank that is gone raises here instead of vanishing)
        self._sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
        self._dir = None
        if host is None:
            self._dir = tempfile.mkdtemp(prefix="splitmoe-")
            self.address = f"ipc://{os.path.join(self._dir, 'control')}"
            self._sock.bind(self.address)
        else:
            port = self._sock.bind_to_random_port(f"tcp://{host}")
            self.address = f"tcp://{host}:{port}"
        self._peers: dict[bytes, int] = {}  # identity -> rank, once it said Hello
        self._identity: dict[int, bytes] = {}
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)
        self._poller = zmq.Poller()
        self._poller.register(self._sock, zmq.POLLIN)
        self._poller.register(self._wake_r, zmq.POLLIN)
        self.ignored = 0  # messages from peers that gave no token (or not the job's)

    def send(self, rank: int, command: Command) -> bool:
        """False when rank ``rank`` cannot be reached (it never said Hello, or it is gone)."""
        identity = self._identity.get(rank)
        if identity is None:
            return False
        try:
            self._sock.send_multipart([identity, protocol.encode(command)], zmq.NOBLOCK)
        except zmq.ZMQError:  # (EHOSTUNREACH: the rank's socket is gone)
            return False
        return True

    def wake(self) -> None:
        """Ends a `receive` that waits, from any thread."""
        try:
            os.write(self._wake_w, b"\x01")
        except (BlockingIOError, OSError):  # (full: it rings already; closed: nobody waits)
            pass

    def receive(self, timeout: float) -> tuple[list[tuple[int, Report]], bool]:
        """The reports that arrived within ``timeout`` s (all of them once one did), each with
        its rank; and whether `wake` ended the wait. A message that is not a report raises
        `protocol.ProtocolError` naming the rank."""
        events = dict(self._poller.poll(max(0, int(timeout * 1000))))
        woken = self._wake_r in events
        if woken:
            try:
                os.read(self._wake_r, 1 << 16)
            except BlockingIOError:
                pass
        out = []
        while True:
            try:
                identity, data = self._sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return out, woken
            except ValueError:  # (not two frames: no rank of ours sends that)
                self.ignored += 1
                continue
            rank = self._peers.get(identity)
            try:
                report = protocol.decode_report(data)
            except protocol.ProtocolError as e:
                if rank is None:
                    self.ignored += 1
                    continue
                raise protocol.ProtocolError(f"rank {rank}: {e}") from None
            if isinstance(report, Hello):
                self._hello(identity, report)
            elif rank is not None:
                out.append((rank, report))
            else:
                self.ignored += 1

    def _hello(self, identity: bytes, hello: Hello) -> None:
        if not secrets.compare_digest(hello.token, self.token):
            self.ignored += 1
            logger.warning("a peer that claims to be rank %d gave the wrong token", hello.rank)
            return
        self._peers[identity] = hello.rank
        self._identity[hello.rank] = identity

    def close(self) -> None:
        self._sock.close(linger=0)
        self._ctx.term()
        for fd in (self._wake_r, self._wake_w):
            try:
                os.close(fd)
            except OSError:
                pass
        self._wake_w = -1
        if self._dir is not None:
            shutil.rmtree(self._dir, ignore_errors=True)


class RankSocket:
    """A rank's end: its reports out, its commands in. Reports sent before `close` are handed
    over within ``linger_s`` even if the rank exits right after."""

    def __init__(self, address: str, rank: int, token: str, linger_s: float = 5.0):
        self._ctx = zmq.Context(io_threads=1)
        self._sock = _socket(self._ctx, zmq.DEALER, linger_ms=int(linger_s * 1000))
        self._sock.setsockopt(zmq.IDENTITY, f"rank-{rank}-{secrets.token_hex(4)}".encode())
        self._sock.connect(address)
        self._sock.send(protocol.encode(Hello(rank, token)))

    def send(self, report: Report) -> None:
        self._sock.send(protocol.encode(report), zmq.NOBLOCK)

    def receive(self, timeout: float) -> list[Command]:
        """The commands that arrived within ``timeout`` s (all of them once one did)."""
        if timeout > 0 and not self._sock.poll(int(timeout * 1000)):
            return []
        out = []
        while True:
            try:
                data = self._sock.recv(zmq.NOBLOCK)
            except zmq.Again:
                return out
            out.append(protocol.decode_command(data))

    def close(self) -> None:
        self._sock.close()  # (with its linger: the last reports go out first)
        self._ctx.term()
