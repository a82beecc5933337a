"""A request as an attention rank tracks it."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

from splitmoe.outputs import RequestMetrics
from splitmoe.sampling_params import SamplingParams
from splitmoe.scheduler.block_manager import block_hashes


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class RequestSpec:
    """What the front end sends to an attention rank (picklable)."""

    request_id: int
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival_time: float
    # tokens it generated already on an attention rank that was lost (fault tolerance): the
    # request resumes here as a preempted one does, computing prompt + these before the next
    output_token_ids: list[int] = field(default_factory=list)


@dataclass
class Request:
    spec: RequestSpec
    eos_token_ids: tuple[int, ...] = ()
    max_model_len: int = 1 << 30
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    block_table: list[int] = field(default_factory=list)
    window_table: list[int] = field(default_factory=list)  # sliding-window layers' blocks
    status: Status = Status.WAITING
    finish_reason: str | None = None
    num_preemptions: int = 0
    first_scheduled_time: float | None = None
    token_times: list[float] = field(default_factory=list)
    # prefix caching: chained digests of the full blocks so far (`block_manager.block_hashes`,
    # salted with the request's cache_salt), how many of the table's blocks are indexed in the
    # cache, and the prompt tokens that the first admission found cached
    block_hashes: list[bytes] = field(default_factory=list)
    num_indexed_blocks: int = 0
    num_cached_tokens: int = 0
    # prefill-decode disaggregation: whether this (decode-side) request tried its pull already
    kv_pulled: bool = False
    kv_pull_deadline: float = 0.0  # (`time.monotonic`) its pull is abandoned after it
    kv_transfer_time: float = 0.0  # seconds its pull took (`RequestMetrics`)
    kv_transfer_bytes: int = 0
    # fixed at creation; the step loop reads them once per request and token
    prompt_len: int = field(init=False)
    _stop_ids: frozenset[int] = field(init=False, repr=False)
    _max_num_tokens: int = field(init=False, repr=False)

    def __post_init__(self) -> None:
        p = self.spec.params
        self.prompt_len = len(self.spec.prompt_token_ids)
        self.output_token_ids = list(self.spec.output_token_ids)
        self._stop_ids = frozenset(p.stop_token_ids) | (
            frozenset() if p.ignore_eos else frozenset(self.eos_token_ids)
        )
        self._max_num_tokens = min(self.prompt_len + p.max_tokens, self.max_model_len)

    @property
    def request_id(self) -> int:
        return self.spec.request_id

    @property
    def params(self) -> SamplingParams:
        return self.spec.params

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.spec.prompt_token_ids

    @property
    def num_tokens(self) -> int:
        return self.prompt_len + len(self.output_token_ids)

    def token_ids(self, start: int, end: int) -> list[int]:
        """Tokens ``start .. end - 1`` of prompt + output."""
        p = self.prompt_len
        if end <= p:
            return self.spec.prompt_token_ids[start:end]
        if start >= p:
            return self.output_token_ids[start - p : end - p]
        return self.spec.prompt_token_ids[start:] + self.output_token_ids[: end - p]

    def hashes_upto(self, num_tokens: int, block_size: int) -> list[bytes]:
        """`block_hashes` extended over the full blocks of the first ``num_tokens`` tokens."""
        full = num_tokens // block_size
        have = len(self.block_hashes)
        if full > have:
            parent = self.block_hashes[-1] if have else None
            tokens = self.token_ids(have * block_size, full * block_size)
            self.block_hashes += block_hashes(
                tokens, block_size, parent, salt=self.spec.params.cache_salt
            )
        return self.block_hashes

    def token_at(self, i: int) -> int:
        """Token ``i`` of prompt + output."""
        p = self.prompt_len
        return self.output_token_ids[i - p] if i >= p else self.spec.prompt_token_ids[i]

    def append_token(self, token: int, now: float) -> None:
        self.output_token_ids.append(token)
        self.token_times.append(now)
        # (before min_tokens the sampler masks the stop tokens; as vLLM, none stops it either)
        if token in self._stop_ids and len(self.output_token_ids) > self.spec.params.min_tokens:
            self.finish_reason = "stop"
        elif self.num_tokens >= self._max_num_tokens:
            self.finish_reason = "length"

    def finishes_with(self, token: int) -> bool:
        """Whether appending ``token`` next finishes this request (as `append_token` decides)."""
        return token in self._stop_ids or self.num_tokens + 1 >= self._max_num_tokens

    def metrics(self) -> RequestMetrics:
        arrival = self.spec.arrival_time
        times = self.token_times or [time.time()]
        n = len(self.output_token_ids)
        return RequestMetrics(
            arrival_time=arrival,
            queue_time=(self.first_scheduled_time or arrival) - arrival,
            ttft=times[0] - arrival,
            tpot=(times[-1] - times[0]) / (n - 1) if n > 1 else 0.0,
            e2e_latency=times[-1] - arrival,
            num_prompt_tokens=self.prompt_len,
            num_output_tokens=n,
            num_preemptions=self.num_preemptions,
            num_cached_tokens=self.num_cached_tokens,
            kv_transfer_time=self.kv_transfer_time,
            kv_transfer_bytes=self.kv_transfer_bytes,
            tbt=tuple(b - a for a, b in zip(times, times[1:])),
        )
