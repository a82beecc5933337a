"""The Mooncake connector between two schedulers of one process: exact bytes, exact block
ids, blocks freed on both sides whichever way a transfer ends."""

from __future__ import annotations

import time

import pytest
import torch

pytest.importorskip("mooncake.engine")

from splitmoe.attention_nodes.kv_cache import GroupedKVCache, PagedKVCache  # noqa: E402
from splitmoe.config import SchedulerConfig  # noqa: E402
from splitmoe.kv_transfer import KVTransferParams, transfer_key  # noqa: E402
from splitmoe.kv_transfer.connectors import make_connector  # noqa: E402
from splitmoe.sampling_params import SamplingParams  # noqa: E402
from splitmoe.scheduler.block_manager import BlockManager  # noqa: E402
from splitmoe.scheduler.request import RequestSpec  # noqa: E402
from splitmoe.scheduler.scheduler import Scheduler  # noqa: E402
from splitmoe.scheduler.window_blocks import NULL_BLOCK, SlidingWindowBlocks  # noqa: E402

BS = 4


class Side:
    """One instance's attention rank without a model: a pool, its blocks, a scheduler."""

    def __init__(self, num_blocks: int, window: int | None = None, timeout: float = 30.0):
        full = PagedKVCache(2, num_blocks, BS, 2, 8, torch.float32, "cpu")
        self.window_blocks = None
        self.cache = full
        if window is not None:
            w = PagedKVCache(1, num_blocks, BS, 2, 8, torch.float32, "cpu")
            self.cache = GroupedKVCache(full, w, (0,))
            self.window_blocks = SlidingWindowBlocks(num_blocks, BS, window)
        self.blocks = BlockManager(num_blocks, BS, enable_prefix_caching=window is None)
        self.connector = make_connector("mooncake", self.cache, "127.0.0.1", timeout)
        self.sched = Scheduler(
            SchedulerConfig(), self.blocks, (), 1 << 20, self.window_blocks, self.connector
        )

    def pools(self) -> list[torch.Tensor]:
        c = self.cache
        return [c.full.pool, c.window.pool] if hasattr(c, "window") else [c.pool]

    def used(self) -> int:
        return self.blocks.num_used + (self.window_blocks.num_used if self.window_blocks else 0)


def run_prompt(side: Side, rid: int, prompt: list[int], kv: dict | None):
    """Schedules the request until its prompt is computed, writes recognisable KV into its
    blocks, and finishes it (as a one-token prefill request)."""
    req = side.sched.add(
        RequestSpec(rid, prompt, SamplingParams(max_tokens=1, kv_transfer_params=kv), 0.0)
    )
    while req.num_computed_tokens < req.prompt_len:
        batch = side.sched.schedule()
        for r, n in zip(batch.requests, batch.num_new_tokens):
            side.sched.computed(r, n)
    for k, (pool, table) in enumerate(zip(side.pools(), [req.block_table, req.window_table])):
        for j, b in enumerate(table):
            if k == 0 or b != NULL_BLOCK:
                pool[:, :, b] = torch.randn(pool[:, :, b].shape) + 1000 * rid + j
    tables = [list(req.block_table), list(req.window_table)]
    req.output_token_ids.append(7)
    side.sched.finish(req)
    return tables


