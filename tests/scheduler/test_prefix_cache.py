"""Prefix caching in the block manager and the scheduler: exact block ids, reference counts,
LRU eviction only when no uncached block is free, preempted and finished requests returning
their blocks to the cache."""

from __future__ import annotations

import hashlib
import struct

import pytest

from splitmoe.config import SchedulerConfig
from splitmoe.sampling_params import SamplingParams
from splitmoe.scheduler.block_manager import BlockManager, block_hashes, root_hash
from splitmoe.scheduler.request import Request, RequestSpec
from splitmoe.scheduler.router import LeastLoadRouter
from splitmoe.scheduler.scheduler import Scheduler


def test_hashes_chain_over_the_prefix():
    a = block_hashes([1, 2, 3, 4, 5, 6, 7, 8, 9], 4)
    b = block_hashes([1, 2, 3, 4, 5, 6, 7, 0], 4)
    c = block_hashes([0, 2, 3, 4, 5, 6, 7, 8], 4)
    assert len(a) == 2  # (full blocks only)
    assert a[0] == b[0] and a[1] != b[1]
    assert c[1] != a[1]  # the same block after another prefix is another block
    assert block_hashes([5, 6, 7, 8], 4, parent=a[0]) == a[1:]
    assert block_hashes([1, 2, 3, 4, 5, 6, 7, 8, 9], 4, start=4, parent=a[0]) == a[1:]


def test_block_digest_is_sha256_of_parent_and_uint32_ids():
    # computed here without the module: sha256(parent digest + ids as little-endian uint32),
    # the first block's parent 32 zero bytes, or sha256("cache_salt:" + salt) with a salt
    ids = [1, 151_935, 0, 2**32 - 1, 7, 8, 9, 10]
    first = hashlib.sha256(bytes(32) + b"".join(t.to_bytes(4, "little") for t in ids[:4]))
    second = hashlib.sha256(first.digest() + struct.pack("<4I", *ids[4:]))
    assert block_hashes(ids, 4) == [first.digest(), second.digest()]
    assert (
        first.hexdigest()
        == (
            hashlib.sha256(
                bytes.fromhex("00" * 32 + "01000000" + "7f510200" + "00000000" + "ff" * 4)
            )
        ).hexdigest()
    )
    root = hashlib.sha256(b"cache_salt:tenant-a").digest()
    assert root_hash("tenant-a") == root
    assert (
        block_hashes(ids, 4, salt="tenant-a")[0]
        == hashlib.sha256(root + struct.pack("<4I", *ids[:4])).digest()
    )


def test_salt_separates_every_block_and_equal_salts_agree():
    ids = list(range(100, 132))
    plain = block_hashes(ids, 8)
    a = block_hashes(ids, 8, salt="a")
    assert a == block_hashes(ids, 8, salt="a") and len(a) == 4
    others = [plain, block_hashes(ids, 8, salt="b"), block_hashes(ids, 8, salt="a ")]
    assert all(x != y for other in others for x, y in zip(a, other))
    # a chain resumed from a salted parent stays salted (the salt only seeds the first block)
    assert block_hashes(ids[16:], 8, parent=a[1], salt="ignored") == a[2:]
    assert block_hashes(ids, 8, salt="\ud800")  # (a lone surrogate from JSON still hashes)


def test_cache_salt_is_checked():
    assert SamplingParams(cache_salt="x" * 256).cache_salt == "x" * 256
    for bad in ("", "x" * 257, 5, b"salt"):
        with pytest.raises(ValueError, match="cache_salt"):
            SamplingParams(cache_salt=bad)


def test_match_refcount_and_lru_eviction():
    bm = BlockManager(num_blocks=4, block_size=2, enable_prefix_caching=True)
    t1: list[int] = []
    assert bm.grow(t1, 4)
    assert t1 == [0, 1]
    h = block_hashes([1, 2, 3, 4], 2)
    bm.cache_blocks(t1, h, 0)
    assert bm.match(h, 2) == [0, 1]
    t2: list[int] = []
    assert bm.grow(t2, 5, bm.match(h, 2))  # shares both blocks, takes one more
    assert t2 == [0, 1, 2] and bm.ref_counts[:3] == [2, 2, 1]
    bm.free(t1)
    assert bm.num_used == 3  # (still held by t2)
    bm.free(t2)
    assert bm.num_used == 0 and bm.num_cached == 2
    # uncached free blocks go first; then the least recently released cached ones (t2's tail
    # was released first: block 1 before block 0)
    t3: list[int] = []
    assert bm.grow(t3, 4)
    assert t3 == [2, 3] and bm.num_cached == 2
    t4: list[int] = []
    assert bm.grow(t4, 2)
    assert t4 == [1] and bm.num_evictions == 1
    assert bm.match(h, 2) == [0]  # block 1's prefix is gone, block 0's remains
    assert not bm.grow([], 4)  # only block 0 is left


def test_reviving_cached_blocks_counts_against_the_pool():
    bm = BlockManager(num_blocks=2, block_size=2, enable_prefix_caching=True)
    t: list[int] = []
    bm.grow(t, 4)
    h = block_hashes([1, 2, 3, 4], 2)
    bm.cache_blocks(t, h, 0)
    bm.free(t)
    assert bm.num_free == 2
    # reusing both cached blocks and asking one more does not fit; nothing is taken
    hit = bm.match(h, 2)
    assert not bm.grow([], 6, hit)
    assert bm.num_free == 2 and bm.num_cached == 2


