"""Prefix caching in the block manager and the scheduler: exact block ids, reference counts,
LRU eviction only when no uncached block is free, preempted and finished requests returning
their blocks to the cache."""

from __future__ import annotations

from splitmoe.config import SchedulerConfig
from splitmoe.sampling_params import SamplingParams
from splitmoe.scheduler.block_manager import BlockManager, block_hashes
from splitmoe.scheduler.request import RequestSpec
from splitmoe.scheduler.scheduler import Scheduler


def test_hashes_chain_over_the_prefix():
    a = block_hashes([1, 2, 3, 4, 5, 6, 7, 8, 9], 4)
    b = block_hashes([1, 2, 3, 4, 5, 6, 7, 0], 4)
    c = block_hashes([0, 2, 3, 4, 5, 6, 7, 8], 4)
    assert len(a) == 2  # (full blocks only)
    assert a[0] == b[0] and a[1] != b[1]
    assert c[1] != a[1]  # the same block after another prefix is another block
    assert block_hashes([5, 6, 7, 8], 4, parent=a[0]) == a[1:]


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


def _spec(rid, prompt, max_tokens=4):
    return RequestSpec(rid, prompt, SamplingParams(max_tokens=max_tokens, temperature=0), 0.0)


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