@pytest.mark.parametrize("window", [None, 6])
def test_pull_moves_the_exact_blocks_and_frees_both_sides(window):
    pre, dec = Side(32, window), Side(32, window)
    prompt = list(range(3, 3 + 19))  # 19 tokens: 5 blocks, the last one partial
    tables = run_prompt(pre, 1, prompt, {"transfer_id": "t1", "do_remote_decode": True})
    assert pre.used() > 0 and pre.connector.num_parked == 1  # parked, not freed
    kv = {"transfer_id": "t1", "do_remote_prefill": True, "remote_agents": [pre.connector.address]}
    req = dec.sched.add(RequestSpec(9, prompt, SamplingParams(kv_transfer_params=kv), 0.0))
    batch = dec.sched.schedule()
    assert batch.requests == [req] and batch.num_new_tokens == [1]  # only the last token
    assert req.num_computed_tokens == len(prompt) - 1
    last = -(-(len(prompt) - 1) // BS)
    for k, (src, dst) in enumerate(zip(pre.pools(), dec.pools())):
        mine = req.block_table if k == 0 else req.window_table
        for j in range(last):
            if k == 1 and mine[j] == NULL_BLOCK:
                assert j < (len(prompt) - 1 - window + 1) // BS  # out of every later window
                continue
            assert torch.equal(dst[:, :, mine[j]], src[:, :, tables[k][j]]), (k, j)
    assert dec.connector.counters["kv_transfers"] == 1
    pre.sched.schedule()  # (frees what the agent released)
    assert pre.used() == 0 and pre.connector.num_parked == 0
    dec.sched.finish(req)
    assert dec.used() == 0


def test_n_readers_share_one_parked_prompt():
    pre, dec = Side(32), Side(32)
    prompt = list(range(5, 5 + 9))
    run_prompt(pre, 1, prompt, {"transfer_id": "t", "do_remote_decode": True, "num_readers": 2})
    kv = {"transfer_id": "t", "do_remote_prefill": True, "remote_agents": [pre.connector.address]}
    reqs = [
        dec.sched.add(RequestSpec(i, prompt, SamplingParams(kv_transfer_params=kv), 0.0))
        for i in (1, 2)
    ]
    dec.sched.schedule()
    assert [r.num_computed_tokens for r in reqs] == [8, 8]
    assert dec.connector.counters["kv_transfers"] == 2
    pre.sched.schedule()
    assert pre.used() == 0


def test_a_failed_pull_computes_the_prompt_and_leaks_nothing():
    pre, dec = Side(32), Side(32)
    prompt = list(range(5, 5 + 13))
    dead = make_connector(
        "mooncake", PagedKVCache(2, 4, BS, 2, 8, torch.float32, "cpu"), "127.0.0.1", 5
    )
    address = dead.address
    dead.close()  # nobody answers there any more
    for rid, agents in ((1, [address]), (2, [pre.connector.address])):  # dead / unknown key
        kv = {"transfer_id": f"x{rid}", "do_remote_prefill": True, "remote_agents": agents}
        req = dec.sched.add(RequestSpec(rid, prompt, SamplingParams(kv_transfer_params=kv), 0.0))
        batch = dec.sched.schedule()
        assert batch.num_new_tokens == [len(prompt)] and req.num_computed_tokens == 0
        assert len(req.block_table) == -(-len(prompt) // BS)
        dec.sched.abort(rid)
        assert dec.used() == 0
    assert dec.connector.counters["kv_transfer_failures"] == 2


def test_parked_blocks_expire_when_no_decode_instance_comes():
    pre = Side(32, timeout=0.2)
    run_prompt(pre, 1, list(range(5, 5 + 13)), {"transfer_id": "t", "do_remote_decode": True})
    assert pre.used() > 0
    time.sleep(0.3)
    pre.sched.schedule()
    assert pre.used() == 0 and pre.connector.counters["kv_parked_expired"] == 1


def test_transfer_params_are_checked():
    with pytest.raises(ValueError, match="exactly one"):
        KVTransferParams("t")
    with pytest.raises(ValueError, match="remote_agents"):
        KVTransferParams("t", do_remote_prefill=True)
    with pytest.raises(ValueError, match="host:port"):
        KVTransferParams("t", do_remote_prefill=True, remote_agents=("nohost",))
    with pytest.raises(ValueError, match="unknown key"):
        SamplingParams(kv_transfer_params={"transfer_id": "t", "do_remote_decode": True, "x": 1})
    assert transfer_key("t", [1, 2]) != transfer_key("t", [1, 3])


def test_roles_need_a_connector():
    from splitmoe.config import KVTransferConfig

    assert KVTransferConfig().kv_role == "both"
    with pytest.raises(ValueError, match="kv_connector='mooncake'"):
        KVTransferConfig(kv_role="prefill")
    with pytest.raises(ValueError, match="kv_role"):
        KVTransferConfig(kv_role="decoder", kv_connector="mooncake")
    assert KVTransferConfig(kv_role="decode", kv_connector="mooncake").kv_connector == "mooncake"
