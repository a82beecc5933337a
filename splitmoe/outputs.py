"""What a request returns to the user."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field


@dataclass(frozen=True)
class RequestMetrics:
    """Times in seconds. ``ttft``: arrival to first token; ``tpot``: mean time per output token
    after the first; ``e2e_latency``: arrival to last token; ``queue_time``: arrival to first
    scheduled step."""

    arrival_time: float
    queue_time: float
    ttft: float
    tpot: float
    e2e_latency: float
    num_prompt_tokens: int
    num_output_tokens: int
    num_preemptions: int = 0

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass
class RequestOutput:
    """The result of one prompt."""

    request_id: int
    prompt_token_ids: list[int]
    token_ids: list[int] = field(default_factory=list)
    text: str | None = None
    finish_reason: str | None = None  # "length" | "stop"
    metrics: RequestMetrics | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def to_dict(self) -> dict:
        return {
            "request_id": self.request_id,
            "prompt_token_ids": self.prompt_token_ids,
            "token_ids": self.token_ids,
            "text": self.text,
            "finish_reason": self.finish_reason,
            "metrics": self.metrics.to_dict() if self.metrics else None,
        }