def _spec(rid, prompt, max_tokens=4, salt=None):
    params = SamplingParams(max_tokens=max_tokens, temperature=0, cache_salt=salt)
    return RequestSpec(rid, prompt, params, 0.0)


def _run_step(s: Scheduler, batch, token=9):
    for req, n in zip(batch.requests, batch.num_new_tokens):
        s.computed(req, n)
        if req.num_computed_tokens == req.num_tokens:
            req.append_token(token, 0.0)


def test_scheduler_reuses_the_longest_cached_prefix():
    bm = BlockManager(16, 4, enable_prefix_caching=True)
    s = Scheduler(SchedulerConfig(), bm, eos_token_ids=(), max_model_len=100)
    prompt = list(range(10, 22))  # 12 tokens: 3 full blocks
    a = s.add(_spec(0, prompt))
    _run_step(s, s.schedule())
    assert a.num_computed_tokens == 12 and a.num_cached_tokens == 0
    assert bm.num_cached == 3
    # the same prompt: the last block is recomputed (its last token gives the logits)
    b = s.add(_spec(1, prompt))
    batch = s.schedule()
    assert b in batch.requests
    i = batch.requests.index(b)
    assert b.num_cached_tokens == 8 and batch.num_new_tokens[i] == 4
    assert b.block_table[:2] == a.block_table[:2] and b.block_table[2] != a.block_table[2]
    # a longer prompt sharing all 3 blocks reuses them all
    c = s.add(_spec(2, prompt + [50, 51]))
    batch = s.schedule()
    assert c.num_cached_tokens == 12 and c.block_table[:3] == a.block_table[:3]


def test_preempted_request_gets_its_blocks_back_from_the_cache():
    bm = BlockManager(6, 4, enable_prefix_caching=True)
    s = Scheduler(SchedulerConfig(), bm, eos_token_ids=(), max_model_len=100)
    a = s.add(_spec(0, list(range(10, 19)), max_tokens=20))  # 9 tokens: 3 blocks
    b = s.add(_spec(1, list(range(30, 39)), max_tokens=20))
    _run_step(s, s.schedule())
    assert bm.num_used == 6
    for _ in range(10):  # until they grow past their third block: b is preempted
        _run_step(s, s.schedule())
        if b.num_preemptions:
            break
    assert b.num_preemptions == 1 and b.num_computed_tokens == 0
    assert bm.num_cached >= 4  # (a's and b's full blocks stay indexed)
    s.finish(a)
    batch = s.schedule()
    assert b in batch.requests
    assert b.num_computed_tokens == 8  # its two full prompt blocks came back from the cache
    assert b.num_cached_tokens == 0  # (counted at its first admission only)


def test_scheduler_shares_blocks_only_between_equal_salts():
    bm = BlockManager(32, 4, enable_prefix_caching=True)
    s = Scheduler(SchedulerConfig(), bm, eos_token_ids=(), max_model_len=100)
    prompt = list(range(10, 23))  # 13 tokens: 3 full blocks
    a = s.add(_spec(0, prompt, salt="tenant-a"))
    _run_step(s, s.schedule())
    assert a.block_table == [0, 1, 2, 3] and bm.num_cached == 3
    reqs = [
        s.add(_spec(1, prompt, salt="tenant-b")),
        s.add(_spec(2, prompt)),
        s.add(_spec(3, prompt, salt="tenant-a")),
    ]
    _run_step(s, s.schedule())
    b, plain, a2 = reqs
    assert (b.num_cached_tokens, plain.num_cached_tokens, a2.num_cached_tokens) == (0, 0, 12)
    assert b.block_table == [4, 5, 6, 7] and plain.block_table == [8, 9, 10, 11]
    assert a2.block_table == [0, 1, 2, 12]
    # the unsalted request's blocks are found by the next unsalted one, and only by it
    c = s.add(_spec(4, prompt))
    _run_step(s, s.schedule())
    assert c.num_cached_tokens == 12 and c.block_table[:3] == [8, 9, 10]
    assert bm.num_cached == 9


def test_router_hashes_are_the_ranks_hashes():
    # the front end routes by block_hashes(prompt, salt=...); the rank indexes its cache by
    # Request.hashes_upto: they must agree for prefix-aware routing to find anything
    prompt = list(range(40))
    for salt in (None, "t"):
        req = Request(_spec(0, prompt, salt=salt))
        assert req.hashes_upto(40, 16) == block_hashes(prompt, 16, salt=salt)
    for salt, rank in (("t", 0), ("u", 1)):
        router = LeastLoadRouter(2, capacity=64)
        assert router.pick(40, block_hashes(prompt, 16, salt="t")) == 0
        router.add(1, 30)  # rank 1 is lighter, rank 0 within the request's cost of it:
        # the same tenant goes where its prefix is cached, another tenant has no hit there
        assert router.pick(40, block_hashes(prompt, 16, salt=salt)) == rank
