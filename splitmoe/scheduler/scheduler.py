"""Continuous batching for one attention rank.

Each step is a plan ``{request: new tokens}`` under a token budget: running requests first (a
decode token each, or their next prompt chunk), then waiting requests in arrival order, so a long
prompt is chunked and never stalls the running streams. There are no separate prefill and decode
modes. When the KV pool cannot hold a step, the most recently admitted request is preempted (its
blocks freed, its tokens recomputed later); no accepted request is dropped.

With prefix caching a request that is admitted starts from the longest run of its blocks that
the cache holds (at least its last prompt token is always computed: it gives the logits of the
first output token), and each block that a step fills is indexed for later requests.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field

from splitmoe.config import SchedulerConfig
from splitmoe.kv_transfer import KVConnector, PullResult, transfer_key
from splitmoe.scheduler.block_manager import BlockManager
from splitmoe.scheduler.request import Request, RequestSpec, Status
from splitmoe.scheduler.window_blocks import NULL_BLOCK, SlidingWindowBlocks

logger = logging.getLogger("splitmoe")


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
        kv_connector: KVConnector | None = None,
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
        # prefill-decode disaggregation (`splitmoe.kv_transfer`): prompts' blocks handed over
        # on the prefill side, pulled on the decode side
        self.kv_connector = kv_connector
        self.kv_pull_failures = 0
        # requests whose prompt KV is being read, with the transfer's future (`_start_pull`)
        self.pulling: list[tuple[Request, Future]] = []
        # (a pull still running past its deadline: its request computes the prompt in blocks of
        # its own, and these, which the read may still write, go back when the read ends)
        self.abandoned: list[tuple[list[list[int]], Future]] = []
        self.kv_releases = 0  # parked entries whose blocks came back (`_free_released`)

    def add(self, spec: RequestSpec) -> Request:
        req = Request(spec, eos_token_ids=self.eos_token_ids, max_model_len=self.max_model_len)
        self.waiting.append(req)
        return req

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self.pulling or self.abandoned)

    @property
    def only_transfers(self) -> bool:
        """Nothing to compute until a pull lands (the step loop waits a little, not spins)."""
        return bool(self.pulling or self.abandoned) and not (self.waiting or self.running)

    @property
    def num_unfinished(self) -> int:
        return len(self.waiting) + len(self.running) + len(self.pulling)

    def _grow(self, req: Request, num_tokens: int, cached: Sequence[int] = ()) -> bool:
        """Extends the request's block tables to ``num_tokens`` (starting from the ``cached``
        prefix blocks); False (nothing taken) if a pool is full."""
        if self.window_blocks is None:
            return self.blocks.grow(req.block_table, num_tokens, cached)
        assert not cached, "prefix caching is off with sliding-window layers"
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
        req.num_indexed_blocks = 0
        req.status = Status.WAITING
        req.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(req)

    def schedule(self) -> ScheduledBatch:
        if self.kv_connector is not None:
            self._free_released()
            self._land_pulls()
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
            and len(self.running) + len(self.pulling) < self.cfg.max_num_seqs
        ):
            req = self.waiting[0]
            cached = self._cached_prefix(req)
            start = len(cached) * self.blocks.block_size
            if self._pulls(req):
                if not self._start_pull(req, cached):
                    break  # (the pool cannot hold the prompt now)
                self.waiting.popleft()
                if req.first_scheduled_time is None:
                    req.first_scheduled_time = now
                    req.num_cached_tokens = start
                continue  # (it runs from the step after its blocks arrived: `_land_pulls`)
            n = min(req.num_tokens - start, budget)
            if not self._grow(req, start + n, cached):
                break
            self.waiting.popleft()
            req.num_indexed_blocks = len(cached)
            req.num_computed_tokens = start
            req.status = Status.RUNNING
            if req.first_scheduled_time is None:
                req.first_scheduled_time = now
                req.num_cached_tokens = start
            self.running.append(req)
            batch.requests.append(req)
            batch.num_new_tokens.append(n)
            budget -= n
        return batch

    def _pulls(self, req: Request) -> bool:
        """Whether ``req`` is to pull its prompt's KV from a prefill instance now."""
        kv = req.params.kv_transfer_params
        return (
            self.kv_connector is not None
            and kv is not None
            and kv.do_remote_prefill
            and not req.kv_pulled
        )

    def _start_pull(self, req: Request, cached: list[int]) -> bool:
        """Takes blocks for the whole prompt and starts reading every token but the last from
        the prefill instance (the last one is computed here: its logits give the first output
        token); the local ``cached`` prefix is not read. False: the pool cannot hold the prompt
        now (nothing taken)."""
        bs = self.blocks.block_size
        p = req.prompt_len
        last = self.blocks.blocks_for(p - 1)  # blocks holding tokens 0 .. p - 2
        skip = 0
        if self.window_blocks is not None:
            # entries out of the window of the queries from p - 1 on stay the null block
            skip = min(last, max(0, p - 1 - self.window_blocks.window + 1) // bs)
            if not self.blocks.can_grow(req.block_table, p):
                return None
            req.window_table.extend([NULL_BLOCK] * skip)
            if not self.window_blocks.grow(req.window_table, p, p - 1):
                req.window_table.clear()
                return None
            ok = self.blocks.grow(req.block_table, p)
        else:
            ok = self.blocks.grow(req.block_table, p, cached)
        if not ok:
            self._free(req)
            return False
        req.kv_pulled = True
        req.num_indexed_blocks = len(cached)
        req.num_computed_tokens = len(cached) * bs
        kv = req.params.kv_transfer_params
        tables = [req.block_table] + ([req.window_table] if self.window_blocks else [])
        first = [len(cached)] + ([skip] if self.window_blocks else [])
        key = transfer_key(kv.transfer_id, req.prompt_token_ids)
        future = self.kv_connector.start_pull(kv, key, tables, first, last)
        # (the pull has its own deadline; this one, later, holds whatever the peer does)
        req.kv_pull_deadline = time.monotonic() + 2 * self.kv_connector.timeout_s + 5.0
        self.pulling.append((req, future))
        return True

    def _land_pulls(self) -> None:
        """Requests whose pull ended: running with ``prompt_len - 1`` tokens computed, or (the
        pull failed) back at the queue's head to compute the prompt here; an aborted one's
        blocks go back now that nothing writes them. A pull past its deadline is abandoned:
        its request computes the prompt here at once, in blocks of its own."""
        now = time.monotonic()
        self._free_abandoned()
        still = []
        for req, future in self.pulling:
            if not future.done():
                if now < req.kv_pull_deadline:
                    still.append((req, future))
                    continue
                if req.status is not Status.FINISHED:  # (else it waits for the read to end)
                    self._abandon(req, future)
                    continue
                self.abandoned.append((self._take_tables(req), future))
                continue
            result = _outcome(future)
            req.kv_transfer_time = result.seconds  # (a failed pull's time is in the TTFT too)
            req.kv_transfer_bytes = result.num_bytes
            if req.status is Status.FINISHED:  # aborted while its blocks were being written
                self._free(req)
            elif result.ok:
                req.status = Status.RUNNING
                self.running.append(req)
                self.computed(req, req.prompt_len - 1 - req.num_computed_tokens)
            else:
                self._pull_failed(req, result.error)
                self._free(req)
        self.pulling = still

    def _pull_failed(self, req: Request, error: str | None) -> None:
        """Back at the queue's head (holding no blocks), to compute its prompt here."""
        self.kv_pull_failures += 1
        logger.warning(
            "request %d: KV pull failed (%s); its prompt is computed here", req.request_id, error
        )
        req.num_computed_tokens = req.num_indexed_blocks = 0
        self.waiting.appendleft(req)

    def _abandon(self, req: Request, future: Future) -> None:
        self.abandoned.append((self._take_tables(req), future))
        self._pull_failed(req, "no answer within the pull's deadline")

    def _take_tables(self, req: Request) -> list[list[int]]:
        """The request's block tables, moved out of it (it holds none after)."""
        tables = [list(req.block_table), list(req.window_table)]
        req.block_table.clear()
        req.window_table.clear()
        return tables

    def _free_abandoned(self) -> None:
        still = []
        for tables, future in self.abandoned:
            if not future.done():
                still.append((tables, future))
                continue
            self.blocks.free(tables[0])
            if self.window_blocks is not None:
                self.window_blocks.free(tables[1])
        self.abandoned = still

    def _free_released(self) -> None:
        """Frees the blocks that prefill-side transfers are done with (or that expired)."""
        for tables in self.kv_connector.take_released():
            self.kv_releases += 1
            self.blocks.free(tables[0])
            if self.window_blocks is not None and len(tables) > 1:
                self.window_blocks.free(tables[1])

    def _cached_prefix(self, req: Request) -> list[int]:
        """The cached blocks that a waiting request (holding no blocks) can start from."""
        if not self.blocks.enable_prefix_caching:
            return []
        bs = self.blocks.block_size
        hashes = req.hashes_upto(req.num_tokens, bs)
        return self.blocks.match(hashes, (req.num_tokens - 1) // bs)

    def computed(self, req: Request, n: int) -> None:
        """``n`` more tokens of ``req`` are in the KV cache: indexes the blocks they filled."""
        req.num_computed_tokens += n
        if self.blocks.enable_prefix_caching:
            bs = self.blocks.block_size
            full = req.num_computed_tokens // bs
            if full > req.num_indexed_blocks:
                hashes = req.hashes_upto(full * bs, bs)
                self.blocks.cache_blocks(req.block_table, hashes[:full], req.num_indexed_blocks)
                req.num_indexed_blocks = full

    def finish(self, req: Request) -> None:
        req.status = Status.FINISHED
        self.running.remove(req)
        kv = req.params.kv_transfer_params
        if self.kv_connector is not None and kv is not None and kv.do_remote_decode:
            # handed over: the blocks come back through `_free_released` (unless the instance
            # parks all it may already: then they are freed now, and readers compute the prompt)
            tables = [req.block_table] + ([req.window_table] if self.window_blocks else [])
            key = transfer_key(kv.transfer_id, req.prompt_token_ids)
            if self.kv_connector.park(kv.transfer_id, key, tables, kv.num_readers):
                req.block_table.clear()
                req.window_table.clear()
                return
        self._free(req)

    def abort(self, request_id: int) -> Request | None:
        """Drops a waiting or running request and frees its blocks at once (the client went
        away, or a stop string ended it); None if it is not here (it finished already)."""
        for queue in (self.running, self.waiting):
            for req in queue:
                if req.request_id == request_id:
                    queue.remove(req)
                    self._free(req)
                    req.status = Status.FINISHED
                    req.finish_reason = "abort"
                    return req
        for req, _ in self.pulling:
            if req.request_id == request_id and req.status is not Status.FINISHED:
                # its blocks are being written: `_land_pulls` frees them when the read ends
                req.status = Status.FINISHED
                req.finish_reason = "abort"
                return req
        return None


def _outcome(future: Future) -> PullResult:
    """A finished pull's result; a failed one if the future itself broke (it never should:
    `KVConnector.start_pull` turns every failure into a result)."""
    try:
        return future.result()
    except Exception as e:  # (cancelled at shutdown, or a bug below the connector)
        return PullResult(False, error=f"{type(e).__name__}: {e}")
