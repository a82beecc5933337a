"""One instance's attention rank without a model (a KV pool, its blocks, a scheduler, a
Mooncake connector), for the connector's and the agent's tests."""

from __future__ import annotations

import os
import socket
import threading
import time

import torch

from splitmoe.attention_nodes.kv_cache import GroupedKVCache, PagedKVCache
from splitmoe.config import KVTransferConfig, SchedulerConfig
from splitmoe.kv_transfer.connectors import make_connector
from splitmoe.sampling_params import SamplingParams
from splitmoe.scheduler.block_manager import BlockManager
from splitmoe.scheduler.request import RequestSpec
from splitmoe.scheduler.scheduler import Scheduler
from splitmoe.scheduler.window_blocks import NULL_BLOCK, SlidingWindowBlocks

BS = 4
KV_SECRET = os.environ["SPLITMOE_KV_SECRET"].encode()  # (tests/pd/conftest.py)


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
        self.connector = make_connector(mooncake(timeout), self.cache)
        self.sched = Scheduler(
            SchedulerConfig(), self.blocks, (), 1 << 20, self.window_blocks, self.connector
        )

    def pools(self) -> list[torch.Tensor]:
        c = self.cache
        return [c.full.pool, c.window.pool] if hasattr(c, "window") else [c.pool]

    def used(self) -> int:
        return self.blocks.num_used + (self.window_blocks.num_used if self.window_blocks else 0)


def mooncake(timeout: float = 30.0, **kw) -> KVTransferConfig:
    return KVTransferConfig(kv_connector="mooncake", kv_transfer_timeout=timeout, **kw)


def schedule_until(side: Side, done, timeout: float = 20.0):
    """Steps ``side`` until ``done()`` (a pull runs off the step loop and lands in a later step);
    the last step's batch."""
    deadline = time.monotonic() + timeout
    while True:
        batch = side.sched.schedule()
        if done():
            return batch
        assert time.monotonic() < deadline, "the pull did not land"
        time.sleep(0.005)


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


class HungAgent:
    """A prefill instance's KV agent that accepts connections and never answers."""

    def __init__(self):
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.address = f"127.0.0.1:{self.sock.getsockname()[1]}"
        self.conns = []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self):
        while True:
            try:
                self.conns.append(self.sock.accept()[0])
            except OSError:
                return

    def close(self):
        self.sock.close()
        for c in self.conns:
            c.close()
