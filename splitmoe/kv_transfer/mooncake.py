"""`KVConnector` on Mooncake's transfer engine, with a JSON-lines side channel (the agent).

Each attention rank runs one `TransferEngine` (peer-to-peer handshake, no metadata service,
``tcp``) with its KV pools registered, and a small TCP server (the *agent*) that answers two
messages from decode instances:

* ``{"op": "lease", "key": K}`` -> ``{"found": true, "session": "host:port", "pools": [...],
  "tables": [[...], ...], "valid_s": S}``: where the parked blocks of ``K`` are, kept for the
  next ``S`` seconds at least;
* ``{"op": "done", "key": K}`` -> ``{"ok": true}``: one reader finished (or gave up); the last
  one releases the blocks.

The decode rank then reads the blocks itself (`TransferEngine.batch_transfer_sync_read`, on a
transfer thread: `KVConnector.start_pull`), runs of consecutive blocks coalesced into one read
per layer. Releases from the agent's thread are queued and freed by the rank's own step loop
(the block manager is not shared across threads).
"""

from __future__ import annotations

import json
import logging
import socket
import socketserver
import threading
import time
from dataclasses import asdict, dataclass

from splitmoe.kv_transfer import KVConnector, KVTransferParams, PoolLayout, PullResult

logger = logging.getLogger("splitmoe")

NULL_BLOCK = 0  # (the window pool's null block: `window_blocks.NULL_BLOCK`)
_MAX_LINE = 1 << 24  # a lease reply lists every block of a prompt: bounded all the same


@dataclass
class _Parked:
    tables: list[list[int]]
    readers: int
    deadline: float


