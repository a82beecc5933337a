"""Serving metrics: per-step records from the attention ranks, and summaries over many requests.

`summarize` turns finished `RequestOutput`s and the `StepRecord`s of the same period into one
`ServingMetrics`: throughput, latency percentiles (TTFT, TBT), KV-cache usage and batch sizes.
"""

from __future__ import annotations

import statistics
from dataclasses import asdict, dataclass

from splitmoe.outputs import RequestOutput


@dataclass(frozen=True)
class StepRecord:
    """One executed step of one attention rank."""

    rank: int
    time: float
    num_seqs: int  # requests with tokens in this step
    num_tokens: int  # tokens computed (prompt chunks + decode tokens)
    num_decode: int  # requests that computed exactly one token past their prompt
    kv_blocks_used: int
    kv_blocks_total: int
    num_waiting: int
    num_preemptions: int  # cumulative on this rank


def percentile(values: list[float], q: float) -> float:
    """Linear-interpolated percentile (q in [0, 100]); 0.0 for no values."""
    if not values:
        return 0.0
    s = sorted(values)
    pos = (len(s) - 1) * q / 100
    lo = int(pos)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


@dataclass(frozen=True)
class ServingMetrics:
    num_requests: int
    input_tokens: int
    output_tokens: int
    duration_s: float
    input_tok_s: float
    output_tok_s: float
    ttft_p50: float
    ttft_p90: float
    ttft_p99: float
    tbt_p50: float
    tbt_p90: float
    tbt_p99: float
    tpot_mean: float
    e2e_mean: float
    queue_mean: float
    num_steps: int
    seqs_per_step_mean: float
    seqs_per_step_max: int
    tokens_per_step_mean: float
    kv_usage_mean: float
    kv_usage_max: float
    num_preemptions: int
    cached_tokens: int = 0  # prompt tokens served from the prefix cache
    prefix_cache_hit_rate: float = 0.0  # cached_tokens / input_tokens

    def to_dict(self) -> dict:
        return asdict(self)

    def table(self) -> str:
        ms = 1e3
        rows = [
            ("requests", f"{self.num_requests}"),
            ("input / output tokens", f"{self.input_tokens} / {self.output_tokens}"),
            ("duration", f"{self.duration_s:.2f} s"),
            ("throughput in / out", f"{self.input_tok_s:.1f} / {self.output_tok_s:.1f} tok/s"),
            (
                "TTFT p50 / p90 / p99",
                f"{self.ttft_p50 * ms:.1f} / {self.ttft_p90 * ms:.1f} / "
                f"{self.ttft_p99 * ms:.1f} ms",
            ),
            (
                "TBT p50 / p90 / p99",
                f"{self.tbt_p50 * ms:.2f} / {self.tbt_p90 * ms:.2f} / {self.tbt_p99 * ms:.2f} ms",
            ),
            ("TPOT mean", f"{self.tpot_mean * ms:.2f} ms"),
            ("e2e mean / queue mean", f"{self.e2e_mean * ms:.1f} / {self.queue_mean * ms:.1f} ms"),
            ("steps (all ranks)", f"{self.num_steps}"),
            (
                "seqs per step mean / max",
                f"{self.seqs_per_step_mean:.1f} / {self.seqs_per_step_max}",
            ),
            ("tokens per step mean", f"{self.tokens_per_step_mean:.1f}"),
            ("KV usage mean / max", f"{self.kv_usage_mean:.1%} / {self.kv_usage_max:.1%}"),
            ("preemptions", f"{self.num_preemptions}"),
            (
                "prefix cache hits",
                f"{self.cached_tokens} tokens ({self.prefix_cache_hit_rate:.1%} of input)",
            ),
        ]
        width = max(len(k) for k, _ in rows)
        return "\n".join(f"{k:<{width}}  {v}" for k, v in rows)


def summarize(
    outputs: list[RequestOutput], steps: list[StepRecord], duration_s: float
) -> ServingMetrics:
    """Aggregates over finished requests and the steps that served them."""
    done = [o for o in outputs if o.metrics is not None]
    m = [o.metrics for o in done]
    ttft = [x.ttft for x in m]
    tbt = [g for x in m for g in x.tbt]
    inp = sum(x.num_prompt_tokens for x in m)
    out = sum(x.num_output_tokens for x in m)
    dur = max(duration_s, 1e-9)
    usage = [s.kv_blocks_used / s.kv_blocks_total for s in steps if s.kv_blocks_total]

    def mean(xs):
        return statistics.fmean(xs) if xs else 0.0

    return ServingMetrics(
        num_requests=len(done),
        input_tokens=inp,
        output_tokens=out,
        duration_s=duration_s,
        input_tok_s=inp / dur,
        output_tok_s=out / dur,
        ttft_p50=percentile(ttft, 50),
        ttft_p90=percentile(ttft, 90),
        ttft_p99=percentile(ttft, 99),
        tbt_p50=percentile(tbt, 50),
        tbt_p90=percentile(tbt, 90),
        tbt_p99=percentile(tbt, 99),
        tpot_mean=mean([x.tpot for x in m if x.num_output_tokens > 1]),
        e2e_mean=mean([x.e2e_latency for x in m]),
        queue_mean=mean([x.queue_time for x in m]),
        num_steps=len(steps),
        seqs_per_step_mean=mean([s.num_seqs for s in steps]),
        seqs_per_step_max=max((s.num_seqs for s in steps), default=0),
        tokens_per_step_mean=mean([s.num_tokens for s in steps]),
        kv_usage_mean=mean(usage),
        kv_usage_max=max(usage, default=0.0),
        num_preemptions=sum(x.num_preemptions for x in m),
        cached_tokens=(cached := sum(x.num_cached_tokens for x in m)),
        prefix_cache_hit_rate=cached / inp if inp else 0.0,
    )
