"""KV block allocation for one attention rank's paged cache, with prefix caching.

Prefix caching follows vLLM v1's design: a *full* block is named by a SHA-256 digest chained
over the token ids of the block and of every block before it (`block_hashes`), so equal hashes
mean equal prefixes and equal KV contents. A request's ``cache_salt`` enters the first block's
digest, so requests with different salts (tenants) never share a cached block. A new request
looks up its prompt's chain (`match`) and reuses the longest run of cached blocks; only the rest
is computed. Blocks are reference-counted: a cached block shared by several running requests is
freed when the last one lets go, and then stays in the cache (evictable) until a new allocation
needs a block and no block without cached contents is free; the least recently released one is
evicted first.
"""

from __future__ import annotations

import hashlib
import struct
from collections import OrderedDict
from collections.abc import Sequence

_UNSALTED_ROOT = bytes(32)  # the "parent" of an unsalted sequence's first block


def root_hash(salt: str | None = None) -> bytes:
    """The 32-byte parent of a sequence's first block: zeros without a salt, else the SHA-256 of
    the tagged salt (UTF-8, lone surrogates kept), so the salt enters every block's digest and no
    other input can produce the same root (the tag keeps later kinds of extra keys apart)."""
    if salt is None:
        return _UNSALTED_ROOT
    return hashlib.sha256(b"cache_salt:" + salt.encode("utf-8", "surrogatepass")).digest()


def block_hashes(
    token_ids: Sequence[int],
    block_size: int,
    parent: bytes | None = None,
    start: int = 0,
    salt: str | None = None,
) -> list[bytes]:
    """The chained digests of the full blocks of ``token_ids[start:]`` (``start`` a multiple of
    ``block_size``), the first chained to ``parent`` (the digest of the block before; None at the
    start of the sequence, which then begins at `root_hash` of ``salt``).

    A block's digest is ``sha256(parent + ids)``, ``ids`` its token ids as little-endian uint32
    (every id is checked to be in the vocabulary before it gets here): fixed-width input, so no
    two different chains hash the same bytes, and the same on every process and machine (the
    front end's router and every rank agree). Python's ``hash()``, used before, let a client
    craft colliding prompts and be served another tenant's KV (vLLM's cache-collision advisory,
    GHSA-rm76-4mrf-v9r8). It costs a few hundred ns per block, a few times ``hash()`` of a tuple
    and nothing beside the prefill of the same tokens (`scripts/bench_block_hashes.py`)."""
    if parent is None:
        parent = root_hash(salt)
    n = (len(token_ids) - start) // block_size * block_size
    data = struct.pack(f"<{n}I", *token_ids[start : start + n])
    width = 4 * block_size
    out = []
    sha256 = hashlib.sha256
    for o in range(0, 4 * n, width):
        parent = sha256(parent + data[o : o + width]).digest()
        out.append(parent)
    return out


class BlockManager:
    """``num_blocks`` KV blocks of ``block_size`` tokens: a free list, and with
    ``enable_prefix_caching`` a cache of full blocks by chained hash.

    Blocks without cached contents are handed out as a stack: the most recently freed first (in
    the order their request held them), then the never-used ones lowest id first, so allocation
    order is deterministic (tests assert exact ids). Reusing warm blocks keeps a request's
    writes on pages the cache already has; handed out oldest first, a run would keep moving on
    to fresh pages of the pool, which the kernel zeroes at first touch (a visible share of a
    colocated CPU decode step).
    Cached blocks that no request holds are taken only when that stack is empty, least recently
    released first (and then leave the cache).
    """

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = False):
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.free_blocks: list[int] = list(range(num_blocks - 1, -1, -1))  # (the top is the end)
        self.ref_counts = [0] * num_blocks
        self.block_hash: list[bytes | None] = [None] * num_blocks
        self.cached: dict[bytes, int] = {}  # chained digest -> block holding that prefix
        self.evictable: OrderedDict[int, None] = OrderedDict()  # cached, unheld: LRU first
        self.num_evictions = 0

    @property
    def num_free(self) -> int:
        """Blocks an allocation may take (cached ones that no request holds included)."""
        return len(self.free_blocks) + len(self.evictable)

    @property
    def num_used(self) -> int:
        """Blocks that running requests hold."""
        return self.num_blocks - self.num_free

    @property
    def num_cached(self) -> int:
        return len(self.cached)

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def can_grow(self, block_table: list[int], num_tokens: int) -> bool:
        return self.blocks_for(num_tokens) - len(block_table) <= self.num_free

    def match(self, hashes: Sequence[bytes], max_blocks: int) -> list[int]:
        """The cached blocks of the longest prefix of ``hashes`` (at most ``max_blocks``), not
        yet taken (see `grow`)."""
        if not self.enable_prefix_caching:
            return []
        hit = []
        for h in hashes[:max_blocks]:
            block = self.cached.get(h)
            if block is None:
                break
            hit.append(block)
        return hit

    def grow(self, block_table: list[int], num_tokens: int, cached: Sequence[int] = ()) -> bool:
        """Extends ``block_table`` with the ``cached`` blocks (a `match` result; only for an
        empty table), then fresh ones up to ``num_tokens``; False (nothing taken) if the pool
        cannot hold them."""
        revived = sum(1 for b in cached if self.ref_counts[b] == 0)
        need = self.blocks_for(num_tokens) - len(block_table) - len(cached)
        if need + revived > self.num_free:
            return False
        for b in cached:
            if self.ref_counts[b] == 0:
                del self.evictable[b]
            self.ref_counts[b] += 1
            block_table.append(b)
        for _ in range(need):
            block_table.append(self._take())
        return True

    def _take(self) -> int:
        if self.free_blocks:
            block = self.free_blocks.pop()
        else:  # evict the least recently released cached block
            block, _ = self.evictable.popitem(last=False)
            del self.cached[self.block_hash[block]]
            self.block_hash[block] = None
            self.num_evictions += 1
        self.ref_counts[block] = 1
        return block

    def cache_blocks(self, block_table: list[int], hashes: Sequence[bytes], start: int) -> None:
        """Indexes ``block_table[start : len(hashes)]``, now full and computed, under their
        chained ``hashes``. A prefix another request cached first keeps that block (this one
        leaves the cache when freed)."""
        for i in range(start, len(hashes)):
            block, h = block_table[i], hashes[i]
            if self.block_hash[block] is None and h not in self.cached:
                self.cached[h] = block
                self.block_hash[block] = h

    def free(self, block_table: list[int]) -> None:
        """Releases the blocks of a finished or preempted request. Last blocks first, so a
        request's tail leaves the cache before its prefix, which others are likelier to share."""
        for block in reversed(block_table):
            self.ref_counts[block] -= 1
            if self.ref_counts[block] == 0:
                if self.block_hash[block] is None:
                    self.free_blocks.append(block)
                else:
                    self.evictable[block] = None
        block_table.clear()
