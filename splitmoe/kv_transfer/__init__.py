"""KV transfer between instances for prefill-decode disaggregation (docs/pd.md).

A prefill instance computes a request's prompt and *parks* its KV blocks under a key (the
router's transfer id and the prompt's digest) instead of freeing them; a decode instance pulls
them into blocks of its own pool, computes the last prompt token itself (its logits give the
first output token) and decodes. Parked blocks are freed on the prefill side when every reader
said it is done, or when ``kv_transfer_timeout`` passes, whatever happened to the reader. A pull
that fails (the prefill instance died, the key is unknown, the bytes did not arrive) leaves the
decode side to compute the prompt itself.

`KVConnector` is the interface the scheduler sees (`connectors.make_connector` builds one);
`MooncakeConnector` moves the bytes with Mooncake's transfer engine (TCP on one host, RDMA on
a cluster). Which blocks to read and where they are goes through a small signed side channel
(`agent.KVAgent`), whose every answer is checked before it is used: a broken or hostile peer
fails one transfer, never a rank.
"""

from __future__ import annotations

import functools
import hashlib
import ipaddress
import logging
import re
import struct
import time
from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

logger = logging.getLogger("splitmoe")


@dataclass(frozen=True)
class KVTransferParams:
    """A request's part in a transfer (vLLM's ``kv_transfer_params`` shape).

    do_remote_decode: (prefill side) keep the prompt's blocks for ``num_readers`` decode
    requests (the ``n`` copies) instead of freeing them. do_remote_prefill: (decode side) pull
    the prompt's blocks from the prefill instance whose KV agents are ``remote_agents``
    (``"host:port"``). transfer_id: the router's name for the transfer, the same on both sides.
    """

    transfer_id: str
    do_remote_decode: bool = False
    do_remote_prefill: bool = False
    remote_agents: tuple[str, ...] = ()
    num_readers: int = 1

    MAX_AGENTS = 16  # a pull asks them in turn, within one deadline

    def __post_init__(self) -> None:
        if not isinstance(self.transfer_id, str) or not 1 <= len(self.transfer_id) <= 128:
            raise ValueError("kv_transfer_params.transfer_id must be a string of 1 to 128 chars")
        if self.do_remote_decode == self.do_remote_prefill:
            raise ValueError(
                "kv_transfer_params must set exactly one of do_remote_decode, do_remote_prefill"
            )
        agents = tuple(self.remote_agents)
        if self.do_remote_prefill and not agents:
            raise ValueError("kv_transfer_params.remote_agents must name the prefill's agents")
        for a in agents:
            host, _, port = str(a).rpartition(":")
            if not host or not port.isdigit() or not 0 < int(port) < 65536:
                raise ValueError(f"kv_transfer_params.remote_agents entry {a!r} is not host:port")
        if len(agents) > self.MAX_AGENTS:
            raise ValueError(
                f"kv_transfer_params.remote_agents names {len(agents)} agents; at most "
                f"{self.MAX_AGENTS} are allowed"
            )
        object.__setattr__(self, "remote_agents", agents)
        n = self.num_readers
        if not isinstance(n, int) or isinstance(n, bool) or not 1 <= n <= 1024:
            raise ValueError("kv_transfer_params.num_readers must be an integer in [1, 1024]")

    @classmethod
    def parse(cls, value) -> KVTransferParams | None:
        """From a dict as clients send it (unknown keys are an error), an instance, or None."""
        if value is None or isinstance(value, cls):
            return value
        if not isinstance(value, Mapping):
            raise ValueError("kv_transfer_params must be an object")
        known = set(cls.__dataclass_fields__)
        unknown = set(value) - known
        if unknown:
            raise ValueError(f"kv_transfer_params: unknown key(s) {sorted(unknown)}")
        if "transfer_id" not in value:
            raise ValueError("kv_transfer_params.transfer_id is required")
        return cls(**value)


@functools.lru_cache(maxsize=16)
def trusted_agents(spec: str) -> tuple[tuple, frozenset[str]] | None:
    """``kv_trusted_agents`` parsed once per spec: (networks, host names), or None for ``"*"``
    (any)."""
    if spec.strip() == "*":
        return None
    nets, names = [], set()
    for item in filter(None, (x.strip() for x in spec.split(","))):
        try:
            nets.append(ipaddress.ip_network(item, strict=False))
        except ValueError:
            if not re.fullmatch(r"[A-Za-z0-9]([A-Za-z0-9.-]*[A-Za-z0-9])?", item):
                raise ValueError(
                    f"kv_trusted_agents: {item!r} is no network or host name"
                ) from None
            names.add(item.lower())
    return tuple(nets), frozenset(names)


def check_remote_agents(agents: Sequence[str], trusted: str) -> None:
    """Refuses a request whose ``remote_agents`` name a host outside ``kv_trusted_agents``: a
    decode instance connects to them and reads from them, so a client must not be able to
    point it anywhere (the router is the one that names them)."""
    allowed = trusted_agents(trusted)
    if allowed is None:
        return
    nets, names = allowed
    for agent in agents:
        host = agent.rpartition(":")[0].strip("[]")
        try:
            addr = ipaddress.ip_address(host)
        except ValueError:
            ok = host.lower() in names
        else:
            ok = any(addr in n for n in nets)
        if not ok:
            raise ValueError(
                f"kv_transfer_params.remote_agents: {agent!r} is not among this instance's "
                f"kv_trusted_agents ({trusted})"
            )


