"""The sliding-window layers' KV group (GPT-OSS): blocks wholly before a request's window go
back to the pool as it advances (exact block ids, CPU only)."""

from __future__ import annotations

from test_scheduler import _spec, _step

from splitmoe.config import SchedulerConfig
from splitmoe.scheduler.block_manager import BlockManager
from splitmoe.scheduler.scheduler import Scheduler
from splitmoe.scheduler.window_blocks import NULL_BLOCK, SlidingWindowBlocks


def test_release_frees_the_blocks_before_the_window():
    w = SlidingWindowBlocks(num_blocks=8, block_size=4, window=6)
    t: list[int] = []
    assert w.grow(t, 12, next_pos=0) and t == [1, 2, 3]  # block 0 is the null block
    # a query at 12 sees keys 7..12: block 0 (keys 0-3) is dead, block 1 (4-7) is not
    assert w.grow(t, 13, next_pos=12) and t == [NULL_BLOCK, 2, 3, 1]
    assert w.num_used == 3 and w.peak_used == 3  # freed before the new block was taken
    assert w.release(t, 17) == 2 and t == [NULL_BLOCK] * 3 + [1]  # keys 12.. seen
    assert w.release(t, 17) == 0  # idempotent
    w.free(t)
    assert t == [] and w.num_used == 0 and NULL_BLOCK not in w.free_blocks


def test_long_generation_holds_a_window_of_blocks():
    """A 40-token prompt in 8-token chunks, then 30 decode steps: the full group holds every
    block, the window group at most (window - 1) // bs + 2 plus the chunk's; preempting or
    finishing frees both."""
    full = BlockManager(num_blocks=64, block_size=4)
    win = SlidingWindowBlocks(num_blocks=16, block_size=4, window=6)
    cfg = SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=8)
    s = Scheduler(cfg, full, (), 1 << 20, window_blocks=win)
    req = s.add(_spec(0, 40, max_tokens=30))
    bound = (6 - 1) // 4 + 2 + 8 // 4
    while s.has_work:
        start = req.num_computed_tokens  # the step's first query: blocks before its window go
        _step(s)
        if req.status.value == "running":
            assert len(req.block_table) == len(req.window_table)  # the same tokens
            assert win.num_used <= bound
            freed = req.window_table.count(NULL_BLOCK)  # a prefix of the table
            assert freed == max(0, start - 6 + 1) // 4
            assert NULL_BLOCK not in req.window_table[freed:]
    assert win.peak_used <= bound < full.num_blocks
    assert full.num_used == 0 and win.num_used == 0
    assert len(req.output_token_ids) == 30


def test_window_pool_exhaustion_preempts_nothing_is_lost():
    """A window pool for one request at a time: the second waits (nothing taken from the full
    group) and runs once the first finishes."""
    full = BlockManager(num_blocks=64, block_size=4)
    win = SlidingWindowBlocks(num_blocks=5, block_size=4, window=4)
    cfg = SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=8)
    s = Scheduler(cfg, full, (), 1 << 20, window_blocks=win)
    a, b = s.add(_spec(0, 16, max_tokens=3)), s.add(_spec(1, 16, max_tokens=3))
    plan = _step(s)
    assert plan == {0: 8}  # b's first chunk does not fit the window pool next to a's
    assert b.block_table == [] and b.window_table == []
    while s.has_work:
        _step(s)
    assert len(a.output_token_ids) == len(b.output_token_ids) == 3
    assert full.num_used == 0 and win.num_used == 0