class MooncakeConnector(KVConnector):
    def __init__(self, pools: list[PoolLayout], host: str, timeout_s: float):
        from mooncake.engine import TransferEngine

        self.pools = pools
        self.timeout_s = timeout_s
        self.engine = TransferEngine()
        rc = self.engine.initialize(host, "P2PHANDSHAKE", "tcp", "")
        if rc != 0:
            raise RuntimeError(f"Mooncake transfer engine failed to start on {host} (rc {rc})")
        for p in pools:
            size = p.num_layers * p.kv * p.num_blocks * p.block_bytes
            if self.engine.register_memory(p.addr, size) != 0:
                raise RuntimeError("Mooncake could not register the KV pool's memory")
        self.session = f"{host}:{self.engine.get_rpc_port()}"
        self._lock = threading.Lock()
        self._parked: dict[str, list[_Parked]] = {}
        self._released: list[list[list[int]]] = []
        self.counters = {
            "kv_transfers": 0,
            "kv_transfer_failures": 0,
            "kv_transfer_bytes": 0,
            "kv_transfer_seconds": 0.0,
            "kv_parked_expired": 0,
        }
        connector = self

        class Handler(socketserver.StreamRequestHandler):
            def handle(self) -> None:
                for line in self.rfile:
                    try:
                        reply = connector._answer(json.loads(line))
                    except Exception as e:  # a bad message fails that message alone
                        reply = {"error": f"{type(e).__name__}: {e}"}
                    self.wfile.write(json.dumps(reply).encode() + b"\n")

        class Server(socketserver.ThreadingTCPServer):
            daemon_threads = True
            allow_reuse_address = True

        self._server = Server((host, 0), Handler)
        self._address = f"{host}:{self._server.server_address[1]}"
        threading.Thread(target=self._server.serve_forever, daemon=True, name="kv-agent").start()

    @property
    def address(self) -> str:
        return self._address

    # ---- prefill side ----------------------------------------------------------------------

    def park(self, key: str, tables: list[list[int]], num_readers: int) -> None:
        entry = _Parked([list(t) for t in tables], num_readers, time.monotonic() + self.timeout_s)
        with self._lock:
            self._parked.setdefault(key, []).append(entry)

    def take_released(self) -> list[list[list[int]]]:
        now = time.monotonic()
        with self._lock:
            for key in list(self._parked):
                live = []
                for e in self._parked[key]:
                    if e.deadline <= now:
                        self._released.append(e.tables)
                        self.counters["kv_parked_expired"] += 1
                    else:
                        live.append(e)
                if live:
                    self._parked[key] = live
                else:
                    del self._parked[key]
            out, self._released = self._released, []
        return out

    def _answer(self, msg: dict) -> dict:
        op, key = msg.get("op"), msg.get("key")
        if not isinstance(key, str):
            return {"error": "key must be a string"}
        with self._lock:
            entries = self._parked.get(key)
            if op == "lease":
                if not entries:
                    return {"found": False}
                # a reader has the whole timeout from its lease: the blocks are not freed under
                # a read that began in time (and one that outlasts it is thrown away, `pull`)
                e = entries[0]
                e.deadline = max(e.deadline, time.monotonic() + self.timeout_s)
                return {
                    "found": True,
                    "session": self.session,
                    "pools": [asdict(p) for p in self.pools],
                    "tables": e.tables,
                    "valid_s": e.deadline - time.monotonic(),
                }
            if op == "done":
                if entries:
                    e = entries[0]
                    e.readers -= 1
                    if e.readers <= 0:
                        entries.pop(0)
                        self._released.append(e.tables)
                        if not entries:
                            del self._parked[key]
                return {"ok": True}
        return {"error": f"unknown op {op!r}"}

    @property
    def num_parked(self) -> int:
        with self._lock:
            return sum(len(v) for v in self._parked.values())

    # ---- decode side -----------------------------------------------------------------------

    def pull(
        self,
        params: KVTransferParams,
        key: str,
        tables: list[list[int]],
        first: list[int],
        last: int,
    ) -> PullResult:
        t0 = time.perf_counter()
        for agent in params.remote_agents:
            asked = time.monotonic()
            try:
                lease = _ask(agent, {"op": "lease", "key": key}, self.timeout_s)
            except OSError as e:
                result = PullResult(False, error=f"agent {agent}: {e}")
                continue
            if not lease.get("found"):
                result = PullResult(False, error=f"agent {agent}: key not found")
                continue
            try:
                result = self._read(lease, tables, first, last)
                if result.ok and time.monotonic() - asked >= float(lease["valid_s"]):
                    # the prefill side may have freed (and reused) the blocks under the read
                    result = PullResult(False, error="the read outlasted the lease")
            except Exception as e:  # a malformed lease fails this pull alone
                result = PullResult(False, error=f"{type(e).__name__}: {e}")
            try:
                _ask(agent, {"op": "done", "key": key}, self.timeout_s)
            except OSError:
                pass  # (the prefill side frees it at its timeout)
            break
        else:
            if not params.remote_agents:
                result = PullResult(False, error="no remote agents")
        result.seconds = time.perf_counter() - t0
        c = self.counters
        if result.ok:
            c["kv_transfers"] += 1
            c["kv_transfer_bytes"] += result.num_bytes
            c["kv_transfer_seconds"] += result.seconds
        else:
            c["kv_transfer_failures"] += 1
        return result

    def _read(
        self, lease: dict, tables: list[list[int]], first: list[int], last: int
    ) -> PullResult:
        remote_pools = [PoolLayout(**p) for p in lease["pools"]]
        remote_tables = lease["tables"]
        if len(remote_pools) != len(self.pools) or not all(
            a.matches(b) for a, b in zip(remote_pools, self.pools)
        ):
            return PullResult(False, error="the instances' KV layouts differ")
        pairs: list[tuple[int, int, int, int]] = []  # (pool, local block, remote block, entry)
        for p, (local, remote) in enumerate(zip(tables, remote_tables)):
            for j in range(first[p], last):
                if local[j] == NULL_BLOCK and p > 0:
                    continue  # (out of every later query's window)
                if j >= len(remote) or (p > 0 and remote[j] == NULL_BLOCK):
                    return PullResult(False, error=f"the prefill side lacks block {j}")
                pairs.append((p, local[j], int(remote[j]), j))
        dst, src, lengths = [], [], []
        runs = _runs(pairs)
        for p, lb, rb, count in runs:
            mine, theirs = self.pools[p], remote_pools[p]
            for layer in range(mine.num_layers):
                for k in range(mine.kv):
                    dst.append(mine.block_addr(layer, k, lb))
                    src.append(theirs.block_addr(layer, k, rb))
                    lengths.append(count * mine.block_bytes)
        if dst:
            rc = self.engine.batch_transfer_sync_read(lease["session"], dst, src, lengths)
            if rc != 0:
                return PullResult(False, error=f"Mooncake read failed (rc {rc})")
        return PullResult(True, num_blocks=len(pairs), num_bytes=sum(lengths))

    def stats(self) -> dict:
        return {"kv_agent": self.address, "kv_parked": self.num_parked, **self.counters}

    def close(self) -> None:
        super().close()
        self._server.shutdown()
        self._server.server_close()


def _runs(pairs: list[tuple[int, int, int, int]]) -> list[tuple[int, int, int, int]]:
    """``(pool, local, remote, count)`` runs where both block ids go up by one together."""
    runs: list[list[int]] = []
    for p, lb, rb, _ in pairs:
        r = runs[-1] if runs else None
        if r and r[0] == p and r[1] + r[3] == lb and r[2] + r[3] == rb:
            r[3] += 1
        else:
            runs.append([p, lb, rb, 1])
    return [tuple(r) for r in runs]


def _ask(agent: str, msg: dict, timeout_s: float) -> dict:
    """One message to a KV agent and its answer; OSError when it cannot be reached in time."""
    host, _, port = agent.rpartition(":")
    with socket.create_connection((host, int(port)), timeout=timeout_s) as s:
        s.sendall(json.dumps(msg).encode() + b"\n")
        f = s.makefile("rb")
        line = f.readline(_MAX_LINE)
    if not line:
        raise ConnectionError("the agent closed the connection")
    reply = json.loads(line)
    if "error" in reply:
        raise ConnectionError(reply["error"])
    return reply
