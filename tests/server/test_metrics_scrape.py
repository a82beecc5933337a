"""``GET /metrics`` reads the counters the ranks publish on their own: it asks no rank, so it
answers while a rank is stopped mid-generation, and a storm of scrapes during 16 streams
neither fails the job nor changes a token (1 attention + 1 expert rank, tiny Qwen3-MoE)."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families
from server_proc import Server, rank_processes
from tiny_models import prompt_ids

MODEL = "tiny"
STREAMS = 16
MAX_TOKENS = 24


@pytest.fixture(scope="module")
def server(tiny_ckpt):
    srv = Server(
        tiny_ckpt("qwen3_moe"),
        "--served-model-name",
        MODEL,
        "--expert-ranks",
        "1",
        "--max-num-seqs",
        "32",
    )
    yield srv
    srv.stop()


def _samples(text: str, name: str) -> dict[str, float]:
    """``name``'s samples by their ``rank`` label ("" when unlabelled)."""
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == name:
                out[s.labels.get("rank", "")] = s.value
    return out


def _body(i: int, stream: bool) -> dict:
    return {
        "model": MODEL,
        "prompt": prompt_ids(5 + i % 9, seed=400 + i),
        "max_tokens": MAX_TOKENS,
        "temperature": 0,
        "ignore_eos": True,
        "return_token_ids": True,
        "stream": stream,
    }


async def _stream(client: httpx.AsyncClient, url: str, i: int) -> list[int]:
    tokens: list[int] = []
    async with client.stream("POST", url + "/v1/completions", json=_body(i, True)) as r:
        assert r.status_code == 200
        async for line in r.aiter_lines():
            if line.startswith("data: {"):
                for c in json.loads(line[6:])["choices"]:
                    tokens += c.get("token_ids") or []
    return tokens


async def _load(url: str, scrapes: int) -> tuple[list[list[int]], list[float]]:
    """16 concurrent greedy streams; meanwhile ``scrapes`` scrapes of /metrics, back to back
    until the streams finish; returns each stream's tokens and each scrape's seconds."""
    limits = httpx.Limits(max_connections=STREAMS + 4)
    async with httpx.AsyncClient(timeout=60, limits=limits) as client:
        streams = asyncio.gather(*(_stream(client, url, i) for i in range(STREAMS)))
        times = []
        while len(times) < scrapes:
            t0 = time.monotonic()
            r = await client.get(url + "/metrics")
            times.append(time.monotonic() - t0)
            assert r.status_code == 200 and "splitmoe:kv_cache_usage_perc" in r.text
        return await streams, times


def test_scrape_storm_changes_no_token_and_fails_nothing(server):
    quiet, _ = asyncio.run(_load(server.url, 0))
    assert all(len(t) == MAX_TOKENS for t in quiet)
    stormy, times = asyncio.run(_load(server.url, 200))
    assert stormy == quiet
    assert httpx.get(server.url + "/health", timeout=10).status_code == 200
    # the counters of both ranks were there: KV blocks, expert tokens, the snapshots' age
    text = httpx.get(server.url + "/metrics", timeout=10).text
    assert _samples(text, "splitmoe:expert_rank_tokens")["1"] > 0
    assert set(_samples(text, "splitmoe:rank_stats_age_seconds")) == {"0", "1"}
    # all finished: the ranks publish going idle within `runtime.STATS_EVENT_S` of their last
    # step, which a rank on a busy core can take longer to reach
    deadline = time.monotonic() + 10
    while _samples(text, "splitmoe:kv_cache_usage_perc")[""] != 0 and time.monotonic() < deadline:
        time.sleep(0.1)
        text = httpx.get(server.url + "/metrics", timeout=10).text
    assert _samples(text, "splitmoe:kv_cache_usage_perc")[""] == 0


def _ranks(server) -> list[int]:
    return rank_processes(server.proc.pid)


def test_metrics_answer_while_the_ranks_are_stopped(server):
    """Stopped ranks answer nothing: a scrape that asked them waited (and failed the job past
    its wait); this one reads the counters they published while the request ran."""
    ranks = _ranks(server)
    assert len(ranks) == 2
    body = {**_body(0, True), "max_tokens": 150}
    with httpx.Client(timeout=60) as http:
        with http.stream("POST", server.url + "/v1/completions", json=body) as r:
            lines = r.iter_lines()
            seen = 0
            while seen < 3:
                seen += next(lines).startswith("data: {")
            for pid in ranks:
                os.kill(pid, signal.SIGSTOP)
            try:
                time.sleep(0.3)
                for _ in range(5):
                    t0 = time.monotonic()
                    text = http.get(server.url + "/metrics").text
                    assert time.monotonic() - t0 < 1.0
                assert _samples(text, "splitmoe:kv_cache_usage_perc")[""] > 0
                assert _samples(text, "splitmoe:num_requests_running")[""] == 1
            finally:
                for pid in ranks:
                    os.kill(pid, signal.SIGCONT)
            seen += sum(line.startswith("data: {") for line in lines)
    assert seen > 100  # (the rest of the stream came once the ranks went on)
    assert httpx.get(server.url + "/health", timeout=10).status_code == 200
