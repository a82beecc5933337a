"""The server's Prometheus metrics (``GET /metrics``), named as vLLM names its own (with the
``splitmoe:`` prefix) so that existing dashboards read them with a prefix change.

Counters and histograms are updated by the engine thread as each request finishes; the gauges
(running and waiting requests, KV-cache usage, prefix-cache contents, expert-rank load) come from
the counters the ranks publish on their own (`AsyncEngine.latest_stats`), read when the endpoint
is scraped: a scrape asks no rank and never waits for a step.
"""

from __future__ import annotations

import time

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from splitmoe.outputs import RequestOutput

LATENCY_BUCKETS = (
    0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
    7.5, 10.0, 20.0, 40.0, 80.0,
)  # fmt: skip


class ServerMetrics:
    def __init__(self, model_name: str):
        self.registry = CollectorRegistry()
        self._label = {"model_name": model_name}
        self._request_metrics()
        self._rank_gauges()
        self._transfer_metrics()
        self._queries = self._hits = 0
        self._finished = 0  # requests counted: a scrape re-renders only when something moved
        self._scraped: tuple[tuple, bytes] | None = None

    def _counter(self, name, doc, extra=()):
        return Counter(f"splitmoe:{name}", doc, ["model_name", *extra], registry=self.registry)

    def _gauge(self, name, doc, extra=()):
        return Gauge(f"splitmoe:{name}", doc, ["model_name", *extra], registry=self.registry)

    def _histogram(self, name, doc):
        return Histogram(
            f"splitmoe:{name}", doc, ["model_name"], buckets=LATENCY_BUCKETS, registry=self.registry
        )

    def _request_metrics(self) -> None:
        self.request_success = self._counter(
            "request_success", "Finished requests by finish reason", ("finished_reason",)
        )
        self.prompt_tokens = self._counter("prompt_tokens", "Prompt tokens of finished requests")
        self.generation_tokens = self._counter(
            "generation_tokens", "Generated tokens of finished requests"
        )
        self.prefix_queries = self._counter(
            "prefix_cache_queries", "Prompt tokens looked up in the prefix cache"
        )
        self.prefix_hits = self._counter(
            "prefix_cache_hits", "Prompt tokens whose KV came from the prefix cache"
        )
        self.ttft = self._histogram("time_to_first_token_seconds", "Arrival to first token")
        self.tbt = self._histogram("inter_token_latency_seconds", "Time between two output tokens")
        self.e2e = self._histogram("e2e_request_latency_seconds", "Arrival to last token")
        self.queue = self._histogram("request_queue_time_seconds", "Arrival to first scheduling")

    def _rank_gauges(self) -> None:
        self.running = self._gauge(
            "num_requests_running", "Requests in the attention ranks' batches"
        )
        self.waiting = self._gauge("num_requests_waiting", "Requests waiting to be scheduled")
        self.kv_usage = self._gauge("kv_cache_usage_perc", "KV-cache blocks in use (1 = all)")
        self.prefix_hit_rate = self._gauge(
            "prefix_cache_hit_rate", "Cached / looked-up prompt tokens since start-up"
        )
        self.prefix_blocks = self._gauge(
            "prefix_cache_blocks", "Full KV blocks indexed in the prefix cache", ("rank",)
        )
        self.expert_tokens = self._gauge(
            "expert_rank_tokens", "Tokens an expert rank has served since start-up", ("rank",)
        )
        self.imbalance = self._gauge(
            "expert_rank_imbalance",
            "Most loaded expert rank's tokens over the mean (1 = balanced; 0 when colocated)",
        )
        self.preemptions = self._gauge("num_preemptions", "Preemptions since start-up")
        self.stats_age = self._gauge(
            "rank_stats_age_seconds",
            "Age of the rank's latest published counters, which the gauges above read",
            ("rank",),
        )

    def _transfer_metrics(self) -> None:
        # prefill-decode disaggregation (docs/pd.md): a decode instance's TTFT is its queue
        # time, the pull of the prompt's KV from the prefill instance and its first step; a
        # prefill instance's TTFT is the prefill (it computes one token per request)
        self.kv_transfer_time = self._histogram(
            "kv_transfer_time_seconds", "Decode side: a request's pull of its prompt's KV"
        )
        self.first_decode_step = self._histogram(
            "first_decode_step_seconds",
            "Decode side: TTFT less the queue time and the KV pull, for pulled requests",
        )
        # (the attention ranks' connector counters, summed; named as in their stats)
        self.kv_transfer_gauges = {
            name: self._gauge(name, doc)
            for name, doc in (
                ("kv_transfers", "Prompts' KV pulled from prefill instances since start-up"),
                ("kv_transfer_failures", "Pulls that failed (the prompt was computed here)"),
                ("kv_transfer_bytes", "Bytes pulled since start-up"),
                ("kv_transfer_seconds", "Seconds spent pulling since start-up"),
                ("kv_pulling", "Requests whose prompt KV is being pulled now"),
                ("kv_parked", "Prompts whose blocks wait for a decode instance"),
                ("kv_parked_expired", "Parked prompts nobody came for in time"),
            )
        }
        self.kv_bandwidth = self._gauge(
            "kv_transfer_bandwidth_bytes_per_second",
            "Bytes pulled over the seconds spent pulling, since start-up (0 before any)",
        )
        # fault tolerance (docs/fault_tolerance.md): recoveries from a lost rank
        self.recoveries = self._counter("recoveries", "Recoveries from a lost rank")
        self.recovery_time = self._histogram(
            "recovery_time_seconds",
            "A recovery on attention rank 0: from the failure seen to the job rebuilt",
        )

    def recovered(self, seconds: float) -> None:
        """Counts a recovery from a lost rank (the engine thread calls this)."""
        self.recoveries.labels(**self._label).inc()
        self.recovery_time.labels(**self._label).observe(seconds)
        self._scraped = None  # (the next scrape shows it)

    def finished(self, out: RequestOutput, now: float) -> None:
        """Counts a finished request (the engine thread calls this)."""
        try:
            self._count(out)
        finally:  # (after the counters moved: a scrape that sees the new count sees them)
            self._finished += 1

    def _count(self, out: RequestOutput) -> None:
        m, lab = out.metrics, self._label
        self.request_success.labels(**lab, finished_reason=out.finish_reason).inc()
        if m is None or out.finish_reason == "abort":  # (its client left: no latency to tell)
            return
        self.prompt_tokens.labels(**lab).inc(m.num_prompt_tokens)
        self.generation_tokens.labels(**lab).inc(len(out.token_ids))
        self.prefix_queries.labels(**lab).inc(m.num_prompt_tokens)
        self.prefix_hits.labels(**lab).inc(m.num_cached_tokens)
        self._queries += m.num_prompt_tokens
        self._hits += m.num_cached_tokens
        self.prefix_hit_rate.labels(**lab).set(self._hits / self._queries if self._queries else 0)
        if m.num_output_tokens:
            self.ttft.labels(**lab).observe(m.ttft)
            self.e2e.labels(**lab).observe(m.e2e_latency)
        self.queue.labels(**lab).observe(m.queue_time)
        tbt = self.tbt.labels(**lab)
        for gap in m.tbt:
            tbt.observe(gap)
        if m.kv_transfer_bytes:
            self.kv_transfer_time.labels(**lab).observe(m.kv_transfer_time)
            if m.num_output_tokens:
                step = m.ttft - m.queue_time - m.kv_transfer_time
                self.first_decode_step.labels(**lab).observe(max(0.0, step))

    def update_from_stats(
        self, stats: list[dict], unfinished: int, now: float | None = None
    ) -> None:
        """Sets the gauges from the ranks' counters (`LLM.latest_stats`, or `LLM.stats`);
        ``now``: the ``time.time()`` their ``published_at`` is compared with (default: now)."""
        lab = self._label
        now = time.time() if now is None else now
        for s in stats:
            if "published_at" in s:
                age = max(0.0, now - s["published_at"])
                self.stats_age.labels(**lab, rank=str(s["rank"])).set(age)
        attn = [s for s in stats if s.get("role") == "attention"]
        used = sum(s.get("kv_blocks_used", 0) for s in attn)
        total = sum(s.get("kv_blocks_total", 0) for s in attn)
        running = sum(s.get("running", 0) for s in attn)
        self.running.labels(**lab).set(running)
        self.waiting.labels(**lab).set(max(0, unfinished - running))
        self.kv_usage.labels(**lab).set(used / total if total else 0.0)
        self.preemptions.labels(**lab).set(sum(s.get("preemptions", 0) for s in attn))
        for s in attn:
            self.prefix_blocks.labels(**lab, rank=str(s["rank"])).set(
                s.get("prefix_cached_blocks", 0)
            )
        served = [(s["rank"], s.get("tokens_served", 0)) for s in stats if s["role"] == "expert"]
        for rank, n in served:
            self.expert_tokens.labels(**lab, rank=str(rank)).set(n)
        loads = [n for _, n in served]
        mean = sum(loads) / len(loads) if loads else 0
        self.imbalance.labels(**lab).set(max(loads) / mean if mean else 0.0)
        kv = {k: sum(s.get(k, 0) for s in attn) for k in self.kv_transfer_gauges}
        for k, g in self.kv_transfer_gauges.items():
            g.labels(**lab).set(kv[k])
        secs = kv["kv_transfer_seconds"]
        self.kv_bandwidth.labels(**lab).set(kv["kv_transfer_bytes"] / secs if secs else 0.0)

    def render(self) -> bytes:
        return generate_latest(self.registry)

    def scrape(self, stats: list[dict], unfinished: int, now: float | None = None) -> bytes:
        """``update_from_stats`` then ``render``, or the last scrape's bytes where nothing it
        reads has moved since (no request finished, no rank published, the same second: the
        snapshots' ages are then stale by under a second). Rendering costs ~1 ms of the CPU the
        ranks share; a dashboard scraping often would take it from their decode."""
        now = time.time() if now is None else now
        stamps = tuple((s.get("rank"), s.get("published_at")) for s in stats)
        key = (self._finished, stamps, unfinished, int(now))
        if self._scraped is not None and self._scraped[0] == key:
            return self._scraped[1]
        self.update_from_stats(stats, unfinished, now)
        body = self.render()
        self._scraped = (key, body)
        return body
