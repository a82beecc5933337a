"""What a request returns to the user."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field


@dataclass(frozen=True)
class RequestMetrics:
    """Times in seconds, measured on the attention rank that served the request.

    ``queue_time``: arrival to the first step that computed any of its tokens; ``ttft``: arrival
    to first token (so it includes the queue time); ``tbt``: every inter-token gap, so
    ``e2e_latency == ttft + sum(tbt)``; ``tpot``: their mean.
    """

    arrival_time: float
    queue_time: float
    ttft: float
    tpot: float
    e2e_latency: float
    num_prompt_tokens: int
    num_output_tokens: int
    num_preemptions: int = 0
    num_cached_tokens: int = 0  # prompt tokens whose KV came from the prefix cache
    # prefill-decode disaggregation (decode side): the pull of the prompt's KV from the prefill
    # instance, part of ``ttft`` (0 and 0 when the request pulled nothing)
    kv_transfer_time: float = 0.0
    kv_transfer_bytes: int = 0
    tbt: tuple[float, ...] = ()

    def to_dict(self) -> dict:
        return asdict(self)


def request_error(stage: str, error: BaseException) -> str:
    """`RequestOutput.error` for a request that failed alone when ``stage`` raised ``error``
    (one line, bounded: the traceback goes to the log)."""
    return f"{stage} failed: {type(error).__name__}: {error}"[:500]


@dataclass
class RequestOutput:
    """The result of one prompt.

    ``finish_reason``: ``"length"``, ``"stop"``, ``"abort"`` (`LLM.abort`, a client that went
    away) or ``"error"``: handling this request alone raised (in its rank's sampler, or in the
    front end's stop-string check or detokenizer); ``error`` then says what failed, the log has
    the traceback under its request id, and every other request ran on unaffected."""

    request_id: int
    prompt_token_ids: list[int]
    token_ids: list[int] = field(default_factory=list)
    text: str | None = None
    finish_reason: str | None = None  # "length" | "stop" | "abort" | "error"
    metrics: RequestMetrics | None = None
    attention_rank: int | None = None  # which data-parallel attention rank served it
    # with SamplingParams.logprobs: per output token, (its logprob, [(token, logprob)] of the
    # most likely tokens)
    logprobs: list[tuple[float, list[tuple[int, float]]]] | None = None
    error: str | None = None  # with finish_reason "error": what failed

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
            "attention_rank": self.attention_rank,
            "logprobs": self.logprobs,
            "error": self.error,
        }


@dataclass(frozen=True)
class StreamDelta:
    """What `LLM.stream` yields each time a request makes progress.

    ``index``: position of the prompt in the call; ``token_ids``/``text``: only what is new (text
    is held back while it ends in an incomplete UTF-8 sequence); ``output``: the complete
    `RequestOutput` once ``finish_reason`` is set, else None.
    """

    index: int
    request_id: int
    token_ids: list[int]
    text: str
    finish_reason: str | None = None
    output: RequestOutput | None = None
