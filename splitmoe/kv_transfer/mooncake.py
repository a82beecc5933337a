"""`KVConnector` on Mooncake's transfer engine, with a signed side channel (`agent.KVAgent`).

Each attention rank runs one `TransferEngine` (peer-to-peer handshake, no metadata service,
``tcp``) with its KV pools registered, and a KV agent that leases parked blocks to decode
instances (`agent.ParkedBlocks`). A decode rank's pull, on a transfer thread
(`KVConnector.start_pull`), within one deadline (``kv_transfer_timeout``):

1. asks the prefill side's agents in turn for a lease of its own (a fresh reader id) on the
   prompt's parked entry, until one grants it;
2. checks the lease (the KV layouts match, every block id inside the remote pool) and reads
   the blocks itself (`TransferEngine.batch_transfer_sync_read`), runs of consecutive blocks
   coalesced into one read per layer; a read that outlasted the lease is thrown away;
3. tells the agent it is done, whatever happened.

Releases from the agent's threads are queued and freed by the rank's own step loop (the block
manager is not shared across threads).

Mooncake's TCP transport listens on every interface, whatever address it is given (version
0.3.x: ``MC_TCP_BIND_ADDRESS`` changes what it announces, not where it binds), and serves
reads at any registered address a peer names: the connector warns at start when it finds such
a socket, and docs/pd.md says to firewall those ports to the instances' network.
"""

from __future__ import annotations

import ipaddress
import logging
import os
import time
import uuid

from splitmoe.kv_transfer import KVConnector, KVTransferParams, PoolLayout, PullResult
from splitmoe.kv_transfer.agent import (
    IO_TIMEOUT_S,
    NULL_BLOCK,
    AgentFault,
    Done,
    Granted,
    KVAgent,
    Lease,
    NotFound,
    ParkedBlocks,
    ask,
)

logger = logging.getLogger("splitmoe")


class MooncakeConnector(KVConnector):
    def __init__(
        self,
        pools: list[PoolLayout],
        host: str,
        timeout_s: float,
        secret: bytes,
        max_parked_blocks: int | None = None,
    ):
        from mooncake.engine import TransferEngine

        self.pools = pools
        self.timeout_s = timeout_s
        self.secret = secret
        before = _listening_ports()
        self.engine = TransferEngine()
        rc = self.engine.initialize(host, "P2PHANDSHAKE", "tcp", "")
        if rc != 0:
            raise RuntimeError(f"Mooncake transfer engine failed to start on {host} (rc {rc})")
        for p in pools:
            size = p.num_layers * p.kv * p.num_blocks * p.block_bytes
            if self.engine.register_memory(p.addr, size) != 0:
                raise RuntimeError("Mooncake could not register the KV pool's memory")
        _warn_wide_ports(host, _listening_ports() - before)
        self.session = f"{host}:{self.engine.get_rpc_port()}"
        cap = max_parked_blocks if max_parked_blocks is not None else pools[0].num_blocks // 2
        self.book = ParkedBlocks(timeout_s, cap)
        self.agent = KVAgent(host, self.book, secret, self.session, pools)
        self.counters = {
            "kv_transfers": 0,
            "kv_transfer_failures": 0,
            "kv_transfer_bytes": 0,
            "kv_transfer_seconds": 0.0,
        }

    @property
    def address(self) -> str:
        return self.agent.address

    # ---- prefill side ----------------------------------------------------------------------

    def park(self, transfer_id: str, key: str, tables: list[list[int]], num_readers: int) -> bool:
        return self.book.park(transfer_id, key, tables, num_readers)

    def take_released(self) -> list[list[list[int]]]:
        return self.book.take_released()

    @property
    def num_parked(self) -> int:
        return self.book.num_entries

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
        deadline = time.monotonic() + self.timeout_s
        reader = uuid.uuid4().hex
        errors = []
        for agent in params.remote_agents:
            asked = time.monotonic()
            try:
                lease = ask(agent, Lease(key, reader), self.secret, deadline)
            except AgentFault as e:
                errors.append(f"agent {agent}: {e}")
                continue
            if not isinstance(lease, Granted):
                reason = lease.reason if isinstance(lease, NotFound) else type(lease).__name__
                errors.append(f"agent {agent}: no lease ({reason})")
                continue
            try:
                result = self._read(lease, tables, first, last)
                if result.ok and time.monotonic() - asked >= lease.valid_s:
                    # the prefill side may have freed (and reused) the blocks under the read
                    result = PullResult(False, error="the read outlasted the lease")
            except Exception as e:  # (a lease that passed its checks and still broke a read)
                result = PullResult(False, error=f"{type(e).__name__}: {e}")
            try:  # (a short deadline of its own: the prefill side frees at its timeout anyway)
                ask(agent, Done(key, reader), self.secret, time.monotonic() + IO_TIMEOUT_S)
            except AgentFault:
                pass
            break
        else:
            result = PullResult(False, error="; ".join(errors) or "no remote agents")
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
        self, lease: Granted, tables: list[list[int]], first: list[int], last: int
    ) -> PullResult:
        why = _lease_problem(lease, self.pools)
        if why:
            return PullResult(False, error=why)
        pairs: list[tuple[int, int, int, int]] = []  # (pool, local block, remote block, entry)
        for p, (local, remote) in enumerate(zip(tables, lease.tables)):
            for j in range(first[p], last):
                if local[j] == NULL_BLOCK and p > 0:
                    continue  # (out of every later query's window)
                if j >= len(remote) or (p > 0 and remote[j] == NULL_BLOCK):
                    return PullResult(False, error=f"the prefill side lacks block {j}")
                pairs.append((p, local[j], remote[j], j))
        dst, src, lengths = [], [], []
        for p, lb, rb, count in _runs(pairs):
            mine, theirs = self.pools[p], lease.pools[p]
            for layer in range(mine.num_layers):
                for k in range(mine.kv):
                    dst.append(mine.block_addr(layer, k, lb))
                    src.append(theirs.block_addr(layer, k, rb))
                    lengths.append(count * mine.block_bytes)
        if dst:
            rc = self.engine.batch_transfer_sync_read(lease.session, dst, src, lengths)
            if rc != 0:
                return PullResult(False, error=f"Mooncake read failed (rc {rc})")
        return PullResult(True, num_blocks=len(pairs), num_bytes=sum(lengths))

    def stats(self) -> dict:
        book = self.book
        return {
            "kv_agent": self.address,
            "kv_parked": book.num_entries,
            "kv_parked_blocks": book.num_blocks,
            "kv_max_parked_blocks": book.max_blocks,
            "kv_agent_refused": self.agent.refused,
            **book.counters,
            **self.counters,
        }

    def close(self) -> None:
        super().close()
        self.agent.close()


