"""Continuous batching for one attention rank.

Each step is a plan ``{request: new tokens}`` under a token budget: running requests first (a
decode token each, or their next prompt chunk), then waiting requests in arrival order, so a long
prompt is chunked and never stalls the running streams. There are no separate prefill and decode
modes. When the KV pool cannot hold a step, the most recently admitted request is preempted (its
blocks freed, its tokens recomputed later); no accepted request is dropped.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

from splitmoe.config import SchedulerConfig
from splitmoe.scheduler.block_manager import BlockManager
from splitmoe.scheduler.request import Request, RequestSpec, Status
from splitmoe.scheduler.window_blocks import SlidingWindowBlocks


@dataclass
class ScheduledBatch:
    """``num_new_tokens[i]`` tokens of ``requests[i]`` are computed this step."""

    requests: list[Request] = field(default_factory=list)
    num_new_tokens: list[int] = field(default_factory=list)

    @property
    def total_tokens(self) -> int:
        return sum(self.num_new_tokens)

    def __len__(self) -> int:
        return len(self.requests)


class Scheduler:
    def __init__(
        self,
        cfg: SchedulerConfig,
        blocks: BlockManager,
        eos_token_ids: tuple[int, ...],
        max_model_len: int,
        window_blocks: SlidingWindowBlocks | None = None,
    ):
        self.cfg = cfg
        self.blocks = blocks
        # the sliding-window layers' KV group, when the model has one (`window_blocks`)
        self.window_blocks = window_blocks
        self.eos_token_ids = eos_token_ids
        self.max_model_len = max_model_len
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.num_preemptions = 0

    def add(self, spec: RequestSpec) -> Request:
        req = Request(spec, eos_token_ids=self.eos_token_ids, max_model_len=self.max_model_len)
        self.waiting.append(req)
        return req

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    @property
    def num_unfinished(self) -> int:
        return len(self.waiting) + len(self.running)

    def _grow(self, req: Request, num_tokens: int) -> bool:
        """Extends the request's block tables to ``num_tokens``; False (nothing taken) if a
        pool is full."""
        if self.window_blocks is None:
            return self.blocks.grow(req.block_table, num_tokens)
        return (
            self.blocks.can_grow(req.block_table, num_tokens)
            and self.window_blocks.grow(req.window_table, num_tokens, req.num_computed_tokens)
            and self.blocks.grow(req.block_table, num_tokens)
        )

    def _free(self, req: Request) -> None:
        self.blocks.free(req.block_table)
        if self.window_blocks is not None:
            self.window_blocks.free(req.window_table)

    def _preempt(self, req: Request) -> None:
        self.running.remove(req)
        self._free(req)
        req.num_computed_tokens = 0
        req.status = Status.WAITING
        req.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(req)

    def schedule(self) -> ScheduledBatch:
        batch = ScheduledBatch()
        budget = self.cfg.max_num_batched_tokens
        preempted = False
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            n = min(req.num_tokens - req.num_computed_tokens, budget)
            while not self._grow(req, req.num_computed_tokens + n):
                victim = self.running[-1]
                self._preempt(victim)
                preempted = True
                if victim is req:
                    break
            if req.status is not Status.RUNNING:
                break
            batch.requests.append(req)
            batch.num_new_tokens.append(n)
            budget -= n
            i += 1
        now = time.time()
        while (
            self.waiting
            and budget > 0
            and not preempted
            and len(self.running) < self.cfg.max_num_seqs
        ):
            req = self.waiting[0]
            n = min(req.num_tokens - req.num_computed_tokens, budget)
            if not self._grow(req, req.num_computed_tokens + n):
                break
            self.waiting.popleft()
            req.status = Status.RUNNING
            if req.first_scheduled_time is None:
                req.first_scheduled_time = now
            self.running.append(req)
            batch.requests.append(req)
            batch.num_new_tokens.append(n)
            budget -= n
        return batch

    def finish(self, req: Request) -> None:
        req.status = Status.FINISHED
        self.running.remove(req)
        self._free(req)