def transfer_key(transfer_id: str, prompt_token_ids: Sequence[int]) -> str:
    """The name of one prompt's parked blocks: a request may carry several prompts (and the
    same parameters), so the prompt's digest joins the router's id."""
    digest = hashlib.sha256(struct.pack(f"<{len(prompt_token_ids)}I", *prompt_token_ids))
    return f"{transfer_id}:{digest.hexdigest()[:32]}"


@dataclass(frozen=True)
class PoolLayout:
    """One KV pool as another instance reads it: ``[layers, kv, blocks, block_bytes]`` bytes
    from ``addr`` (`PagedKVCache.pool`; ``kv`` is 2, or 1 for a latent cache)."""

    addr: int
    num_layers: int
    kv: int
    num_blocks: int
    block_bytes: int

    def block_addr(self, layer: int, k: int, block: int) -> int:
        return self.addr + ((layer * self.kv + k) * self.num_blocks + block) * self.block_bytes

    def matches(self, other: PoolLayout) -> bool:
        return (self.num_layers, self.kv, self.block_bytes) == (
            other.num_layers,
            other.kv,
            other.block_bytes,
        )


def pool_layouts(kv_cache) -> list[PoolLayout]:
    """The pools of a `PagedKVCache` (one) or a `GroupedKVCache` (full, then window)."""
    pools = [kv_cache] if not hasattr(kv_cache, "window") else [kv_cache.full, kv_cache.window]
    out = []
    for p in pools:
        t = p.pool  # [L, kv, N, block_size, heads, dim], contiguous
        assert t.is_contiguous()
        L, kv, n = t.shape[:3]
        out.append(PoolLayout(t.data_ptr(), L, kv, n, t[0, 0, 0].numel() * t.element_size()))
    return out


@dataclass
class PullResult:
    """What a decode-side pull did: blocks and bytes moved, or why it failed (``error``);
    ``seconds``: the whole pull (lease, reads, done), what the request's TTFT spent on it."""

    ok: bool
    num_blocks: int = 0
    num_bytes: int = 0
    error: str | None = None
    seconds: float = 0.0


class KVConnector(ABC):
    """What one attention rank's scheduler uses to hand KV blocks over and to receive them.

    Block tables are per pool (`pool_layouts`): ``[block_table]`` or ``[block_table,
    window_table]``. Every method is called from the rank's step loop; `park`'s blocks are
    freed by the scheduler once they come back from `take_released`. A pull runs off the step
    loop (`start_pull`): however long the prefill side takes to answer, the rank keeps stepping
    its other requests and its expert ranks never wait on a transfer."""

    _PULL_THREADS = 2  # transfers in flight at once; more wait in the executor's queue
    _executor: ThreadPoolExecutor | None = None
    timeout_s: float = 30.0  # a whole pull's deadline (`kv_transfer_timeout`)

    def start_pull(
        self,
        params: KVTransferParams,
        key: str,
        tables: list[list[int]],
        first: list[int],
        last: int,
    ) -> Future:
        """`pull` on a transfer thread: a future of its `PullResult` (a pull never raises). The
        blocks in ``tables`` are being written until the future is done, whatever the request
        does meanwhile: they go back to the pool only then."""
        if self._executor is None:
            self._executor = ThreadPoolExecutor(self._PULL_THREADS, thread_name_prefix="kv-pull")
        # (copies: the scheduler may clear the request's tables while the read runs)
        tables = [list(t) for t in tables]
        return self._executor.submit(self._pull_isolated, params, key, tables, first, last)

    def _pull_isolated(self, params, key, tables, first, last) -> PullResult:
        """`pull`, whose every failure is a failed `PullResult`: nothing a peer does raises into
        the scheduler."""
        t0 = time.perf_counter()
        try:
            return self.pull(params, key, tables, first, last)
        except Exception as e:
            logger.warning("KV pull of %s failed: %s: %s", key, type(e).__name__, e)
            return PullResult(
                False, error=f"{type(e).__name__}: {e}", seconds=time.perf_counter() - t0
            )

    @property
    @abstractmethod
    def address(self) -> str:
        """``host:port`` of this rank's KV agent (what decode instances are given)."""

    @abstractmethod
    def park(self, transfer_id: str, key: str, tables: list[list[int]], num_readers: int) -> bool:
        """Keeps these blocks readable under ``key`` until ``num_readers`` readers are done or
        the timeout passes; False (nothing kept: the caller frees them) when the instance parks
        as many blocks as it may (`kv_max_parked_blocks`)."""

    @abstractmethod
    def take_released(self) -> list[list[list[int]]]:
        """The tables of parked entries that are done or expired (each returned once)."""

    @abstractmethod
    def pull(
        self,
        params: KVTransferParams,
        key: str,
        tables: list[list[int]],
        first: list[int],
        last: int,
    ) -> PullResult:
        """Reads entries ``first[p] .. last - 1`` of each pool ``p``'s remote table into the
        local ``tables[p]`` (local entries that are the null block are skipped), then tells the
        prefill instance it is done, whatever happened."""

    @abstractmethod
    def stats(self) -> dict:
        """Counters for `/metrics` and ``llm.stats()``."""

    def close(self) -> None:
        """Stops serving (the process is ending)."""
        if self._executor is not None:
            self._executor.shutdown(wait=False, cancel_futures=True)