def _lease_problem(lease: Granted, mine: list[PoolLayout]) -> str | None:
    """Why a lease cannot be read into pools laid out as ``mine`` (None: it can)."""
    if len(lease.pools) != len(mine) or not all(a.matches(b) for a, b in zip(lease.pools, mine)):
        return "the instances' KV layouts differ"
    if len(lease.tables) != len(mine):
        return "the lease's tables do not match the pools"
    for pool, table in zip(lease.pools, lease.tables):
        if any(b >= pool.num_blocks for b in table):
            return "the lease names a block outside the remote pool"
    host, _, port = lease.session.rpartition(":")
    if not host or not port.isdigit():
        return "the lease's session is not host:port"
    return None


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


def _listening_ports() -> set[tuple[str, int]]:
    """``(address, port)`` of the TCP sockets this process listens on (Linux; empty
    elsewhere)."""
    inodes = set()
    try:
        for fd in os.listdir("/proc/self/fd"):
            try:
                link = os.readlink(f"/proc/self/fd/{fd}")
            except OSError:
                continue
            if link.startswith("socket:["):
                inodes.add(link[8:-1])
    except OSError:
        return set()
    out = set()
    for table in ("/proc/self/net/tcp", "/proc/self/net/tcp6"):
        try:
            lines = open(table).read().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            cols = line.split()
            if len(cols) > 9 and cols[3] == "0A" and cols[9] in inodes:  # (0A: LISTEN)
                addr, port = cols[1].split(":")
                out.add((_proc_address(addr), int(port, 16)))
    return out


def _proc_address(hex_addr: str) -> str:
    raw = bytes.fromhex(hex_addr)
    # /proc writes each 32-bit word in host (little-endian) order
    return str(ipaddress.ip_address(b"".join(raw[i : i + 4][::-1] for i in range(0, len(raw), 4))))


def _warn_wide_ports(host: str, ports: set[tuple[str, int]]) -> None:
    """Warns about the transfer engine's sockets that listen beyond ``host``."""
    wide = sorted(p for a, p in ports if ipaddress.ip_address(a).is_unspecified)
    if wide:
        logger.warning(
            "Mooncake's transfer engine listens on every interface (TCP port(s) %s), not only "
            "on kv_host=%s, and serves reads of this rank's KV pool to whoever reaches them: "
            "firewall these ports to the instances' network (docs/pd.md, 'What is trusted')",
            ", ".join(map(str, wide)),
            host,
        )
