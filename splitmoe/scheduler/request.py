"""A request as an attention rank tracks it."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

from splitmoe.outputs import RequestMetrics
from splitmoe.sampling_params import SamplingParams


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


@dataclass
class Request:
    spec: RequestSpec
    eos_token_ids: tuple[int, ...] = ()
    max_model_len: int = 1 << 30
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    block_table: list[int] = field(default_factory=list)
    status: Status = Status.WAITING
    finish_reason: str | None = None
    num_preemptions: int = 0
    first_scheduled_time: float | None = None
    token_times: list[float] = field(default_factory=list)

    @property
    def request_id(self) -> int:
        return self.spec.request_id

    @property
    def params(self) -> SamplingParams:
        return self.spec.params

    @property
    def prompt_len(self) -> int:
        return len(self.spec.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return self.prompt_len + len(self.output_token_ids)

    def token_ids(self, start: int, end: int) -> list[int]:
        prompt = self.spec.prompt_token_ids
        if end <= len(prompt):
            return prompt[start:end]
        return (prompt + self.output_token_ids)[start:end]

    def append_token(self, token: int, now: float) -> None:
        self.output_token_ids.append(token)
        self.token_times.append(now)
        p = self.params
        if token in p.stop_token_ids or (not p.ignore_eos and token in self.eos_token_ids):
            self.finish_reason = "stop"
        elif len(self.output_token_ids) >= p.max_tokens or self.num_tokens >= self.max_model_len:
            self.finish_reason = "length"

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
            tbt=tuple(b - a for a, b in zip(times, times[1:])),
        )
